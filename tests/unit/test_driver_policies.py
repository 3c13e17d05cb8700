"""Driver policies that need no workers: GPU placement plans and the non-finite-update rule."""

from __future__ import annotations

import json

import pytest

from rl.config import load_config
from rl.monitor import StopRun
from rl.placement import plan_placement


def _cfg(*overrides):
    return load_config("demo_cpu", ["run.name=t", *overrides])


def test_cpu_runs_need_no_placement_group():
    bundles, place = plan_placement(_cfg())
    assert bundles == [] and place.placement_group is None


def test_colocated_shares_each_gpu_between_a_rank_and_an_engine():
    bundles, place = plan_placement(
        _cfg(
            "resources.num_gpus=2",
            "trainer.num_ranks=2",
            "rollout.num_workers=2",
            "rollout.placement=colocated",
        )
    )
    assert bundles == [{"GPU": 1, "CPU": 2}] * 2
    assert place.trainer_gpus_per_rank == 0.5 and place.rollout_options["num_gpus"] == 0.5
    assert place.rollout_bundles == [[0], [1]]


def test_split_gives_engines_their_own_tp_bundles():
    bundles, place = plan_placement(
        _cfg(
            "resources.num_gpus=8",
            "trainer.num_ranks=4",
            "rollout.num_workers=2",
            "rollout.tensor_parallel_size=2",
            "rollout.placement=split",
        )
    )
    assert bundles == [{"GPU": 1, "CPU": 1}] * 4 + [{"GPU": 2, "CPU": 1}] * 2
    assert place.rollout_bundles == [[4], [5]] and place.trainer_gpus_per_rank == 1.0


def test_layouts_that_do_not_fit_name_the_keys():
    with pytest.raises(
        ValueError, match=r"rollout.placement: split placement needs 4 rollout \+ 2 trainer GPUs"
    ):
        plan_placement(
            _cfg(
                "resources.num_gpus=4",
                "trainer.num_ranks=2",
                "rollout.num_workers=2",
                "rollout.tensor_parallel_size=2",
                "rollout.placement=split",
            )
        )
    with pytest.raises(
        ValueError, match="rollout.tensor_parallel_size: 4 GPUs an engine is more than a node's"
    ):
        plan_placement(
            _cfg(
                "resources.num_gpus=4",
                "resources.gpus_per_node=2",
                "resources.nodes=2",
                "trainer.num_ranks=4",
                "rollout.tensor_parallel_size=4",
                "rollout.placement=colocated",
            )
        )


class _Log:
    def __init__(self):
        self.events = []

    def event(self, text):
        self.events.append(text)


def _bare_run(limit=3):
    """A Run without workers (built with __new__): only the skip counter and its logger, a list."""
    from rl.driver import Run

    run = Run.__new__(Run)
    run.cfg = _cfg(f"trainer.max_skipped_steps={limit}")
    run.dir, run.log = "runs/t", _Log()
    run.skipped_in_a_row = run.skipped_total = 0
    return run


def test_a_non_finite_update_is_skipped_counted_and_three_in_a_row_abort():
    run = _bare_run()
    for step, skipped in enumerate([1, 0, 1, 1], start=1):
        assert run._count_skips(step, {"actor/skipped_step": float(skipped)}) == [1, 1, 2, 3][step - 1]
    assert run.skipped_in_a_row == 2 and len(run.log.events) == 3
    with pytest.raises(
        StopRun, match=r"3 updates in a row had a non-finite loss .*trainer.max_skipped_steps=3"
    ):
        run._count_skips(5, {"actor/skipped_step": 1.0})


def test_compiled_gpu_trainer_announces_its_long_first_step():
    from rl.driver import compile_notice

    assert compile_notice(_cfg()) is None  # CPU: the worker does not compile
    gpus = [
        "resources.num_gpus=2",
        "trainer.num_ranks=2",
        "rollout.num_workers=2",
        "rollout.placement=colocated",
    ]
    assert compile_notice(_cfg(*gpus, "trainer.compile=false")) is None
    notice = compile_notice(_cfg(*gpus))
    assert notice and "first step compiles" in notice and "trainer.compile=false" in notice


def test_an_asynchronous_run_without_a_lag_correction_is_told_before_it_starts():
    from rl.driver import staleness_notice

    assert staleness_notice(_cfg()) is None  # synchronous
    notice = staleness_notice(_cfg("rollout.max_staleness=1"))
    assert notice and "rollout.max_staleness=1" in notice and "tis_cap" in notice
    assert staleness_notice(_cfg("rollout.max_staleness=1", "algorithm.rollout_correction.tis_cap=2")) is None
    assert (
        staleness_notice(_cfg("rollout.max_staleness=2", "algorithm.rollout_correction.mis_high=3")) is None
    )


