"""RolloutWorker on a GPU with vLLM 0.26: LoRA on the experts through the converted adapter, on a BF16
and on an NVFP4 checkpoint, checked against the PEFT model in transformers on teacher-forced tokens;
colocated sleep / wake. Run on the GPU machine:

    python -m pytest -m gpu tests/integration/test_rollout_gpu.py -v -s

Each test prints one `BENCH ...` line with its figures (for docs/benchmarks.md).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from rl.tiny import make_tiny
from rollout.config import RolloutConfig
from rollout.spec import EngineSpec, PromptRequest, SamplingSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SEQ_LEN, NUM_SEQS = 96, 8


def _spec(path, **kw):
    return EngineSpec(
        model_path=str(path),
        dtype="bfloat16",
        max_model_len=512,
        enable_lora=True,
        max_lora_rank=8,
        return_routed_experts=True,
        seed=0,
        **kw,
        rollout=RolloutConfig(gpu_memory_utilization=0.25, enforce_eager=True, max_num_seqs=32),
    )


@pytest.fixture(scope="module")
def moe_path():
    return make_tiny("qwen3_moe")


@pytest.fixture(scope="module")
def adapter(moe_path):
    """(tensors, adapter_config) of a random LoRA on attention and on every expert (3D target_parameters)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    peft_model = get_peft_model(model, config)
    torch.manual_seed(0)
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.1)
    return {k: v.clone() for k, v in get_peft_model_state_dict(peft_model).items()}, config.to_dict()


@pytest.fixture(scope="module")
def sequences():
    rng = np.random.default_rng(0)
    return [rng.integers(10, 300, SEQ_LEN).tolist() for _ in range(NUM_SEQS)]


@torch.no_grad()
def hf_logprobs(weights_path, sequences, adapter=None, dtype=torch.bfloat16):
    """Teacher-forced log-probs in transformers, with the PEFT adapter (tensors, config) when given."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(weights_path, dtype=dtype).cuda().eval()
    if adapter is not None:
        tensors, cfg = adapter
        model = get_peft_model(
            model,
            LoraConfig(
                **{
                    k: v
                    for k, v in cfg.items()
                    if k in ("r", "lora_alpha", "target_modules", "target_parameters", "use_rslora")
                }
            ),
        )
        set_peft_model_state_dict(model, {k: v.to(dtype) for k, v in tensors.items()})
        model.eval()
    out = []
    for ids in sequences:
        logits = model(torch.tensor([ids], device="cuda")).logits[0, :-1].float()
        out.append(
            torch.log_softmax(logits, -1)
            .gather(-1, torch.tensor(ids[1:], device="cuda")[:, None])[:, 0]
            .cpu()
            .numpy()
        )
    del model
    torch.cuda.empty_cache()
    return out


def _mean_abs(a, b):
    return float(np.mean([np.abs(x - y).mean() for x, y in zip(a, b)]))


def _check_expert_lora(worker, hf_weights, adapter, sequences, label):
    tensors, config = adapter
    base_vllm = worker.prompt_logprobs(sequences, use_adapter=False)
    metrics = worker.load_adapter(tensors, config, version=1)
    lora_vllm = worker.prompt_logprobs(sequences)
    lora_hf = hf_logprobs(hf_weights, sequences, adapter)
    base_hf = hf_logprobs(hf_weights, sequences)
    mismatch, effect = _mean_abs(lora_vllm, lora_hf), _mean_abs(lora_hf, base_hf)
    base_mismatch = _mean_abs(base_vllm, base_hf)
    # R3 still captures routing with the expert LoRA active.
    samples = worker.generate([PromptRequest(sequences[0][:40], 0)], SamplingSpec(n=2, max_tokens=16, seed=0))
    for s in samples:
        assert s.adapter_version == 1 and s.routed_experts is not None and s.routed_experts.any()
    print(
        f"BENCH rollout_expert_lora[{label}] mean|dlogp| vllm-vs-peft={mismatch:.4f} "
        f"base vllm-vs-hf={base_mismatch:.4f} adapter effect={effect:.4f} "
        f"sync_bytes={metrics['perf/sync_bytes']} sync_s={metrics['perf/sync_s']:.3f}"
    )
    return mismatch, effect, base_mismatch


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "per_expert"])
def test_expert_lora_bf16_matches_peft(moe_path, adapter, sequences, tmp_path, stacked):
    """Both adapter layouts (sync.expert_layout): stacked, split per expert by vLLM; per expert, by sparkrl."""
    from rollout.worker import RolloutWorker

    worker = RolloutWorker(_spec(moe_path, lora_experts_stacked=stacked), tmp_path / "stage")
    try:
        label = "bf16 stacked" if stacked else "bf16 per_expert"
        mismatch, effect, base_mismatch = _check_expert_lora(worker, moe_path, adapter, sequences, label)
    finally:
        worker.shutdown()
    # bf16 on both sides: a mean log-prob difference of a few 1e-2 at most, far below the adapter's own
    # effect (a wrong expert layout would leave the mismatch as large as the effect).
    assert mismatch < 0.03 and mismatch < max(base_mismatch * 3, 0.01)
    assert effect > 10 * mismatch


def test_expert_lora_nvfp4_matches_peft_on_dequantized_weights(moe_path, adapter, sequences, tmp_path):
    from rl.quantize import quantize
    from rollout.worker import RolloutWorker, engine_kwargs
    from trainer.nvfp4 import dequantize_nvfp4

    q = quantize(moe_path, tmp_path / "nvfp4")
    dq = dequantize_nvfp4(q, tmp_path / "dequant", dtype=torch.bfloat16)
    worker = RolloutWorker(_spec(q), tmp_path / "stage")
    try:
        assert worker.info.quantization == "nvfp4"
        assert engine_kwargs(worker.spec, worker.info)["moe_backend"] == "marlin"
        mismatch, effect, base_mismatch = _check_expert_lora(worker, dq, adapter, sequences, "nvfp4")
    finally:
        worker.shutdown()
    # The reference runs the exact dequantized weights; Marlin's weight-only FP4 should add little.
    assert mismatch < max(2 * base_mismatch, 0.05)
    assert effect > 5 * mismatch


def test_colocated_sleep_frees_the_gpu_and_wake_restores_the_adapter(moe_path, adapter, sequences, tmp_path):
    from rollout.worker import RolloutWorker

    worker = RolloutWorker(_spec(moe_path, enable_sleep_mode=True), tmp_path / "stage")
    try:
        worker.load_adapter(*adapter, version=1)
        before = worker.prompt_logprobs(sequences[:2])
        free_awake = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        worker.sleep()
        sleep_s = time.perf_counter() - t0
        free_asleep = torch.cuda.mem_get_info()[0]
        with pytest.raises(RuntimeError, match="asleep"):
            worker.generate([PromptRequest([1, 2, 3], 0)], SamplingSpec())
        t0 = time.perf_counter()
        worker.wake_up()
        wake_s = time.perf_counter() - t0
        after = worker.prompt_logprobs(sequences[:2])
    finally:
        worker.shutdown()
    freed = (free_asleep - free_awake) / 2**30
    print(f"BENCH rollout_sleep freed_gib={freed:.2f} sleep_s={sleep_s:.2f} wake_s={wake_s:.2f}")
    # gpu_memory_utilization=0.25 of an H200 is ~35 GiB, nearly all KV cache: sleep must free most of it.
    assert freed > 10
    for a, b in zip(before, after):
        np.testing.assert_allclose(a, b, atol=1e-3)
