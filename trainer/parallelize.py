"""How the model is laid over the ranks: activation checkpointing, then FSDP2 per decoder layer, then the
root (torchtitan's order). Mixed precision is stated once, in `parallelize`."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard


def apply_activation_checkpointing(layers: nn.ModuleList) -> None:
    """Recompute each decoder layer in backward (non-reentrant: works with FSDP2 and frozen inputs)."""
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, preserve_rng_state=True)


def apply_fsdp(model: nn.Module, layers: nn.ModuleList, mesh: DeviceMesh, mp: MixedPrecisionPolicy) -> None:
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    # The root holds the embeddings, the final norm and the LM head.
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # rl/algo.py normalises every micro-batch loss by the global token count, so the gradient reduction
    # across ranks must be a SUM (FSDP2's default averages). Factor 1 alone becomes NCCL's PREMUL_SUM, which
    # gloo lacks; forcing sum-only comms makes it a plain SUM on both (and zero-copy on NCCL).
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def parallelize(
    model: nn.Module,
    layers: nn.ModuleList,
    mesh: DeviceMesh,
    *,
    compute_dtype: torch.dtype,
    activation_checkpointing: bool,
) -> nn.Module:
    """model: the root module (the causal LM); layers: its decoder layers. Parameters are computed in
    compute_dtype (bf16 on GPU); gradients are reduced in fp32 onto the sharded fp32 LoRA weights."""
    if activation_checkpointing:
        apply_activation_checkpointing(layers)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    apply_fsdp(model, layers, mesh, mp)
    return model
