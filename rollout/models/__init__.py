"""The `vllm.general_plugins` entry point as installs made before the model families moved to rl/models/
name it (`sparkrl_models = "rollout.models:register"`); pyproject.toml now names rl.models'. Both register
the same models."""

from __future__ import annotations


def register() -> None:
    from rl.models import register_vllm_models

    register_vllm_models()
