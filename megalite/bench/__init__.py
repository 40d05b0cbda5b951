"""Benchmarks: throughput sweeps (`megalite bench`), communication accounting, the scaling model."""
