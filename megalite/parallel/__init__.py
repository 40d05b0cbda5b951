"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) over explicit process groups."""
