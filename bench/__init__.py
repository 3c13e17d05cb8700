"""Benchmarks of issue 11, run on the GPU machine by `python -m bench.run_all` (see bench/README.md)."""
