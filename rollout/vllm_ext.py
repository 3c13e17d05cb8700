"""Methods added to vLLM's worker through the public `worker_extension_cls` engine argument.

vLLM mixes this class into its worker class inside the engine process; `LLM.collective_rpc(name)` calls a
method on every worker (all tensor-parallel ranks). Weights are reloaded with the worker's own
`reload_weights`: it loads checkpoint-format weights in place and re-runs each layer's post-load
processing (the CPU backend repacks linear weights after loading, so a plain `model.load_weights`
would leave them stale).

This is also the one module that reaches into vLLM internals, for one vLLM bug (0.30, CPU backend):
on a weight update `UnquantizedFusedMoEMethod._setup_kernel` skips the CPU experts' prepacking
(`CPUUnquantizedExperts.process_weights_after_loading`, which it runs only on the first load), so
reloaded expert weights land unpacked in storage the CPU kernel reads as packed. `_repack_cpu_experts`
runs that prepacking again for the layers the reload changed. tests/unit/test_rollout_vllm_ext.py
pins the source of both vLLM functions: when vLLM changes them, re-check whether this is still needed.
"""

from __future__ import annotations


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
        if experts is None or type(experts).__name__ != "CPUUnquantizedExperts":
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
