"""algorithm.rollout_correction.mode: with rollout.max_staleness > 0 and no cap named, the run weighs the lag
with AUTO_CORRECTION (TIS capped at 2, MIS bounds 0.5 and 2); `none` opts out; synchronous runs get exactly the
caps given."""

import math

import pytest

from rl.config import AUTO_CORRECTION, ConfigError, RolloutCaps, load_config, rollout_correction_caps


def _cfg(*overrides):
    return load_config("demo_cpu", ["run.name=t", *overrides])


def test_auto_is_the_default_and_applies_nothing_to_a_synchronous_run():
    cfg = _cfg()
    assert cfg.algorithm.rollout_correction.mode == "auto"
    assert cfg.rollout.max_staleness == 0
    assert rollout_correction_caps(cfg) == RolloutCaps(0.0, 0.0, 0.0)


def test_auto_applies_tis_and_mis_when_the_batch_lags():
    assert AUTO_CORRECTION == RolloutCaps(tis_cap=2.0, mis_low=0.5, mis_high=2.0)
    for k in (1, 2):
        assert rollout_correction_caps(_cfg(f"rollout.max_staleness={k}")) == RolloutCaps(2.0, 0.5, 2.0)


@pytest.mark.parametrize("staleness", [0, 1])
def test_caps_given_are_applied_as_given_at_any_staleness(staleness):
    k = f"rollout.max_staleness={staleness}"
    rc = "algorithm.rollout_correction"
    assert rollout_correction_caps(_cfg(k, f"{rc}.tis_cap=3")) == RolloutCaps(3.0, 0.0, 0.0)
    # MIS alone stays MIS alone: auto adds no TIS to a correction the config names.
    assert rollout_correction_caps(_cfg(k, f"{rc}.mis_high=2")) == RolloutCaps(0.0, 0.0, 2.0)
    both = _cfg(k, f"{rc}.tis_cap=2", f"{rc}.mis_low=0.5", f"{rc}.mis_high=2")
    assert rollout_correction_caps(both) == RolloutCaps(2.0, 0.5, 2.0)


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_none_applies_no_correction(staleness):
    cfg = _cfg(f"rollout.max_staleness={staleness}", "algorithm.rollout_correction.mode=none")
    assert rollout_correction_caps(cfg) == RolloutCaps(0.0, 0.0, 0.0)


def test_none_with_a_cap_is_an_error_naming_the_keys():
    with pytest.raises(ConfigError) as e:
        _cfg("algorithm.rollout_correction.mode=none", "algorithm.rollout_correction.tis_cap=2")
    assert str(e.value) == (
        "override 'algorithm.rollout_correction.mode=none': algorithm.rollout_correction.mode: none applies no "
        "correction, yet a cap asks for one: algorithm.rollout_correction.tis_cap=2 (set the caps to 0, or "
        "mode=auto)"
    )
    with pytest.raises(ConfigError, match=r"mis_low=0\.5, algorithm\.rollout_correction\.mis_high=3 \("):
        _cfg(
            "algorithm.rollout_correction.mode=none",
            "algorithm.rollout_correction.mis_low=0.5",
            "algorithm.rollout_correction.mis_high=3",
        )
    with pytest.raises(ConfigError, match=r"expected one of 'auto', 'none', got 'explicit'"):
        _cfg("algorithm.rollout_correction.mode=explicit")


def test_the_trainer_spec_of_an_asynchronous_demo_carries_the_correction():
    from rl.setup import trainer_spec

    algo = trainer_spec(_cfg("rollout.max_staleness=1"), "model").algo
    assert (algo.tis_cap, algo.mis_token_bounds, algo.mis_seq_bounds) == (2.0, (0.5, 2.0), None)
    assert algo.corrects_rollout
    off = trainer_spec(
        _cfg("rollout.max_staleness=1", "algorithm.rollout_correction.mode=none"), "model"
    ).algo
    assert (off.tis_cap, off.mis_token_bounds, off.corrects_rollout) == (None, None, False)
    mis = trainer_spec(_cfg("rollout.max_staleness=1", "algorithm.rollout_correction.mis_low=0.5"), "model")
    assert (mis.algo.tis_cap, mis.algo.mis_token_bounds) == (None, (0.5, math.inf))


def test_a_synchronous_trainer_spec_is_the_same_under_either_mode():
    from rl.setup import trainer_spec

    auto = trainer_spec(_cfg(), "model")
    assert auto.algo.tis_cap is None and not auto.algo.corrects_rollout
    assert trainer_spec(_cfg("algorithm.rollout_correction.mode=none"), "model") == auto


def test_the_run_says_which_correction_it_applies_before_it_starts():
    from rl.driver import staleness_notice

    assert staleness_notice(_cfg()) is None
    assert staleness_notice(_cfg("algorithm.rollout_correction.mode=none")) is None
    auto = staleness_notice(_cfg("rollout.max_staleness=1"))
    assert auto == (
        "rollout.max_staleness=1: algorithm.rollout_correction.mode=auto applies tis_cap=2, mis_low=0.5, "
        "mis_high=2: tokens an older adapter sampled are weighed by current / rollout probability (at most 2), "
        "those whose probability has since fallen below 0.5x or risen above 2x dropped (mode=none turns it off)"
    )
    off = staleness_notice(_cfg("rollout.max_staleness=2", "algorithm.rollout_correction.mode=none"))
    assert off.startswith("[yellow]rollout.max_staleness=2 with algorithm.rollout_correction.mode=none")
    assert staleness_notice(_cfg("rollout.max_staleness=1", "algorithm.rollout_correction.tis_cap=3")) is None
