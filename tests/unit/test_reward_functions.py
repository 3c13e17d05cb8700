"""Reward functions of the user's own (verl's signature) in rl.reward: a number or a dict back, fixed
keyword arguments, the batched form, per-source checkers next to the math ones, ground truths of any JSON
type, failures counted with the first traceback and its row in the log, the run stopped past
reward.max_error_fraction, and the preflight's one-line errors."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from rl.config import load_config
from rl.core.batch import Sample
from rl.monitor import StopRun
from rl.preflight import PreflightError, preflight, reward_problems
from rl.reward import ERROR_PRED, NO_PRED, RewardPool, RewardRow, RewardSpec, reward_metrics

FUNCTIONS = """
import os

def as_float(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if solution_str.strip() == str(ground_truth) else 0.25

def as_dict(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    # ground_truth is a JSON object here: {"target": int, "numbers": [...]}
    hit = solution_str.strip() == str(ground_truth["target"])
    return {"score": float(hit) + bonus, "acc": hit, "pred": solution_str.strip(), "length": len(solution_str),
            "note": "not a number", "pid": os.getpid(), "source_is_" + data_source: 1,
            "prompt_turns": len(extra_info["prompt"])}

def batched(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
    return [scale * float(s == g) for s, g in zip(solution_strs, ground_truths)]

def raises(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "boom":
        raise KeyError("no such field")
    return 1.0

def wrong_type(data_source, solution_str, ground_truth, extra_info):
    return "1.0"

def wrong_signature(response, truth):
    return 1.0
"""


@pytest.fixture()
def fns(tmp_path) -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(FUNCTIONS)
    return str(path)


def _rows(source, truths, extra=None):
    return [
        RewardRow(source, t, dict(extra or {"prompt": [{"role": "user", "content": "q"}]})) for t in truths
    ]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_number_and_a_dict_with_kwargs_and_extra_metrics(fns, workers):
    spec = RewardSpec(default=f"{fns}:as_float", default_key="reward.function")
    with RewardPool(workers, 20, spec) as pool:
        out = pool.score_rows(["7", "8"], _rows("s", ["7", "7"]))
    assert out.results == [
        {"score": 1.0, "acc": True, "pred": NO_PRED},
        {"score": 0.25, "acc": False, "pred": NO_PRED},
    ]
    spec = RewardSpec(default=f"{fns}:as_dict", kwargs={"bonus": 0.5}, default_key="reward.function")
    truth = {"target": 24, "numbers": [4, 6]}  # any JSON value reaches the function as it is
    with RewardPool(workers, 20, spec) as pool:
        out = pool.score_rows(["24", "25 "], _rows("count", [truth, truth]))
    assert out.errors == 0
    assert out.results == [
        {"score": 1.5, "acc": True, "pred": "24"},
        {"score": 0.5, "acc": False, "pred": "25"},
    ]
    pids = {e.pop("pid") for e in out.extras}
    assert out.extras == [
        {"length": 2.0, "source_is_count": 1.0, "prompt_turns": 1.0},
        {"length": 3.0, "source_is_count": 1.0, "prompt_turns": 1.0},
    ]
    # scored in the reward processes: they import the file themselves
    assert (pids != {__import__("os").getpid()}) == (workers > 0)


def test_batched_calls_once_a_worker_share(fns):
    spec = RewardSpec(
        default=f"{fns}:batched", kwargs={"scale": 2.0}, batched=True, default_key="reward.function"
    )
    with RewardPool(2, 5, spec) as pool:
        out = pool.score_rows(["a", "b", "c"], _rows("s", ["a", "x", "c"]))
    assert [r["score"] for r in out.results] == [2.0, 0.0, 2.0]
    assert [r["acc"] for r in out.results] == [True, False, True] and out.errors == 0


def test_by_source_scores_each_row_with_its_checker(fns):
    spec = RewardSpec(
        default=f"{fns}:as_float", by_source={"math": "math_dapo"}, default_key="reward.function"
    )
    rows = _rows("math", ["4"]) + _rows("words", ["yes"]) + _rows("math", ["5"])
    with RewardPool(0, 5, spec) as pool:
        out = pool.score_rows(["Answer: 4", "yes", "Answer: 4"], rows)
    assert [(r["score"], r["acc"], r["pred"]) for r in out.results] == [
        (1.0, True, "4"),
        (1.0, True, NO_PRED),
        (-1.0, False, "4"),
    ]
    # the math checker still needs a non-empty string ground truth; the function takes any value
    assert spec.needs_text("math") and not spec.needs_text("words")
    with (
        RewardPool(0, 5, spec) as pool,
        pytest.raises(TypeError, match="ground_truth must be a str, got int"),
    ):
        pool.score_rows(["Answer: 4"], _rows("math", [4]))
    samples = [
        Sample([1], [2], np.zeros(1), "stop", 0, i, data_source=r.data_source) for i, r in enumerate(rows)
    ]
    for s, r in zip(samples, out.results):
        s.reward, s.acc = r["score"], r["acc"]
    samples[1].extra = {"length": 3.0}
    assert reward_metrics(samples) == {
        "reward/math/mean": 0.0,
        "acc/math/mean": 0.5,
        "reward/words/mean": 1.0,
        "acc/words/mean": 1.0,
        "reward/length": 3.0,
    }


@pytest.mark.parametrize("workers", [0, 1])
def test_failures_are_counted_and_the_first_traceback_logged_with_its_row(fns, tmp_path, workers):
    log = tmp_path / "logs" / "reward.log"
    spec = RewardSpec(
        default=f"{fns}:raises", by_source={"typed": f"{fns}:wrong_type"}, default_key="reward.function"
    )
    rows = _rows("s", ["1", "2", "3"], {"id": 7}) + _rows("typed", ["1"])
    with RewardPool(workers, 20, spec, log_path=log) as pool:
        out = pool.score_rows(["boom", "fine", "boom", "x"], rows)
        again = pool.score_rows(["boom"], rows[:1])
    assert [r["pred"] for r in out.results] == [ERROR_PRED, NO_PRED, ERROR_PRED, ERROR_PRED]
    assert [r["score"] for r in out.results] == [-1.0, 1.0, -1.0, -1.0]
    assert out.errors == 3 and out.metrics()["reward/errors"] == 3.0
    assert out.messages[0] == "sample 0: KeyError: 'no such field'"
    assert "returned str; expected a number or a dict with 'score'" in out.messages[2]
    assert [line.split(":")[0] for line in out.logged] == ["reward.function", "reward.by_source.typed"]
    assert again.errors == 1 and again.logged == []  # a checker's first failure only
    text = log.read_text()
    assert text.count("=== ") == 2
    assert 'raise KeyError("no such field")' in text and "Traceback" in text
    assert 'extra_info: {"id": 7}' in text and 'response: "boom"' in text and 'ground_truth: "1"' in text


def test_the_run_stops_past_max_error_fraction(tmp_path):
    from rl.driver import Run

    run = SimpleNamespace(cfg=SimpleNamespace(reward=SimpleNamespace(max_error_fraction=0.25)), dir=tmp_path)
    Run._check_reward_errors(run, "step 3", 2, 8, "sample 1: KeyError: 'x'")  # 25 %: not over
    with pytest.raises(StopRun) as e:
        Run._check_reward_errors(run, "step 3", 3, 8, "sample 1: KeyError: 'x'")
    message = str(e.value)
    assert message.startswith(
        "step 3: 3 of 8 responses failed to score (38%, over reward.max_error_fraction=0.25)"
    )
    assert "first: sample 1: KeyError: 'x'" in message and str(tmp_path / "logs" / "reward.log") in message


def _recipe(tmp_path, fns, extra: str) -> str:
    data = tmp_path / "train.jsonl"
    row = {
        "data_source": "count",
        "prompt": [{"role": "user", "content": "make 24"}],
        "reward_model": {"ground_truth": {"target": 24, "numbers": [4, 6]}},
        "extra_info": {"index": 0},
    }
    data.write_text(json.dumps(row) + "\n")
    path = tmp_path / "r.yaml"
    path.write_text(
        f"run: {{name: t}}\nmodel: {{make_tiny: {{arch: qwen3_moe}}}}\ndata: {{train: '{data}'}}\n"
        f"eval: {{every: 0}}\nr3: {{enabled: true}}\n{extra}"
    )
    return str(path)


def test_preflight_calls_each_function_on_the_first_row(fns, tmp_path):
    ok = load_config(_recipe(tmp_path, fns, f"reward: {{function: '{fns}:as_dict'}}\n"))
    preflight(ok)  # the JSON ground truth is the function's: no text required of it
    cases = {
        "missing.py:f": f"reward.function: '{tmp_path}/missing.py:f': no such file {tmp_path}/missing.py",
        f"{fns}:nope": f"reward.function: file {fns} has no 'nope'",
        f"{fns}:wrong_signature": f"reward.function: {fns}:wrong_signature does not take verl's arguments "
        "(data_source, solution_str, ground_truth, extra_info): missing a required argument: 'response'",
        f"{fns}:wrong_type": f"reward.function: {fns}:wrong_type returned str; expected a number or a dict with "
        "'score' (on the first row of data source 'count' with an empty response",
        f"{fns}:as_float": None,
    }
    for value, message in cases.items():
        cfg = load_config(_recipe(tmp_path, fns, f"reward: {{function: '{value}'}}\n"))
        problems = reward_problems(cfg, None)
        assert problems == [] or message is not None
        if message is None:
            preflight(cfg)
            continue
        with pytest.raises(PreflightError) as e:
            preflight(cfg)
        assert len(e.value.problems) == 1 and e.value.problems[0].startswith(message), e.value.problems
    # a math checker on a JSON ground truth: the data error names the file and the column
    cfg = load_config(_recipe(tmp_path, fns, "reward: {backend: math_dapo}\n"))
    with pytest.raises(
        PreflightError, match=r"train.jsonl: column 'reward_model.ground_truth': holds struct<target"
    ):
        preflight(cfg)


def test_preflight_checks_an_own_loss_and_estimator(tmp_path, fns):
    (tmp_path / "algos.py").write_text(
        "def adv(token_level_rewards, response_mask, index, config=None):\n"
        "    return token_level_rewards - token_level_rewards.mean(), None\n"
        "def bad_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, w=None):\n"
        "    return 1.0\n"
    )
    base = f"reward: {{function: '{fns}:as_dict'}}\n"
    good = load_config(_recipe(tmp_path, fns, base + "algorithm: {adv_estimator: 'algos.py:adv'}\n"))
    preflight(good)
    bad = load_config(_recipe(tmp_path, fns, base + "algorithm: {policy_loss: 'algos.py:bad_loss'}\n"))
    with pytest.raises(PreflightError) as e:
        preflight(bad)
    assert e.value.problems == [
        f"algorithm.policy_loss: {tmp_path}/algos.py:bad_loss failed on a batch of 4 samples: TypeError: policy "
        f"loss '{tmp_path}/algos.py:bad_loss' returned float; expected (scalar loss tensor, metrics dict), verl's "
        "PolicyLossFn"
    ]


def test_the_data_keeps_any_ground_truth_for_a_function_and_checks_the_math_rows(tmp_path):
    from rl.data.loader import reward_extra_info
    from rl.data.problems import DataError
    from rl.data.sources import load_source

    def row(source, truth):
        return {
            "data_source": source,
            "prompt": [{"role": "user", "content": f"q {source} {truth}"}],
            "reward_model": {"ground_truth": truth},
            "extra_info": {"k": 1},
        }

    path = tmp_path / "mixed.jsonl"
    path.write_text(
        "\n".join(json.dumps(r) for r in [row("words", " padded "), row("math", " 7 "), row("words", "")])
    )
    spec = RewardSpec(default="/x/f.py:score", by_source={"math": "math_dapo"})
    rows = list(load_source(str(path), text_answers=spec.needs_text).dataset)
    # the math row's answer is stripped text; the function's rows keep their value, an empty string included
    assert [r["reward_model"]["ground_truth"] for r in rows] == [" padded ", "7", ""]
    assert reward_extra_info(rows[0]) == {"k": 1, "prompt": [{"role": "user", "content": "q words  padded "}]}
    # every row a math checker's: the empty answer is a problem named by file and row
    with pytest.raises(
        DataError, match=r"mixed.jsonl: row 3: column 'reward_model.ground_truth': an empty string"
    ):
        load_source(str(path))
    objects = tmp_path / "objects.jsonl"
    objects.write_text("\n".join(json.dumps(row("count", {"target": t, "numbers": [1, t]})) for t in (3, 4)))
    got = [
        r["reward_model"]["ground_truth"]
        for r in load_source(str(objects), text_answers=lambda s: False).dataset
    ]
    assert got == [{"target": 3, "numbers": [1, 3]}, {"target": 4, "numbers": [1, 4]}]
