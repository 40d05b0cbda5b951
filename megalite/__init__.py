"""megalite: a small, exact Megatron-style tensor-parallel trainer for decoder-only LMs."""
