"""Benchmarks: ``python -m tpfuse bench kernel`` (under torchrun or on all local GPUs)."""
