"""Model implementations the rollout engine (vLLM) does not ship, and the plugin that registers them.

`register` is the `vllm.general_plugins` entry point (pyproject: `sparkrl_models = "rollout.models:register"`).
vLLM calls it in every process it starts (engine core, workers) before it reads a model's config, so
`LLM(model=muse_dir)` works with no import on the caller's side. It must stay cheap and idempotent.
"""

from __future__ import annotations

# architecture name in config.json -> "module:class" of its vLLM implementation (imported only when used)
MODELS = {"MuseSparkForCausalLM": "rollout.models.muse:MuseSparkForCausalLM"}


def register() -> None:
    from vllm import ModelRegistry

    from rl.models import register_auto_classes

    register_auto_classes()  # vLLM reads config.json through transformers' AutoConfig

    supported = set(ModelRegistry.get_supported_archs())
    for arch, target in MODELS.items():
        if arch not in supported:
            ModelRegistry.register_model(arch, target)
