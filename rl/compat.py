"""Small helpers that hide differences between library versions; one function per difference."""

from __future__ import annotations


def hf_checkpoint_state_dict(model, state_dict: dict) -> dict:
    """A transformers model's in-memory state dict -> the key names and layout its checkpoints use on disk
    (transformers >= 5 fuses some weights on load, e.g. Qwen3-MoE's per-expert gate/up/down projections into
    `mlp.experts.gate_up_proj` [E, 2I, H]; `save_pretrained` splits them again). Older versions stored
    what they held."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5: no load-time conversion to revert
        return dict(state_dict)
    return revert_weight_conversion(model, dict(state_dict))


def vllm_fused_moe_factory():
    """vLLM's fused-MoE constructor (router + experts + runner; same arguments in both versions): named
    `FusedMoE` in vLLM 0.26 and `FusedMoEFactory` from 0.30 on."""
    from vllm.model_executor.layers import fused_moe

    factory = getattr(fused_moe, "FusedMoEFactory", None)
    return factory if factory is not None else fused_moe.FusedMoE


def set_activation_memory_budget(budget: float) -> float:
    """Sets what AOTAutograd's partitioner may keep for backward in the graphs torch.compile makes from now
    on, as a fraction from 0 (recompute all but each graph's inputs) to 1 (its default, fastest split);
    returns the previous value. A private, process-global torch config in 2.11 and 2.13 alike, read when a
    graph is compiled: lazily, at a module's first call and at every recompile, so a scoped
    `torch._functorch.config.patch` around `compile()` would be gone by then. torch 2.13's scoped
    `torch.autograd.graph.region_activation_memory_budget` is not in 2.11."""
    import torch._functorch.config as functorch_config

    previous = functorch_config.activation_memory_budget
    functorch_config.activation_memory_budget = float(budget)
    return previous


def vllm_ray_executor_env(
    bundle_indices: list[int], gpus_per_rank: float, ray_address: str
) -> dict[str, str]:
    """The environment with which `vllm.LLM(distributed_executor_backend="ray")`, built inside a Ray actor
    scheduled in a placement group (capturing child tasks), puts its TP workers in the given bundles of that
    group, each holding `gpus_per_rank` of its bundle's GPU. vLLM 0.30 reads both variables in its default
    Ray executor (`ray_executor_v2.RayExecutorV2`) and in the one VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0 picks
    (`ray_executor.RayDistributedExecutor`, the V1 engine's Ray executor before it). The engine core runs in
    a process of its own, which joins the cluster at RAY_ADDRESS (a Ray actor's environment need not name
    it) and takes the placement group from the engine config, which vLLM fills from the actor's
    `ray.util.get_current_placement_group()`."""
    return {
        "VLLM_RAY_BUNDLE_INDICES": ",".join(str(b) for b in bundle_indices),
        "VLLM_RAY_PER_WORKER_GPUS": f"{gpus_per_rank:g}",
        "RAY_ADDRESS": ray_address,
    }
