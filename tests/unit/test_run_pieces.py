"""The driver's small parts: prompt order and its resume, the KL budget, checkpoint atomicity, metrics.jsonl."""

from __future__ import annotations

import json

import pytest
import torch

from rl.checkpoint import checkpoint_dirs, latest_checkpoint, load_driver_state, save_checkpoint
from rl.data.loader import Prompt, PromptLoader
from rl.metrics import MetricsLogger, read_metrics
from rl.monitor import KLMonitor


def _prompts(n):
    return [Prompt([1, 2, i], "src", str(i), i) for i in range(n)]


def test_loader_covers_each_prompt_once_per_epoch_and_reshuffles():
    loader = PromptLoader(_prompts(10), batch_size=5, seed=1)
    epoch0 = [p.index for p in loader.next_batch() + loader.next_batch()]
    epoch1 = [p.index for p in loader.next_batch() + loader.next_batch()]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1 and epoch0 != list(range(10))


def test_loader_resumes_to_the_same_order():
    a = PromptLoader(_prompts(7), batch_size=3, seed=5)
    for _ in range(3):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    b = PromptLoader(_prompts(7), batch_size=3, seed=5)
    b.load_state_dict(state)
    assert [p.index for p in a.next_batch()] == [p.index for p in b.next_batch()]
    with pytest.raises(ValueError, match="data or data.seed changed"):
        PromptLoader(_prompts(8), batch_size=3, seed=5).load_state_dict(state)


def test_loader_rejects_a_batch_larger_than_the_data():
    with pytest.raises(ValueError, match="data.train_batch_size: 8 is more than the 4 prompts"):
        PromptLoader(_prompts(4), batch_size=8)


def test_kl_monitor_flags_the_budget_and_the_trend():
    m = KLMonitor(k3_kl_max=1e-3, trend_max=3.0, window=2)
    assert m.check(1e-4) is None and m.check(1e-4) is None
    assert "monitor.k3_kl_max" in m.check(2e-3)
    assert "trend" in m.check(9e-4)  # last two (2e-3, 9e-4) average 14.5x the first two
    assert m.violations == 2
    assert "k3_kl_max" in KLMonitor(k3_kl_max=1.0).check(float("nan"))


