"""How the model is laid over the ranks: torch.compile per decoder layer, activation checkpointing around
it, then FSDP2 per decoder layer, then the root. Mixed precision is stated once, in `parallelize`.

Compile comes before checkpointing (torchtitan compiles the checkpointed block instead): a compiled layer
inside an eager checkpoint keeps its fused kernels in both the forward and the recomputation, whereas a
graph break inside a checkpointed region sends the whole region back to eager. A decoder layer traces as
one graph (trainer/lora_experts.py keeps the expert function free of graph breaks).

Whole-layer checkpointing recomputes every layer's forward, matmuls included. With compiled layers an
activation memory budget can take its place (torchtitan's "memory_budget" mode): no checkpoint wrapper;
AOTAutograd's partitioner chooses, in each compiled graph, what to save and what its backward recomputes,
cheapest recomputation first, within that fraction of the way from keeping only the graph's inputs (0) to
its default, fastest split (1); docs/benchmarks.md (Trainer) has what each setting costs on the H200.
torch reads the budget from a process-global config when
it compiles a graph, lazily at the first call (rl/core/compat.py), so it is set for the whole process: a trainer
worker is a process of its own, with one model.

The mesh (`make_meshes`): one FSDP dimension over all ranks; with expert parallelism (EP > 1) also a
(dp, ep) mesh of num_ranks / EP x EP whose ep rows are consecutive ranks. `apply_ep` keeps each rank's
experts of every MoE layer (`shard_experts`, trainer/expert_parallel.py), on the meta device before
anything is loaded; `apply_fsdp` then shards each layer's experts module over the dp sub-mesh (the ranks
holding the same experts) before the layer itself over all ranks, so FSDP never gathers an expert from
another EP rank."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from rl.core.compat import set_activation_memory_budget
from trainer.expert_parallel import ExpertShards, ep_units, shard_experts

DEFAULT_MEMORY_BUDGET = 1.0  # torch's own: the partitioner's fastest split


def apply_activation_checkpointing(layers: nn.ModuleList) -> None:
    """Recompute each decoder layer in backward (non-reentrant: works with FSDP2 and frozen inputs)."""
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, preserve_rng_state=True)


def apply_memory_budget(budget: float) -> None:
    """The partitioner's budget for the graphs compiled from now on in this process."""
    if set_activation_memory_budget(budget) != budget:
        # Compiled graphs are cached per code object and dynamo does not guard on this config: a model
        # built earlier in the process (the benchmarks build several) would hand its graphs to this one.
        torch._dynamo.reset()


def apply_compile(layers: nn.ModuleList, backend: str) -> None:
    """Each layer's forward through torch.compile, dynamic shapes (micro-batches differ in length). The layers
    share their code, and their parameters are graph inputs, so they share compiled graphs too. `backend`:
    torch.compile's (`parallelize` says which)."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in layers:
        layer.compile(dynamic=True, backend=backend)


def make_meshes(device_type: str, world_size: int, expert_parallel_size: int = 1):
    """(mesh over all ranks, the (dp, ep) mesh or None without expert parallelism). Rank r sits at
    (r // EP, r % EP): an EP group is EP consecutive ranks."""
    mesh = init_device_mesh(device_type, (world_size,))
    if expert_parallel_size == 1:
        return mesh, None
    ep_mesh = init_device_mesh(
        device_type,
        (world_size // expert_parallel_size, expert_parallel_size),
        mesh_dim_names=("dp", "ep"),
    )
    return mesh, ep_mesh


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh, num_experts: int) -> ExpertShards:
    """Keeps this rank's experts of every MoE layer (bank and LoRA) and installs the all-to-all dispatch and
    combine; call before activation checkpointing and FSDP wrap the layers."""
    shards = ExpertShards(
        size=ep_mesh["ep"].size(),
        rank=ep_mesh["ep"].get_local_rank(),
        num_experts=num_experts,
        group=ep_mesh["ep"].get_group(),
    )
    shard_experts(model, shards)
    return shards


def apply_fsdp(
    model: nn.Module,
    layers: nn.ModuleList,
    mesh: DeviceMesh,
    mp: MixedPrecisionPolicy,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """expert_mesh: where expert parallelism is on, the mesh the experts modules are sharded over (the dp
    sub-mesh: the ranks holding the same experts)."""
    for layer in layers:
        if expert_mesh is not None:
            for unit in ep_units(layer):
                fully_shard(unit, mesh=expert_mesh, mp_policy=mp)
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    # The root holds the embeddings, the final norm and the LM head.
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # rl/core/algo.py normalises every micro-batch loss by the global token count, so the gradient reduction
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
    activation_memory_budget: float = 0.0,
    compile_backend: str = "inductor",
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """model: the root module (the causal LM); layers: its decoder layers. Parameters are computed in
    compute_dtype (bf16 on GPU); gradients are reduced in fp32 onto the sharded fp32 LoRA weights.
    compile_backend: torch.compile's for the layers; the trainer uses inductor, other backends serve tests
    of the layering. expert_mesh: with expert parallelism (`apply_ep` applied), the (dp, ep) mesh.
    activation_memory_budget > 0 with compile: the partitioner's budget instead of whole-layer
    checkpointing, whatever activation_checkpointing says; without compile it is ignored."""
    budgeted = compile and activation_memory_budget > 0
    if compile:
        # Stated for every compiled model, the default included: the setting outlives a model in its process.
        apply_memory_budget(activation_memory_budget if budgeted else DEFAULT_MEMORY_BUDGET)
        apply_compile(layers, compile_backend)
    if activation_checkpointing and not budgeted:
        apply_activation_checkpointing(layers)
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    apply_fsdp(model, layers, mesh, mp, None if expert_mesh is None else expert_mesh["dp"])
    return model
