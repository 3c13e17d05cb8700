"""rollout.worker's conversions and engine arguments, and the vLLM code rollout.vllm_ext works around.

No engine is started here (tests/integration/test_rollout_*.py start them).
"""

from __future__ import annotations

import hashlib
import inspect

import numpy as np
import pytest
import torch

from rollout.config import RolloutConfig
from rollout.spec import EngineSpec, SamplingSpec
from rollout.worker import (
    ModelInfo,
    NonFiniteLogprobsError,
    RoutedExpertsError,
    check_finite_logprobs,
    check_routed_experts,
    engine_env,
    engine_kwargs,
    in_process,
    sampled_logprobs,
)

MOE = ModelInfo(num_layers=4, num_experts=8, top_k=2, quantization=None)
DENSE = ModelInfo(num_layers=4, num_experts=0, top_k=0, quantization=None)
NVFP4_MOE = ModelInfo(num_layers=4, num_experts=8, top_k=2, quantization="nvfp4")


def _routing(rows=5, layers=4, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([[rng.choice(8, 2, replace=False) for _ in range(layers)] for _ in range(rows)]).astype(
        np.uint8
    )


def test_routed_experts_checks():
    r = _routing()
    assert check_routed_experts(r, 5, 2, 8) is r
    with pytest.raises(RoutedExpertsError, match="all-zero"):
        check_routed_experts(np.zeros((5, 4, 2), np.uint8), 5, 2, 8)
    with pytest.raises(RoutedExpertsError, match=r"expected \[6 \(prompt \+ response - 1\)"):
        check_routed_experts(r, 6, 2, 8)
    dup = r.copy()
    dup[2, 1, 1] = dup[2, 1, 0]
    with pytest.raises(RoutedExpertsError, match="repeats an expert"):
        check_routed_experts(dup, 5, 2, 8)
    with pytest.raises(RoutedExpertsError, match="expert id 9"):
        check_routed_experts(np.where(r == r.max(), 9, r).astype(np.uint8), 5, 2, 8)
    # int64 from a future vLLM becomes the design's uint8 (<= 256 experts).
    assert check_routed_experts(r.astype(np.int64), 5, 2, 8).dtype == np.uint8


def test_routed_experts_repeat_check_samples_long_samples():
    """A long sample's rows are checked for repeats on a spread sample of rows (the first and the last
    included): garbage in the capture shows there; one bad row between the sampled ones does not."""
    rows = 1000
    r = _routing(rows=rows, seed=1)
    assert check_routed_experts(r, rows, 2, 8) is r
    for bad in (0, rows - 1, 16 * (-(-rows // 64))):  # first, last, a sampled row in the middle
        dup = r.copy()
        dup[bad, 3, 1] = dup[bad, 3, 0]
        with pytest.raises(RoutedExpertsError, match="repeats an expert"):
            check_routed_experts(dup, rows, 2, 8)
    garbage = r.copy()
    garbage[100:600, :, 1] = garbage[100:600, :, 0]  # a torn stretch of the capture
    with pytest.raises(RoutedExpertsError, match="repeats an expert"):
        check_routed_experts(garbage, rows, 2, 8)
    between = r.copy()
    between[1, 0, 1] = between[1, 0, 0]  # row 1 lies between sampled rows 0 and 16
    assert check_routed_experts(between, rows, 2, 8) is between


def test_sampled_logprobs_pick_the_sampled_token_not_the_top1():
    from vllm.logprobs import Logprob

    # Position 1 sampled token 7 although token 3 is more likely: the value must be token 7's.
    entries = [{5: Logprob(-0.1, 1)}, {3: Logprob(-0.2, 1), 7: Logprob(-2.5, 4)}]
    np.testing.assert_allclose(sampled_logprobs([5, 7], entries, "t"), [-0.1, -2.5])
    with pytest.raises(RuntimeError, match="no log-prob for token 8 at position 1"):
        sampled_logprobs([5, 8], entries, "t")


def test_non_finite_sampled_logprobs_stop_the_rollout_and_say_where():
    ok = np.array([-0.1, -2.5, -30.0], np.float32)
    assert check_finite_logprobs(ok, "g") is ok
    bad = np.array([-0.1, -2.5, np.nan, -np.inf, np.nan], np.float32)
    with pytest.raises(NonFiniteLogprobsError, match=r"group 3 sample 1: .*2 NaN, 1 inf of 5 .* token 2\)"):
        check_finite_logprobs(bad, "group 3 sample 1")


def test_engine_settings_pass_through():
    spec = EngineSpec(
        model_path="/m",
        dtype="float32",
        max_model_len=300,
        seed=9,
        enable_lora=True,
        max_lora_rank=12,
        return_routed_experts=True,
        enable_sleep_mode=True,
        rollout=RolloutConfig(
            gpu_memory_utilization=0.3,
            enforce_eager=True,
            max_num_seqs=7,
            tensor_parallel_size=2,
            enable_prefix_caching=False,
            engine_args={"swap_space": 1},
        ),
    )
    kw = engine_kwargs(spec, MOE)
    # CPU generators cannot rewind after a chunked prefill (see engine_kwargs): whole prefills there.
    assert kw.pop("enable_chunked_prefill", None) is (False if not torch.cuda.is_available() else None)
    assert kw == dict(
        model="/m",
        dtype="float32",
        seed=9,
        gpu_memory_utilization=0.3,
        enforce_eager=True,
        max_num_seqs=7,
        tensor_parallel_size=2,
        enable_prefix_caching=False,
        trust_remote_code=False,
        logprobs_mode="processed_logprobs",
        worker_extension_cls="rollout.vllm_ext.SparkWorkerExtension",
        max_model_len=300,
        distributed_executor_backend="mp",  # TP 2 on this actor's own GPUs (split placement)
        enable_lora=True,
        max_lora_rank=16,
        max_loras=1,  # 12 -> vLLM's next rank, 16
        enable_mixed_moe_lora_format=True,  # the stacked expert layout (the default)
        enable_return_routed_experts=True,
        scheduler_cls="rollout.vllm_ext.routing_at_finish_scheduler",  # R3 read once per sample
        enable_sleep_mode=True,
        swap_space=1,
        hf_overrides={"head_dtype": "float32"},  # the LM head's logits in fp32, as the trainer's
    )
    # R3 only where there is routing; max_model_len 0 leaves vLLM's default.
    kw = engine_kwargs(EngineSpec(model_path="/m", return_routed_experts=True), DENSE)
    assert "enable_return_routed_experts" not in kw and "max_model_len" not in kw
    assert "scheduler_cls" not in kw
    # vLLM's own per-step routing stream on request
    kw = engine_kwargs(EngineSpec(model_path="/m", return_routed_experts=True, routing_at_finish=False), MOE)
    assert kw["enable_return_routed_experts"] is True and "scheduler_cls" not in kw
    # The stacked expert LoRA layout needs vLLM's mixed-format MoE LoRA; only where there are experts
    stacked = dict(model_path="/m", enable_lora=True, lora_experts_stacked=True)
    assert engine_kwargs(EngineSpec(**stacked), MOE)["enable_mixed_moe_lora_format"] is True
    assert "enable_mixed_moe_lora_format" not in engine_kwargs(EngineSpec(**stacked), DENSE)
    per_expert = dict(stacked, lora_experts_stacked=False)
    assert "enable_mixed_moe_lora_format" not in engine_kwargs(EngineSpec(**per_expert), MOE)


def test_engine_runs_in_process_only_in_an_actor_of_its_own_on_cpu():
    """Outside a Ray actor (this test's process) the engine keeps vLLM's own processes: in process, vLLM's
    CPU worker would pin the caller's threads. In a pool's actor it runs in process
    (tests/integration/test_rollout_pool.py asserts it through the workers' ping)."""
    spec = EngineSpec(model_path="/m")
    assert not in_process(spec, None)
    assert engine_env(spec, None) == {}
    assert "distributed_executor_backend" not in engine_kwargs(spec, MOE)
    # TP ranks or placement-group bundles: never in process, whatever the process
    assert not in_process(EngineSpec(model_path="/m", rollout=RolloutConfig(tensor_parallel_size=2)), None)
    assert (
        engine_kwargs(EngineSpec(model_path="/m", rollout=RolloutConfig(tensor_parallel_size=2)), MOE)[
            "distributed_executor_backend"
        ]
        == "mp"
    )


def test_marlin_is_pinned_for_nvfp4_experts_with_lora():
    assert engine_kwargs(EngineSpec(model_path="/m", enable_lora=True), NVFP4_MOE)["moe_backend"] == "marlin"
    assert "moe_backend" not in engine_kwargs(EngineSpec(model_path="/m", enable_lora=False), NVFP4_MOE)
    assert "moe_backend" not in engine_kwargs(EngineSpec(model_path="/m", enable_lora=True), MOE)
    assert (
        engine_kwargs(EngineSpec(model_path="/m", rollout=RolloutConfig(moe_backend="marlin")), MOE)[
            "moe_backend"
        ]
        == "marlin"
    )


def test_quantization_is_read_from_the_checkpoint_config():
    from rl.core.model_info import quantization_kind

    nvfp4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    grouped = {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"format": "nvfp4-pack-quantized", "weights": {"num_bits": 4}}},
    }
    assert quantization_kind(nvfp4) == quantization_kind(grouped) == "nvfp4"
    assert quantization_kind({"quant_method": "fp8"}) == "fp8"
    assert quantization_kind(None) is None


def test_specs_reject_bad_values_by_name():
    with pytest.raises(ValueError, match="rollout.moe_backend"):
        EngineSpec(model_path="/m", rollout=RolloutConfig(moe_backend="triton"))
    with pytest.raises(ValueError, match="SamplingSpec.temperature"):
        SamplingSpec(temperature=0)


# sha256[:16] of the vLLM 0.30.0 source that rollout.vllm_ext._repack_cpu_experts works around.
PINNED_VLLM_SOURCE = {
    "UnquantizedFusedMoEMethod._setup_kernel": "8218066e9719f482",
    "CPUUnquantizedExperts.process_weights_after_loading": "7233c2501b8a69a2",
}


def test_vllm_cpu_expert_reload_workaround_is_pinned():
    import vllm

    if vllm.__version__ != "0.30.0":
        pytest.skip(f"the CPU expert repack workaround is pinned against vLLM 0.30.0, not {vllm.__version__}")
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    got = {
        "UnquantizedFusedMoEMethod._setup_kernel": UnquantizedFusedMoEMethod._setup_kernel,
        "CPUUnquantizedExperts.process_weights_after_loading": CPUUnquantizedExperts.process_weights_after_loading,
    }
    got = {k: hashlib.sha256(inspect.getsource(f).encode()).hexdigest()[:16] for k, f in got.items()}
    assert got == PINNED_VLLM_SOURCE, (
        "vLLM changed the code rollout/vllm_ext.py works around (CPU experts not repacked on weight "
        "update): check whether the workaround is still needed, then update PINNED_VLLM_SOURCE"
    )
