"""What the policy generated, as text a person reads (rl/rollout_records.py), and the warning for steps
that carry no gradient. The tokenizer is the tiny dense model's own (built locally, cached)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rl.core.batch import Sample
from rl.rollout_records import (
    ROW_KEYS,
    clip_text,
    flat_group_fraction,
    flat_reward_warning,
    read_rollouts,
    rollout_rows,
    whole_groups,
    write_rollouts,
)


def _sample(tok, group: int, prompt: str, response: str, reward: float, version: int = 3) -> Sample:
    p, r = tok.encode(prompt), tok.encode(response)
    return Sample(
        prompt_ids=p,
        response_ids=r,
        response_logprobs=np.full(len(r), -0.5, dtype=np.float32),
        finish_reason="stop",
        adapter_version=version,
        group=group,
        data_source="synthetic/arith",
        ground_truth="7",
        reward=reward,
        acc=reward > 0,
        pred="7" if reward > 0 else "5",
    )


@pytest.fixture(scope="module")
def tokenizer(tiny_dense_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dense_path)


def test_long_text_keeps_its_start_and_end():
    text = "A" * 50 + "B" * 50 + "answer 42"
    out = clip_text(text, 20)
    assert out.startswith("A" * 10) and out.endswith("answer 42"[-10:])
    assert "[... 89 cut ...]" in out
    assert clip_text(text, 0) == text and clip_text("short", 20) == "short" and clip_text(None, 5) == ""


def test_whole_groups_in_group_order_at_least_one():
    groups = [2, 0, 1, 0, 2, 1]
    samples = [Sample([1], [2], [0.0], "stop", 0, g) for g in groups]
    assert whole_groups(samples, 4) == [1, 3, 2, 5]  # groups 0 and 1, whole
    assert whole_groups(samples, 3) == [1, 3]  # group 1 would not fit whole
    assert whole_groups(samples, 1) == [1, 3]  # one group even where it is larger than the limit
    assert sorted(whole_groups(samples, 0)) == list(range(6))


def test_rows_name_every_field_and_round_trip(tmp_path, tokenizer):
    samples = [
        _sample(tokenizer, 0, "What is 3 + 4?", "3 + 4 = 7. The answer is 7.", 1.0),
        _sample(tokenizer, 0, "What is 3 + 4?", "The answer is 5.", -1.0),
        _sample(tokenizer, 1, "What is 1 + 1?", "2", 1.0, version=2),
    ]
    rows = rollout_rows(5, samples, [1e-4, None, float("nan")], tokenizer, per_step=2, max_chars=4000)
    assert [r["index"] for r in rows] == [0, 1]  # group 0 whole; group 1 past the limit
    assert all(tuple(r) == ROW_KEYS for r in rows)
    first = rows[0]
    assert "3 + 4" in first["prompt"] and "answer is 7" in first["response"]
    assert first["reward"] == 1.0 and first["acc"] is True and first["pred"] == "7"
    assert first["k3_kl"] == 1e-4 and rows[1]["k3_kl"] is None
    assert first["response_length"] == len(samples[0].response_ids) and first["adapter_version"] == 3
    path = write_rollouts(tmp_path, 5, rows)
    assert path == tmp_path / "rollouts" / "step_5.jsonl" and not list(path.parent.glob(".*"))
    assert read_rollouts(tmp_path, 5) == json.loads(json.dumps(rows))


def test_flat_groups_and_the_warnings(tmp_path):
    def batch(rewards_by_group):
        return [
            Sample([1], [2], [0.0], "stop", 0, g, reward=r)
            for g, rewards in enumerate(rewards_by_group)
            for r in rewards
        ]

    assert flat_group_fraction(batch([[1, 1], [0, 1]])) == 0.5
    assert flat_group_fraction(batch([[-1, -1], [-1, -1]])) == 1.0
    assert flat_reward_warning(4, 0, 3, -1.0, tmp_path) is None
    one = flat_reward_warning(4, 1, 3, -1.0, tmp_path)
    assert "step 4: every group had equal rewards (mean -1)" in one and "Likely causes" not in one
    loud = flat_reward_warning(6, 3, 3, -1.0, tmp_path)
    assert "3 steps in a row" in loud and "Likely causes" in loud and str(tmp_path / "rollouts") in loud
    assert flat_reward_warning(6, 3, 0, -1.0, tmp_path) is None  # monitor.flat_reward_steps=0: off
