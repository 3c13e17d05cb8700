"""Rollout routing replay (R3): every MoE layer routes each token to the experts the rollout engine chose.

How: a forward hook on each router module (no change to transformers' code). The hook takes the router's
own outputs, keeps its logits, and swaps in the replayed top-k ids; the routing weights are recomputed
from the live logits gathered at those ids and normalised the way the model normally does, so gradients
through the weights stay right. Rows without replay (the last token of a sample, which the rollout never
routed, and padding) keep the live router's choice.

Which modules are routers, and how each replays, is its model family's (rl/models/<family>/, the
`routers` of its registry entry): this module asks rl.models.registry and holds no model's code.

Replay ids for one forward are [N, L, k] long with N = batch * seq_len (the flattened rows every router
sees), L = number of MoE layers in model order, plus valid [N] bool. Keep the context open through
backward: activation checkpointing recomputes the routers there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from rl.models.family import RouterAdapter
from rl.models.registry import router_adapters

# router class -> its family's adapter: every router the trainer can replay
ROUTER_ADAPTERS: dict[type, RouterAdapter] = router_adapters()


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The router modules in model order (= the L axis of `routed_experts`)."""
    return [m for m in model.modules() if type(m) in ROUTER_ADAPTERS]


class RoutingReplay:
    """Hooks on every router of `model`; inactive (live routing) unless inside `active(...)`."""

    def __init__(self, model: nn.Module):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError(
                f"routing replay: no known MoE router in {type(model).__name__}; known router classes: "
                f"{sorted(c.__name__ for c in ROUTER_ADAPTERS)}"
            )
        first = self.routers[0]
        self.num_experts = int(first.num_experts)
        self.top_k = int(first.top_k)
        for layer, router in enumerate(self.routers):
            router.sparkrl_replay_layer = layer  # for error messages only
            router.sparkrl_replay = None
        self._handles = [r.register_forward_hook(_replay_hook) for r in self.routers]

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @contextmanager
    def active(self, ids: torch.Tensor, valid: torch.Tensor) -> Iterator[None]:
        if ids.dim() != 3 or ids.shape[1:] != (self.num_layers, self.top_k) or valid.shape != ids.shape[:1]:
            raise ValueError(
                f"routing replay: ids must be [N, {self.num_layers}, {self.top_k}] with valid [N], got "
                f"{tuple(ids.shape)} and {tuple(valid.shape)}"
            )
        ids, valid = ids.long(), valid.bool().to(ids.device)
        for layer, router in enumerate(self.routers):
            # Own storage per layer: a view's storage offset would be one more guarded size for dynamo.
            router.sparkrl_replay = (ids[:, layer].contiguous(), valid)
        try:
            yield
        finally:
            for router in self.routers:
                router.sparkrl_replay = None

    def check(self, routed: np.ndarray, where: str) -> None:
        """A rollout's `routed_experts` must match this model's MoE layers, top-k and expert count."""
        if routed.ndim != 3 or routed.shape[1:] != (self.num_layers, self.top_k):
            raise ValueError(
                f"{where}: routed_experts has shape {tuple(routed.shape)}, expected [tokens - 1, "
                f"{self.num_layers} MoE layers, top_k {self.top_k}]"
            )
        if routed.size and (int(routed.min()) < 0 or int(routed.max()) >= self.num_experts):
            raise ValueError(
                f"{where}: routed_experts holds expert ids {int(routed.min())}..{int(routed.max())}, but the "
                f"model has {self.num_experts} experts (ids 0..{self.num_experts - 1})"
            )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _replay_hook(module: nn.Module, args, output):
    # One hook for every router, reading its layer's ids from the module: compiled decoder layers share
    # their graphs only if nothing layer-specific is a Python constant in them (a closure over the layer
    # index made dynamo guard on it and compile every layer anew, minutes per step on the GPU).
    replay = module.sparkrl_replay
    if replay is None:
        return output
    ids, valid = replay
    if ids.shape[0] != output[0].shape[0]:
        raise RuntimeError(
            f"routing replay: layer {module.sparkrl_replay_layer} routes {output[0].shape[0]} rows but the "
            f"replay plan has {ids.shape[0]}"
        )
    return ROUTER_ADAPTERS[type(module)](module, output, ids.to(output[2].device), valid)
