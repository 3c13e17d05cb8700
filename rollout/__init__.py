"""Rollout: vLLM engines in Ray actors, the conversions around them, and a data-parallel pool of them."""
