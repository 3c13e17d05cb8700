"""rl.reward: verl's math_dapo rule on realistic responses, and the pool's timeout, crash and error handling."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

from rl import reward
from rl.core.batch import Sample
from rl.reward import ERROR_PRED, INVALID, TIMEOUT_PRED, RewardPool, score, score_batch

LONG_TAIL = "\n\nLet me double-check the arithmetic once more. " + "It holds. " * 40

# (response, ground truth, acc, pred): what verl's math_dapo gives, traced through its code by hand.
TABLE = [
    # The DAPO format: the last line "Answer: ...".
    ("Walking takes 9/s hours ... so the walk takes 204 minutes.\nAnswer: 204", "204", True, "204"),
    ("answer: 204", "204", True, "204"),  # the pattern ignores case
    ("First guess.\nAnswer: 3\nThat was wrong; redo it.\nAnswer: 204", "204", True, "204"),  # last one counts
    ("Answer: 204\nOn reflection that is off.\nAnswer: 3", "204", False, "3"),
    # \boxed{}: inside an Answer line it is unwrapped; alone, the box is compared verbatim.
    ("Answer: \\boxed{204}", "204", True, "204"),
    ("Hence the walk takes $\\boxed{204}$ minutes.", "204", True, "204"),
    ("Hence $\\boxed{ 204 }$.", "204", False, " 204 "),
    ("Hence $\\boxed{1,000}$.", "1000", False, "1,000"),
    # Thousands separators of plain integers are dropped; dollars, $...$ and units are stripped.
    ("Answer: 1,000", "1000", True, "1000"),
    ("Answer: 1,000", "1,000", True, "1000"),
    ("Answer: $204$", "204", True, "204"),
    ("Answer: $204$.", "204", True, "204"),
    ("Answer: 204.", "204", False, "204."),
    ("Answer: 204.0", "204", False, "204.0"),
    ("Answer: 204 minutes", "204", True, "204"),
    ("Answer: \\$18", "18", True, "18"),
    ("Answer: 30^\\circ", "30", True, "30"),
    ("Answer: 5 cm", "5", True, "5"),
    # LaTeX fractions: shorthand is expanded, but 1/2 is not \frac{1}{2}.
    ("Answer: $\\frac{1}{2}$", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: \\frac12", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: 1/2", "\\frac{1}{2}", False, "1/2"),
    ("Answer: x = 204", "204", True, "204"),  # the text after the last "=" is the answer
    # No answer at all.
    ("I believe the walk takes 204 minutes.", "204", False, INVALID),
    ("", "204", False, INVALID),
    # Only the last 300 characters are read: an answer followed by a long check is lost.
    ("Answer: 204" + LONG_TAIL, "204", False, INVALID),
    # Unicode: fine around the answer, but full-width digits are not normalised.
    ("所以答案是二百零四。\nAnswer: 204", "204", True, "204"),
    ("Answer: ２０４", "204", False, "２０４"),
    ("Answer: π", "\\pi", False, "π"),
]


@pytest.mark.parametrize("response, ground_truth, acc, pred", TABLE)
def test_math_dapo_scores_realistic_responses(response, ground_truth, acc, pred):
    out = score(response, ground_truth)
    assert out == {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


def test_pathological_responses_score_wrong_quickly():
    digits = "1" * 100_000
    nested = "Answer: " + "\\frac{" * 5000 + "1" + "}{2}" * 5000
    unclosed = "Answer: \\boxed{" + "{" * 50_000
    start = time.monotonic()
    outs = [score(r, "204") for r in (digits, nested, unclosed)]
    assert time.monotonic() - start < 2.0
    assert [o["acc"] for o in outs] == [False, False, False]
    assert outs[0]["pred"] == INVALID


def test_score_rejects_non_string_and_empty_answers():
    with pytest.raises(TypeError, match="ground_truth must be a str, got int"):
        score("Answer: 204", 204)
    with pytest.raises(TypeError, match="response must be a str"):
        score(None, "204")
    with pytest.raises(ValueError, match="ground_truth is empty"):
        score("\\boxed{}", "  ")
    with pytest.raises(ValueError, match="unknown reward backend 'sympy'"):
        score("Answer: 1", "1", backend="sympy")


def test_math_dapo_is_loaded_without_importing_torch():
    # Pool workers load verl's math_dapo.py by path; importing the verl package would pull in torch.
    module = reward._math_dapo()
    assert module.compute_score("Answer: 7", "7") == {"score": 1.0, "acc": True, "pred": "7"}
    if "verl.utils.reward_score.math_dapo" not in sys.modules:
        assert module.__name__ == "_sparkrl_verl_math_dapo"


def test_math_verify_missing_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    reward._math_verify.cache_clear()
    try:
        with pytest.raises(ImportError, match=r'pip install "math-verify\[antlr4-9-3\]"'):
            RewardPool(num_workers=0, backend="math_verify")
    finally:
        reward._math_verify.cache_clear()


def test_math_verify_backend_when_installed():
    pytest.importorskip("math_verify")
    reward._math_verify.cache_clear()
    assert score("Answer: 204", "204", backend="math_verify")["acc"] is True
    # Where math_dapo compares strings, math-verify compares values.
    assert score("Answer: $0.5$", "\\frac{1}{2}", backend="math_verify")["acc"] is True
    assert score("Answer: \\dfrac{1}{2}", "\\frac{1}{2}")["acc"] is False
    out = score("no answer here", "204", backend="math_verify")
    assert out == {"score": -1.0, "acc": False, "pred": INVALID}


# Pool ------------------------------------------------------------------------------------------------
# Backends for the pool tests: module-level so that the worker processes can unpickle them.


def hang_on_request(response: str, ground_truth: str) -> dict:
    if response == "hang":
        time.sleep(120)
    return reward.score(response, ground_truth)


def crash_on_request(response: str, ground_truth: str) -> dict:
    if response == "crash":
        os._exit(3)
    if response == "raise":
        raise ZeroDivisionError("the grader divided by zero")
    return reward.score(response, ground_truth)


def test_pool_matches_score_on_the_table():
    responses = [r for r, *_ in TABLE]
    truths = [g for _, g, *_ in TABLE]
    out = score_batch(responses, truths, timeout_s=20, num_workers=2)
    assert out.errors == 0 and out.timeouts == 0
    assert [(r["acc"], r["pred"]) for r in out.results] == [(acc, pred) for *_, acc, pred in TABLE]


def test_pool_kills_a_hung_worker_and_carries_on():
    # The timeout counts from a worker's READY, so a slow start on a loaded machine is not a timeout; 2 s
    # is far above scoring one answer and far below the 120 s hang.
    with RewardPool(num_workers=2, timeout_s=2.0, backend=hang_on_request) as pool:
        start = time.monotonic()
        out = pool.score_batch(
            ["Answer: 1", "hang", "Answer: 2", "hang", "Answer: 4"], ["1", "1", "2", "2", "3"]
        )
        elapsed = time.monotonic() - start
        assert [r["acc"] for r in out.results] == [True, False, True, False, False]
        assert [r["pred"] for r in out.results] == ["1", TIMEOUT_PRED, "2", TIMEOUT_PRED, "4"]
        assert [r["score"] for r in out.results] == [1.0, -1.0, 1.0, -1.0, -1.0]
        assert (out.errors, out.timeouts) == (2, 2)
        assert out.metrics() == {"reward/errors": 2.0, "reward/timeouts": 2.0}
        assert sorted(m.split(":")[0] for m in out.messages) == ["sample 1", "sample 3"]
        assert elapsed < 60  # two 2 s timeouts, not two 120 s sleeps
        # The replaced workers serve the next batch.
        again = pool.score_batch(["Answer: 5", "Answer: 6"], ["5", "6"])
        assert [r["acc"] for r in again.results] == [True, True] and again.errors == 0


class SlowToStart:
    """A grader whose worker takes 3 s to start (its unpickling in the new process sleeps): as a slow
    import of a real grader would on a loaded machine."""

    def __setstate__(self, state):
        time.sleep(3)

    def __call__(self, response: str, ground_truth: str) -> dict:
        return reward.score(response, ground_truth)


def test_pool_timeout_does_not_count_a_workers_start():
    with RewardPool(num_workers=1, timeout_s=1.0, backend=SlowToStart()) as pool:
        out = pool.score_batch(["Answer: 1", "Answer: 3"], ["1", "2"])
    assert (out.errors, out.timeouts) == (0, 0)
    assert [r["acc"] for r in out.results] == [True, False]


def test_pool_counts_crashes_and_exceptions_as_wrong():
    with RewardPool(num_workers=2, timeout_s=20, backend=crash_on_request) as pool:
        out = pool.score_batch(["crash", "Answer: 2", "raise", "Answer: 3"], ["2", "2", "3", "3"])
    assert [r["acc"] for r in out.results] == [False, True, False, True]
    assert [r["pred"] for r in out.results] == [ERROR_PRED, "2", ERROR_PRED, "3"]
    assert (out.errors, out.timeouts) == (2, 0)
    messages = " | ".join(sorted(out.messages))
    assert "sample 0: worker died (exit code 3)" in messages
    assert "sample 2: ZeroDivisionError: the grader divided by zero" in messages


def test_inline_pool_scores_in_process_and_counts_errors():
    with RewardPool(num_workers=0, backend=crash_on_request) as pool:
        out = pool.score_batch(["Answer: 9", "raise"], ["9", "9"])
    assert [r["acc"] for r in out.results] == [True, False]
    assert out.errors == 1 and out.results[1]["pred"] == ERROR_PRED


def test_score_batch_rejects_mismatched_and_non_string_inputs():
    with RewardPool(num_workers=0) as pool:
        with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
            pool.score_batch(["a", "b"], ["1"])
        with pytest.raises(TypeError, match="score_batch sample 1: ground_truth must be a str, got float"):
            pool.score_batch(["a", "b"], ["1", 2.5])


def _sample(group: int, ground_truth: str) -> Sample:
    return Sample(
        prompt_ids=[1, 2],
        response_ids=[3, 4, 5],
        response_logprobs=np.zeros(3),
        finish_reason="stop",
        adapter_version=0,
        group=group,
        data_source="math_dapo",
        ground_truth=ground_truth,
    )


def test_score_samples_fills_reward_acc_and_pred():
    samples = [_sample(0, "204"), _sample(0, "204"), _sample(1, "25")]
    with RewardPool(num_workers=0) as pool:
        out = pool.score_samples(samples, ["Answer: 204", "Answer: 240", "so $\\boxed{25}$"])
    assert out.errors == 0
    assert [(s.reward, s.acc, s.pred) for s in samples] == [
        (1.0, True, "204"),
        (-1.0, False, "240"),
        (1.0, True, "25"),
    ]


def always_crash(response: str, ground_truth: str) -> dict:
    os._exit(1)


def test_workers_that_always_die_raise_instead_of_scoring_everything_wrong():
    with RewardPool(num_workers=2, timeout_s=20, backend=always_crash) as pool:
        with pytest.raises(RuntimeError, match="9 reward workers in a row died without replying"):
            pool.score_batch(["Answer: 1"] * 20, ["1"] * 20)
