"""The model families sparkrl knows, one entry each, keyed by config.json's `model_type`.

A family lives in its folder rl/models/<family>/ and declares itself there (`FAMILY`, an
rl.models.family.Family); `FAMILIES` below is the one list of them. Everything else asks this module:
the trainer for its router adapters (trainer/routing_replay.py), the preflight whether R3 can replay a
model's routers, the planner for shape facts, make-tiny for its arguments, `sparkrl quantize` for the layers
a family keeps unquantized, and the transformers and vLLM registrations (rl.models.register_auto_classes,
rl.models.register_vllm_models). Importing it imports no torch, transformers or vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rl.models import muse, qwen3, qwen3_moe
from rl.models.family import BuiltinModel, Family, RouterAdapter, load

FAMILIES: tuple[Family, ...] = (qwen3.FAMILY, qwen3_moe.FAMILY, muse.FAMILY)

MODELS_DIR = Path(__file__).resolve().parent


def _index(families: tuple[Family, ...]) -> tuple[dict[str, Family], dict[str, Family]]:
    """{model_type: family}, {tiny arch: family}; a model_type or arch claimed twice is an error."""
    by_type: dict[str, Family] = {}
    by_arch: dict[str, Family] = {}
    for f in families:
        for t in f.model_types:
            if t in by_type:
                raise ValueError(f"model_type {t!r} is claimed by families {by_type[t].name} and {f.name}")
            by_type[t] = f
        if f.tiny is not None:
            if f.tiny.arch in by_arch:
                raise ValueError(
                    f"make-tiny arch {f.tiny.arch!r} is claimed by {by_arch[f.tiny.arch].name} and {f.name}"
                )
            by_arch[f.tiny.arch] = f
    return by_type, by_arch


_BY_MODEL_TYPE, _BY_TINY_ARCH = _index(FAMILIES)
# `sparkrl make-tiny --arch` values, in registry order.
TINY_ARCHES: tuple[str, ...] = tuple(_BY_TINY_ARCH)
TINY_CHOICES: tuple[str, ...] = ("", *TINY_ARCHES)  # `model.make_tiny.arch`: '' = off


def config_model_type(config: Mapping[str, Any]) -> str:
    """config.json's `model_type`, or its `text_config`'s where the top level has none."""
    return config.get("model_type") or (config.get("text_config") or {}).get("model_type") or ""


def family(model_type: str) -> Family | None:
    """The family of a config.json `model_type`; None where no folder of rl/models/ claims it."""
    return _BY_MODEL_TYPE.get(model_type)


def family_of(config: Mapping[str, Any]) -> Family | None:
    """The family of a config.json (dict): by its `model_type`, else by its `text_config`'s (a multimodal
    wrapper around a known decoder)."""
    for c in (config, config.get("text_config") or {}):
        found = _BY_MODEL_TYPE.get(c.get("model_type") or "")
        if found is not None:
            return found
    return None


def tiny_family(arch: str) -> Family | None:
    """The family whose tiny model `sparkrl make-tiny --arch` names; None for an unknown arch."""
    return _BY_TINY_ARCH.get(arch)


def family_dir(f: Family) -> Path:
    return MODELS_DIR / f.name


def builtin_models() -> Iterator[BuiltinModel]:
    """The models the planner knows without a config.json, in registry order."""
    for f in FAMILIES:
        yield from f.planner.builtin


def router_adapters() -> dict[type, RouterAdapter]:
    """{router class: its adapter} of every family: imports the families' model code (torch, transformers),
    so only the trainer calls it."""
    return {load(r.cls): load(r.adapter) for f in FAMILIES for r in f.routers}


def register_hf() -> None:
    """Each family's classes with transformers' Auto classes, where transformers lacks them (idempotent)."""
    for f in FAMILIES:
        if f.register_hf:
            load(f.register_hf)()


def vllm_models() -> dict[str, str]:
    """{config.json architecture: "module:Class"} of the vLLM models the families bring."""
    return {arch: target for f in FAMILIES for arch, target in f.vllm_models.items()}
