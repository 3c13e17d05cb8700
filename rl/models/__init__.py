"""Model builders and model code: tiny test models (`tiny`), Muse Spark Open (`muse/`).

`auto_config` and `auto_causal_lm` are how the product reaches transformers' Auto classes: the one place
that makes them know Muse Spark (rl/models/muse registers itself on import), so no loader relies on an
import made somewhere else.
"""

from __future__ import annotations


def register_auto_classes() -> None:
    """Muse Spark's config and model with transformers' Auto classes (idempotent)."""
    import rl.models.muse  # noqa: F401 - importing the package registers it


def auto_config(path: str, **kwargs):
    """`AutoConfig.from_pretrained(path, **kwargs)`, Muse Spark included."""
    from transformers import AutoConfig

    register_auto_classes()
    return AutoConfig.from_pretrained(path, **kwargs)


def auto_causal_lm():
    """transformers' `AutoModelForCausalLM`, Muse Spark included."""
    from transformers import AutoModelForCausalLM

    register_auto_classes()
    return AutoModelForCausalLM
