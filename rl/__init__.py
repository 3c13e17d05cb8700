"""sparkrl: LoRA GRPO post-training of large mixture-of-experts models.

Packages: `rl` (config, data, reward, algorithm, driver, metrics, models, CLI), `rollout` (the vLLM
side), `trainer` (the FSDP2 side).
"""

__version__ = "0.1.0"