def test_every_draw_of_every_step_and_every_eval_gets_its_own_sampling_seed():
    from rl.config import MAX_DRAWS, ConfigError
    from rl.driver import eval_stream, sampling_seed, train_stream

    for run_seed in (0, 7):
        train = [sampling_seed(run_seed, train_stream(s, d)) for s in range(1, 301) for d in range(MAX_DRAWS)]
        evals = [sampling_seed(run_seed, eval_stream(s)) for s in range(0, 301)]
        assert len(set(train)) == len(train) and len(set(evals)) == len(evals)
        assert not set(train) & set(evals)
        assert all(0 <= x < 2**31 - 1 for x in train + evals)
    # The draw that would reach the next step's streams is refused, by the config and by the driver.
    with pytest.raises(ValueError, match="draw 64 outside 0..63"):
        train_stream(1, MAX_DRAWS)
    with pytest.raises(ConfigError, match="algorithm.dynamic_sampling.max_draws: must be in \\[1, 64\\]"):
        _cfg(f"algorithm.dynamic_sampling.max_draws={MAX_DRAWS + 1}")
    assert (
        _cfg(f"algorithm.dynamic_sampling.max_draws={MAX_DRAWS}").algorithm.dynamic_sampling.max_draws == 64
    )


def test_the_k3_check_and_the_lengths_count_only_the_tokens_the_policy_sampled():
    """Environment tokens inside a response (Sample.loss_mask False) carry placeholder rollout log-probs:
    the on-policy check skips them, and response_length counts sampled tokens."""
    import numpy as np

    from rl.core.batch import Sample
    from rl.driver import batch_metrics, mismatch_metrics

    rollout = np.array([-1.0, -2.0, 0.0, 0.0, -0.5], np.float32)  # two placeholders where the env spoke
    s = Sample([1, 2], [3, 4, 5, 6, 7], rollout, "stop", 0, 0, loss_mask=np.array([1, 1, 0, 0, 1], bool))
    s.reward, s.acc = 1.0, True
    trainer = np.array([-1.1, -2.0, -9.0, -7.0, -0.5], np.float32)
    masked = mismatch_metrics([trainer], [s])
    sampled_only = Sample([1, 2], [3, 4, 7], rollout[[0, 1, 4]], "stop", 0, 0)
    assert masked == mismatch_metrics([trainer[[0, 1, 4]]], [sampled_only])
    assert 0 < masked["rollout_corr/k3_kl"] < 1e-2  # the placeholders' gaps of 7 and 9 nats left out
    assert batch_metrics([s], [s], 16)["response_length/mean"] == 3


def test_evaluation_scores_the_tasks_reward_and_training_the_shaped_one(tmp_path):
    """DAPO's overlong penalty shapes the training rewards only: an evaluation's records hold the task's
    reward, as `sparkrl eval` scores them. The engine's samples come from a stub (`generate` returns given
    samples); the scoring, the real tokenizer and reward checker, is what runs."""
    import numpy as np

    from rl.core.batch import Sample
    from rl.data.loader import Prompt
    from rl.driver import Run
    from rl.evaluation import records_path
    from rl.reward import RewardPool
    from rl.tiny import train_tokenizer

    tok = train_tokenizer(0)
    response = tok.encode("1 + 2 = 3, so 3.\nAnswer: 3", add_special_tokens=False)
    assert 16 < len(response) < 32  # inside the penalty's ramp: the last 16 of 32 tokens

    def samples():
        return [
            Sample([1, 2], list(response), np.zeros(len(response), np.float32), "stop", 0, 0, "arith", "3")
            for _ in range(2)
        ]

    class Rollout:
        def generate(self, requests, sampling):
            return samples()

    run = Run.__new__(Run)
    run.cfg = _cfg("rollout.max_response_len=32", "algorithm.overlong.buffer_len=16", "eval.k=2")
    run.tokenizer, run.reward, run.rollout = tok, RewardPool(num_workers=0), Rollout()
    run.dir, run.log, run.eval_history = tmp_path, _Log(), []
    run.eval_prompts = [Prompt([1, 2], "arith", "3", 0)]

    train = samples()
    run._score(train, run.eval_prompts)
    assert all(s.acc for s in train) and all(0 < s.reward < 1 for s in train)  # shaped
    metrics = run._evaluate(0)
    assert metrics["val-core/arith/reward/mean@2"] == 1.0
    records = [json.loads(line) for line in records_path(tmp_path, 0).read_text().splitlines()]
    assert [r["score"] for r in records] == [1.0, 1.0]


def test_a_run_with_evaluation_on_and_no_eval_data_is_told_before_it_starts():
    from rl.driver import eval_notice

    assert eval_notice(_cfg()) is None  # the demo evaluates on synthetic:arith
    notice = eval_notice(_cfg("eval.data="))
    assert notice and "eval.every=5 but eval.data is not set" in notice
    assert eval_notice(_cfg("eval.data=", "eval.every=0")) is None


def test_colocated_engines_wake_after_the_trainer_returns_its_cached_memory():
    """The engines' weights and KV cache come back into the memory the trainer's update peaked in, which
    PyTorch's caching allocator keeps reserved unless returned. The sleep mode and the CUDA allocator need a
    GPU, so the rollout pool and the trainer group here are recorders of the calls, in order."""
    calls = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getattr__(self, method):
            return lambda *a, **k: calls.append(f"{self.name}.{method}")

    run = _bare_run()
    run.trainer, run.rollout = Recorder("trainer"), Recorder("rollout")
    run._wake_engines()
    assert calls == ["trainer.release_cached_memory", "rollout.wake_up"]
