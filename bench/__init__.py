"""Benchmark commands on the product's own parts: `python -m bench.rollout|sync|kl|trainer|grpo` (bench/README.md)."""
