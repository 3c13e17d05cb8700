"""Model families: one folder each (rl/models/<family>/), listed once in rl/models/registry.py; the interface
a family fills in is rl/models/family.py's `Family` (docs/design.md, Models, says how to add one).

The functions here are how the product reaches the families' code in transformers and vLLM:
`auto_config` and `auto_causal_lm` are transformers' Auto classes with every family registered (no loader
relies on an import made somewhere else), and `register_vllm_models` is the `vllm.general_plugins` entry
point (pyproject.toml).
"""

from __future__ import annotations


def register_auto_classes() -> None:
    """The families' configs and models with transformers' Auto classes (idempotent)."""
    from rl.models.registry import register_hf

    register_hf()


def register_vllm_models() -> None:
    """The `vllm.general_plugins` entry point. vLLM calls it in every process it starts (engine core,
    workers) before it reads a model's config, so `LLM(model=muse_dir)` works with no import on the caller's
    side. It must stay cheap and idempotent: the vLLM models are named, not imported, until vLLM builds one."""
    from vllm import ModelRegistry

    from rl.models.registry import vllm_models

    register_auto_classes()  # vLLM reads config.json through transformers' AutoConfig
    supported = set(ModelRegistry.get_supported_archs())
    for arch, target in vllm_models().items():
        if arch not in supported:
            ModelRegistry.register_model(arch, target)


def auto_config(path: str, **kwargs):
    """`AutoConfig.from_pretrained(path, **kwargs)`, every family included."""
    from transformers import AutoConfig

    register_auto_classes()
    return AutoConfig.from_pretrained(path, **kwargs)


def auto_causal_lm():
    """transformers' `AutoModelForCausalLM`, every family included."""
    from transformers import AutoModelForCausalLM

    register_auto_classes()
    return AutoModelForCausalLM
