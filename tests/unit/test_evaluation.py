"""rl.evaluation: mean@k, maj@k and best@k on hand-computed cases, and the per-sample JSONL records."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest

from rl.core.batch import Sample
from rl.evaluation import (
    EvalRecord,
    best_at_k,
    eval_metrics,
    maj_at_k,
    mean_at_k,
    read_records,
    records_from_samples,
    records_path,
    write_records,
)
from rl.reward import ERROR_PRED, INVALID, TIMEOUT_PRED


def _records(source: str, problem, preds: list[str], accs: list[bool], truth: str = "") -> list[EvalRecord]:
    return [
        EvalRecord(source, problem, i, truth, p, a, 1.0 if a else -1.0, response=f"Answer: {p}")
        for i, (p, a) in enumerate(zip(preds, accs))
    ]


T, F = True, False
# aime, k = 4:
#   p0: right, wrong, wrong, right; "5" and "3" tie 2-2, "5" came first  -> mean 1/2, maj 1, best 1
#   p1: all wrong; "7" wins 2-1 (no answer does not vote)                 -> mean 0,   maj 0, best 0
#   p2: one right; the only extracted answer is the right "12"             -> mean 1/4, maj 1, best 1
AIME = (
    _records("aime", 0, ["5", "3", "3", "5"], [T, F, F, T], "5")
    + _records("aime", 1, ["7", INVALID, "8", "7"], [F, F, F, F], "9")
    + _records("aime", 2, [INVALID, "12", TIMEOUT_PRED, ERROR_PRED], [F, T, F, F], "12")
)
# arith, k = 2:
#   q0: both right                                   -> mean 1,   maj 1, best 1
#   q1: "2" (wrong) and "9" (right) tie, "2" first   -> mean 1/2, maj 0, best 1
ARITH = _records("synthetic/arith", "q0", ["1", "1"], [T, T], "1") + _records(
    "synthetic/arith", "q1", ["2", "9"], [F, T], "9"
)
EXPECTED = {
    "val-core/aime/acc/mean@4": (0.5 + 0 + 0.25) / 3,
    "val-core/aime/acc/maj@4": 2 / 3,
    "val-core/aime/acc/best@4": 2 / 3,
    "val-core/synthetic/arith/acc/mean@2": 0.75,
    "val-core/synthetic/arith/acc/maj@2": 0.5,
    "val-core/synthetic/arith/acc/best@2": 1.0,
    # the scores (+1 right, -1 wrong) averaged: 2 * mean@k - 1
    "val-core/aime/reward/mean@4": 2 * (0.5 + 0 + 0.25) / 3 - 1,
    "val-core/synthetic/arith/reward/mean@2": 0.5,
}


def test_per_problem_metrics():
    assert mean_at_k([T, F, F, T]) == 0.5
    assert best_at_k([F, F, T]) == 1.0 and best_at_k([F, F]) == 0.0
    assert maj_at_k(["5", "3", "3", "5"], [T, F, F, T]) == 1.0  # tie: first given
    assert maj_at_k(["3", "5", "5", "3"], [F, T, T, F]) == 0.0
    assert maj_at_k(["4", "4", "4", "9"], [F, F, F, T]) == 0.0  # the majority is wrong, the minority right
    assert maj_at_k([INVALID, INVALID, INVALID, "9"], [F, F, F, T]) == 1.0  # no answer does not vote
    assert maj_at_k([INVALID, ERROR_PRED], [F, F]) == 0.0
    with pytest.raises(ValueError, match="no samples"):
        mean_at_k([])
    with pytest.raises(ValueError, match="2 answers and 1 accuracies"):
        maj_at_k(["1", "2"], [T])


def test_eval_metrics_per_data_source():
    metrics = eval_metrics(AIME + ARITH)
    assert metrics.keys() == EXPECTED.keys()
    for key, value in EXPECTED.items():
        assert metrics[key] == pytest.approx(value), key


def test_eval_metrics_ignore_record_order_and_check_k():
    shuffled = AIME + ARITH
    random.Random(0).shuffle(shuffled)
    assert eval_metrics(shuffled) == pytest.approx(eval_metrics(AIME + ARITH))
    assert eval_metrics(AIME, k=4) == pytest.approx({k: v for k, v in EXPECTED.items() if "/aime/" in k})
    with pytest.raises(ValueError, match=r"'synthetic/arith', problem 'q0' has 2 samples, expected 4 \(k\)"):
        eval_metrics(ARITH, k=4)


def test_eval_metrics_bad_records():
    with pytest.raises(ValueError, match=r"problem 1 has 3 samples, expected 4 like its first problem"):
        eval_metrics(AIME[:7])
    with pytest.raises(ValueError, match=r"problem 0 has sample 0 twice"):
        eval_metrics(AIME + AIME[:1])
    with pytest.raises(ValueError, match="no records"):
        eval_metrics([])
    with pytest.raises(TypeError, match="EvalRecord.acc must be a bool, got int"):
        EvalRecord("aime", 0, 0, "1", "1", 1, 1.0)


def test_records_round_trip_through_jsonl(tmp_path):
    records = [dataclasses.replace(r) for r in AIME + ARITH]  # copies: the module's records stay as they are
    records[0].response = "所以答案是 5。\nAnswer: 5"
    records[0].extra = {"prompt_tokens": 42}
    path = write_records(records_path(tmp_path / "run", 10), records)
    assert path == tmp_path / "run" / "eval" / "step_10.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(records)
    assert json.loads(lines[0])["response"] == "所以答案是 5。\nAnswer: 5"  # unicode kept as is
    back = read_records(path)
    assert back == records
    assert eval_metrics(back) == pytest.approx(EXPECTED)
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_10.jsonl"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = write_records(tmp_path / "step_1.jsonl", ARITH)
    before = path.read_bytes()
    bad = [*ARITH, EvalRecord("x", 0, 0, "1", "1", True, 1.0, extra={"not json": object()})]
    with pytest.raises(TypeError):
        write_records(path, bad)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["step_1.jsonl"]


def test_read_records_names_the_line_and_key(tmp_path):
    path = write_records(tmp_path / "step_2.jsonl", ARITH)
    good = path.read_text().splitlines()
    broken = json.loads(good[1])
    del broken["acc"]
    path.write_text("\n".join([good[0], json.dumps(broken)]) + "\n")
    with pytest.raises(ValueError, match=r"step_2\.jsonl:2: record lacks key\(s\) \['acc'\]"):
        read_records(path)
    path.write_text(good[0] + "\n{not json\n")
    with pytest.raises(ValueError, match=r"step_2\.jsonl:2: not JSON"):
        read_records(path)
    extra = json.loads(good[0]) | {"temperature": 1.0}
    path.write_text(json.dumps(extra) + "\n")
    with pytest.raises(ValueError, match=r"step_2\.jsonl:1: unknown key\(s\) \['temperature'\]"):
        read_records(path)


def _scored(group: int, pred: str, acc: bool, source: str = "aime") -> Sample:
    s = Sample(
        prompt_ids=[1],
        response_ids=[2, 3, 4],
        response_logprobs=np.zeros(3),
        finish_reason="stop",
        adapter_version=3,
        group=group,
        data_source=source,
        ground_truth="5",
    )
    s.reward, s.acc, s.pred = (1.0 if acc else -1.0), acc, pred
    return s


def test_records_from_samples_number_samples_within_groups():
    samples = [_scored(0, "5", T), _scored(1, "4", F), _scored(0, "4", F), _scored(1, "5", T)]
    records = records_from_samples(samples, ["a", "b", "c", "d"])
    assert [(r.problem, r.sample, r.response) for r in records] == [
        (0, 0, "a"),
        (1, 0, "b"),
        (0, 1, "c"),
        (1, 1, "d"),
    ]
    assert records[0].response_length == 3 and records[1].score == -1.0
    assert eval_metrics(records) == pytest.approx(
        {
            "val-core/aime/acc/mean@2": 0.5,
            "val-core/aime/acc/maj@2": 0.5,
            "val-core/aime/acc/best@2": 1.0,
            "val-core/aime/reward/mean@2": 0.0,
        }
    )
    unscored = _scored(2, "5", T)
    unscored.acc = None
    with pytest.raises(ValueError, match=r"sample 0 \(group 2\) has no reward; score it first"):
        records_from_samples([unscored], ["x"])


def test_a_second_evaluation_of_a_checkpoint_keeps_the_first_ones_records(tmp_path):
    from rl.eval_run import unused_path

    path = tmp_path / "eval" / "eval_step_2.jsonl"
    assert unused_path(path) == path
    path.parent.mkdir()
    path.write_text("first\n")
    second = unused_path(path)
    assert second.name == "eval_step_2.2.jsonl"
    second.write_text("second\n")
    assert unused_path(path).name == "eval_step_2.3.jsonl" and path.read_text() == "first\n"
