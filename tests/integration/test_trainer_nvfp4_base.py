"""The trainer with its frozen base held NVFP4 (`base_format="nvfp4"`: packed weights sharded by FSDP2,
gathered packed and dequantized per layer) against the trainer on the BF16 twin (`sparkrl dequantize`),
on 2 gloo ranks (real FSDP2, torch.multiprocessing), for the tiny Qwen3-MoE and the tiny Muse each
quantized with `sparkrl quantize`. fp32 compute, LoRA on attention, experts (and Muse's latent
projections), B random so every gradient is non-zero, R3 replaying given routing on some samples.

Compared bit for bit (torch.equal): log-probs, entropy, loss, LoRA gradients, the merged export; the
packed base is <= 0.3x the BF16 twin's bytes (trainer/base_bytes, reported once)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from trainer.config import LoraConfig, TrainerConfig
from trainer.rendezvous import free_port
from trainer.spec import TrainerSpec

pytestmark = pytest.mark.slow


def _spec(path: str, fmt: str, dtype: str = "float32") -> TrainerSpec:
    return TrainerSpec(
        model_path=path,
        dtype=dtype,
        lora=LoraConfig(rank=4, alpha=8.0, target_latent=True),
        trainer=TrainerConfig(
            micro_batch_tokens=0, micro_batch_size=2, activation_checkpointing=True, logits_chunk_tokens=5
        ),
        max_seq_len=32,
        r3=True,
        r3_live_kl=True,
        base_format=fmt,
        seed=1,
        init_lora_weights=False,
    )


def _samples(num_layers: int, top_k: int, experts: int):
    from trainer.testing import random_samples

    samples = random_samples(5, seed=3)
    rng = np.random.default_rng(0)
    for i, s in enumerate(samples):
        if i % 2 == 0:  # foreign routing replayed (R3); the others route live
            s.routed_experts = rng.integers(0, experts, (s.num_tokens - 1, num_layers, top_k)).astype(
                np.uint8
            )
    return samples


def _rank_main(rank, world, port, nvfp4, cache, out_dir):
    from trainer.worker import TrainerWorker

    os.environ["SPARKRL_CACHE"] = cache
    results = {}
    # the NVFP4 trainer; the trainer on the BF16 twin (the NVFP4 directory's cached `sparkrl dequantize`
    # output, so both count trainer/base_bytes over the same weights); the twin in bf16, for its bytes
    for key, path, fmt, dtype in (
        ("nvfp4", nvfp4, "nvfp4", "float32"),
        ("bf16", nvfp4, "bf16", "float32"),
        ("bf16_bytes", nvfp4, "bf16", "bfloat16"),
    ):
        w = TrainerWorker(rank, world, "127.0.0.1", port, _spec(path, fmt, dtype))
        if key == "bf16_bytes":
            results[key] = {"base_bytes": w.base_bytes}
            continue
        cfg = w.hf_model.config
        samples = _samples(cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.num_experts)
        lp, m1 = w.log_probs(samples)
        _, m2 = w.log_probs(samples, live=False)  # a batch's second scoring: no live-routing forward
        step = w.train_step(samples, [1.0, -0.5, 0.3, 0.7, -1.2])
        results[key] = {
            "logp": lp,
            "metrics": m1,
            "second_metrics": m2,
            "step": step,
            "grads": w.gradients(),
            "merged": w.export_merged(),
            "base_bytes": w.base_bytes,
        }
        del w
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module", params=["qwen3_moe", "muse"])
def results(request, tmp_path_factory):
    from rl.quantize import quantize
    from rl.tiny import make_tiny

    root = tmp_path_factory.mktemp(request.param)
    nvfp4 = quantize(make_tiny(request.param), root / "nvfp4")
    mp.spawn(
        _rank_main,
        args=(2, free_port(), str(nvfp4), str(root / "cache"), str(root)),
        nprocs=2,
        join=True,
    )
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_log_probs_loss_and_lora_gradients_are_bitwise_the_twins(results):
    ranks = results
    for r in ranks:
        a, b = r["nvfp4"], r["bf16"]
        assert len(a["logp"]) == len(b["logp"]) > 0
        for x, y in zip(a["logp"], b["logp"]):
            assert x.dtype == np.float32 and np.array_equal(x, y)
        assert a["metrics"]["actor/entropy"] == b["metrics"]["actor/entropy"]
        assert a["metrics"]["r3/replayed_fraction"] == b["metrics"]["r3/replayed_fraction"] > 0
        assert a["metrics"]["r3/live_k3_kl"] == b["metrics"]["r3/live_k3_kl"] > 0  # foreign routing replayed
        assert "r3/live_k3_kl" not in a["second_metrics"]
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac"):
            assert a["step"][k] == b["step"][k], k
    a, b = ranks[0]["nvfp4"]["grads"], ranks[0]["bf16"]["grads"]
    assert set(a) == set(b) and any("experts" in k for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
        assert a[k].abs().sum() > 0, k


def test_merged_export_dequantizes_the_packed_base_to_the_twin(results):
    ranks = results
    a, b = ranks[0]["nvfp4"]["merged"], ranks[0]["bf16"]["merged"]
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_packed_base_bytes_are_under_0_3x_the_bf16_twins_and_reported_once(results):
    ranks = results
    for r in ranks:
        packed, twin_bf16 = r["nvfp4"]["base_bytes"], r["bf16_bytes"]["base_bytes"]
        assert 0 < packed <= 0.3 * twin_bf16, (packed, twin_bf16)
        assert r["bf16"]["base_bytes"] == 2 * twin_bf16  # the fp32 twin: the same weights at 4 bytes
        assert r["nvfp4"]["metrics"]["trainer/base_bytes"] == packed
        assert "trainer/base_bytes" not in r["nvfp4"]["second_metrics"]
    # each rank holds half (FSDP's even shards)
    assert ranks[0]["nvfp4"]["base_bytes"] == ranks[1]["nvfp4"]["base_bytes"]
