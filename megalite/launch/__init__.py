"""Launching runs: Slurm job arrays from YAML sweeps, and their status."""
