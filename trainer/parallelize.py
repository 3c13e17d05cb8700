"""How the model is laid over the ranks: torch.compile per decoder layer, activation checkpointing around
it, then FSDP2 per decoder layer, then the root. Mixed precision is stated once, in `parallelize`.

Compile comes before checkpointing (torchtitan compiles the checkpointed block instead): the expert
function breaks the graph once per layer (trainer/lora_experts.py), and a graph break inside a checkpointed
region sends the whole region back to eager; a compiled layer inside an eager checkpoint keeps its fused kernels in both the
forward and the recomputation (bench/lora_experts.py measured it on the H200: docs/benchmarks.md)."""

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


def apply_compile(layers: nn.ModuleList) -> None:
    """Each layer's forward through torch.compile, dynamic shapes (micro-batches differ in length). The layers
    share their code, and their parameters are graph inputs, so they share compiled graphs too."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in layers:
        layer.compile(dynamic=True)


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
    compile: bool = False,
) -> nn.Module:
    """model: the root module (the causal LM); layers: its decoder layers. Parameters are computed in
    compute_dtype (bf16 on GPU); gradients are reduced in fp32 onto the sharded fp32 LoRA weights."""
    if compile:
        apply_compile(layers)
    if activation_checkpointing:
        apply_activation_checkpointing(layers)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    apply_fsdp(model, layers, mesh, mp)
    return model