def _batch(gap_at: tuple[int, int], gap: float):
    """Four samples whose trainer log-probs equal the rollout's but for one token (sample, position)."""
    import numpy as np

    from rl.core.batch import Sample

    rng = np.random.default_rng(0)
    samples, trainer = [], []
    for i, n in enumerate((5, 9, 3, 7)):
        lp = -rng.random(n).astype(np.float32)
        samples.append(Sample([1, 2], list(range(10, 10 + n)), lp, "stop", 4, i // 2))
        t = lp.copy() + np.float32(1e-4)  # a small gap everywhere
        if i == gap_at[0]:
            t[gap_at[1]] += np.float32(gap)
        trainer.append(t)
    return samples, trainer


def test_a_kl_violation_saves_where_trainer_and_rollout_part(tmp_path):
    import numpy as np

    from rl.driver import mismatch_metrics
    from rl.monitor import save_violation

    samples, trainer = _batch((1, 6), 0.35)
    metrics = mismatch_metrics(trainer, samples)
    path = save_violation(tmp_path, 10, samples, trainer, metrics)
    assert path == tmp_path / "kl_violations" / "step_000010.json"
    summary = json.loads(path.read_text())
    top = summary["largest_gaps"][0]
    assert (top["sample"], top["position"], top["response_len"], top["token_id"]) == (1, 6, 9, 16)
    assert top["gap"] == pytest.approx(0.35 + 1e-4, rel=1e-3) and top["group"] == 0
    worst = summary["largest_sample_k3"][0]
    assert worst["sample"] == 1 and worst["share_of_step_k3"] > 0.99
    # one token of 24 carries the step's k3; every other token is 1e-4 apart
    spread = summary["concentration"]
    assert spread["top_1pct_tokens_share"] > 0.99 and spread["top_10_tokens_share"] > 0.99
    assert spread["abs_gap_median"] == pytest.approx(1e-4, rel=1e-2)
    assert summary["metrics"]["rollout_corr/k3_kl"] == metrics["rollout_corr/k3_kl"]
    # the per-token arrays, flat with offsets, load without pickle; their k3 is the step's
    arrays = np.load(tmp_path / "kl_violations" / summary["arrays"], allow_pickle=False)
    assert list(arrays["offsets"]) == [0, 5, 14, 17, 24]
    d = arrays["trainer_logp"].astype(np.float64) - arrays["rollout_logp"]
    assert float(np.mean(np.expm1(d) - d)) == pytest.approx(metrics["rollout_corr/k3_kl"], rel=1e-3)
    assert not list((tmp_path / "kl_violations").glob(".*"))  # no temporary file left


def test_concentration_tells_a_few_tokens_from_a_spread_gap():
    from rl.monitor import concentration

    mask = torch.ones(4, 250, dtype=torch.bool)
    mask[:, 200:] = False  # padding: never counted, whatever it holds
    even = torch.full((4, 250), 0.01)
    even[:, 200:] = 5.0
    spread = concentration(even, mask)  # 800 equal gaps: 10 tokens hold 10/800, the top 1 % (8) 8/800
    assert spread["top_10_tokens_share"] == pytest.approx(10 / 800)
    assert spread["top_1pct_tokens_share"] == pytest.approx(8 / 800)
    assert spread["abs_gap_median"] == pytest.approx(0.01)
    few = even.clone()
    few[0, :3] = -1.0  # three tokens far apart
    assert concentration(few, mask)["top_1pct_tokens_share"] > 0.9
    assert concentration(even, torch.zeros_like(mask))["top_10_tokens_share"] == 0.0


def test_the_driver_saves_the_first_violations_only(tmp_path):
    """Run._check_kl on a stand-in for the run (its monitor, config, directory and log: a whole Run needs
    engines): the first `monitor.save_violations` steps over the budget leave their evidence."""
    from types import SimpleNamespace

    from rl.driver import Run

    events = []
    run = SimpleNamespace(
        monitor=KLMonitor(k3_kl_max=1e-5),
        cfg=SimpleNamespace(monitor=SimpleNamespace(save_violations=2, stop_on_violation=False)),
        dir=tmp_path,
        log=SimpleNamespace(event=events.append),
    )
    calm, _ = _batch((0, 0), 0.0)
    for step in range(1, 5):
        samples, trainer = _batch((2, 1), 0.5)
        Run._check_kl(run, step, trainer, samples)
    Run._check_kl(run, 5, [s.response_logprobs for s in calm], calm)  # within budget: nothing saved
    saved = sorted(p.name for p in (tmp_path / "kl_violations").glob("*.json"))
    assert saved == ["step_000001.json", "step_000002.json"] and run.monitor.violations == 4
    assert sum("where trainer and rollout part" in e for e in events) == 2


def test_checkpoint_is_atomic_and_pruned(tmp_path):
    def trainer_part(d):
        d.mkdir()
        (d / "adapter.bin").write_bytes(b"x")

    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"step": step}, trainer_part, keep=2)
    assert [s for s, _ in checkpoint_dirs(tmp_path)] == [2, 3]
    assert load_driver_state(latest_checkpoint(tmp_path)) == {"step": 3}

    def crash(d):
        raise OSError("disk full")

    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 4, {"step": 4}, crash, keep=2)
    # the half-written step 4 is never taken for a checkpoint, and nothing older was lost
    assert [s for s, _ in checkpoint_dirs(tmp_path)] == [2, 3]


def test_metrics_jsonl_drops_steps_after_the_resume_point(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=4, tensorboard=False)
    for step in (1, 2, 3):
        log.log(step, {"reward/mean": step / 10, "actor/grad_norm": float("nan")})
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert read_metrics(tmp_path)[0]["actor/grad_norm"] == "nan"
    log = MetricsLogger(tmp_path, total_steps=4, start_step=2, tensorboard=False)
    log.log(3, {"reward/mean": 0.9})
    log.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["reward/mean"] == 0.9


def test_a_record_cut_short_by_a_crash_does_not_stop_the_resume_or_the_report(tmp_path):
    """The driver died inside a metrics write: the torn last line is no record; the resume rewrites the
    file without it, and a line broken anywhere else is an error naming the file and the line."""
    log = MetricsLogger(tmp_path, total_steps=4, tensorboard=False)
    for step in (1, 2):
        log.log(step, {"reward/mean": step / 10})
    log.close()
    path = tmp_path / "metrics.jsonl"
    with open(path, "a") as fh:
        fh.write('{"step": 3, "reward/me')
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    log = MetricsLogger(tmp_path, total_steps=4, start_step=2, tensorboard=False)
    log.log(3, {"reward/mean": 0.3})
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert path.read_text().endswith("\n") and '"reward/me\n' not in path.read_text()

    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], lines[1][:-5], lines[2]]) + "\n")
    with pytest.raises(ValueError, match=rf"{path}, line 2: not a JSON record"):
        read_metrics(tmp_path)


def test_a_relative_model_directory_reaches_the_workers_absolute(tmp_path, monkeypatch):
    """Workers on other nodes run in their raylet's working directory: a local model.path goes to them
    absolute, a hub id as written."""
    from rl.config import load_config
    from rl.setup import resolve_model_paths

    (tmp_path / "models" / "base").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        "demo_cpu", ["model.make_tiny.arch=", "model.path=models/base", "model.rollout_path=org/hub-id"]
    )
    assert resolve_model_paths(cfg) == (str(tmp_path / "models" / "base"), "org/hub-id")
