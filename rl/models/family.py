"""What a model family gives sparkrl: the `Family` each folder rl/models/<family>/ declares in its
`__init__.py` and rl/models/registry.py lists once.

A family is keyed by config.json's `model_type`. Its code parts (the transformers and vLLM model classes,
the router adapter) are named as "module:attribute" strings and imported only where they are used: the
driver, the planner and the preflight read a family as plain data without importing torch, transformers
or vLLM, and only vLLM's engine processes import a vLLM model file.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rl.core.model_info import num_experts

if TYPE_CHECKING:
    import torch
    from torch import nn


class RouterAdapter(Protocol):
    """Routing replay (R3) of one router class: the router's own forward output, with the rows where `valid`
    routed to the replayed `ids` ([N, k] long) and their weights recomputed from the live logits the way
    the model does (so gradients through the weights stay right); rows without replay keep the live choice.
    The output has the router's own form, since the MoE block after it reads that."""

    def __call__(self, router: nn.Module, output: tuple, ids: torch.Tensor, valid: torch.Tensor) -> tuple: ...


@dataclass(frozen=True)
class Router:
    """A router class of the family's MoE blocks (`cls`, "module:Class": what trainer/routing_replay.py
    hooks, one module a MoE layer, in model order; it has `num_experts` and `top_k` attributes) and its
    `RouterAdapter` (`adapter`, "module:function")."""

    cls: str
    adapter: str


@dataclass(frozen=True)
class BuiltinModel:
    """A model the planner knows without its config.json (`sparkrl plan` before a download): picked when
    model.path (or model.rollout_path) contains `match` (lower case). Either `config`, a copy of the
    config.json keys the planner reads (read like a local one), or `shape`, the planner's ModelShape fields
    themselves (for a model whose published totals stand in for a config.json). `source` says which, in the
    plan."""

    name: str
    match: str
    source: str
    config: Mapping[str, Any] | None = None
    shape: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class PlannerFacts:
    """What rl/plan.py knows of the family beyond the config.json keys every family shares."""

    # a config.json's text config -> the ModelShape fields read from keys only this family has (plain Python)
    config_fields: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    builtin: tuple[BuiltinModel, ...] = ()


@dataclass(frozen=True)
class TinyModel:
    """`sparkrl make-tiny --arch ARCH`'s arguments: the config class ("module:Class") and what this family
    sets on top of rl/tiny.py's common sizes (`kwargs` win over them)."""

    arch: str
    config: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def build_config(self, common: Mapping[str, Any]):
        """The transformers config of the tiny model."""
        return load(self.config)(**{**common, **self.kwargs})


@dataclass(frozen=True)
class Family:
    """Everything sparkrl knows of one model family, read from rl/models/<name>/.

    model_types: config.json `model_type` values of the family.
    routers: the MoE routers R3 replays, each with its adapter; empty for a dense family. A mixture-of-experts
        model needs one for `r3.enabled` (the preflight refuses it otherwise).
    planner: rl/plan.py's shape facts.
    tiny: make-tiny's arguments, where the family has a tiny model.
    quantize_ignore: compressed-tensors `ignore` patterns `sparkrl quantize` adds to its defaults (Linear
        layers this family keeps unquantized).
    register_hf: "module:function" that registers the family's classes with transformers' Auto classes,
        where transformers lacks them (idempotent); None where transformers has them.
    vllm_models: config.json `architectures` entry -> "module:Class" of the vLLM model, where vLLM lacks it.
        Only vLLM's plugin (rl.models.register_vllm_models) imports these modules.
    """

    name: str
    model_types: tuple[str, ...]
    routers: tuple[Router, ...] = ()
    planner: PlannerFacts = PlannerFacts()
    tiny: TinyModel | None = None
    quantize_ignore: tuple[str, ...] = ()
    register_hf: str | None = None
    vllm_models: Mapping[str, str] = field(default_factory=dict)

    @property
    def tiny_is_moe(self) -> bool:
        """Whether the tiny model is a mixture of experts (an expert count among its arguments)."""
        return self.tiny is not None and num_experts(self.tiny.kwargs) > 0


def load(target: str) -> Any:
    """The object a "package.module:Name.attr" string names (imported on call)."""
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
