"""sparkrl report: the KL verdict, the final-metrics table and the plots, on run directories written here."""

from __future__ import annotations

import json

import pytest
import yaml

from rl.cli import main
from rl.report import kl_verdict, load_run, write_report


def _run(tmp_path, name, kls, budget=1e-3, r3=True):
    d = tmp_path / name
    d.mkdir()
    (d / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "run": {"name": name},
                "r3": {"enabled": r3},
                "monitor": {"k3_kl_max": budget, "k3_kl_trend_max": 0},
            }
        )
    )
    recs = [{"step": 0, "val-core/synthetic/arith/acc/mean@8": 0.4}]
    for i, kl in enumerate(kls, start=1):
        recs.append(
            {
                "step": i,
                "reward/mean": 0.1 * i,
                "acc/mean": 0.5,
                "rollout_corr/k3_kl": kl,
                "response_length/mean": 14.0,
                "perf/step_s": 2.0,
                "perf/rollout_s": 1.0,
                "perf/train_s": 0.8,
                "perf/sync_s": 0.2,
            }
        )
    recs[-1]["val-core/synthetic/arith/acc/mean@8"] = 0.7
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def test_verdict_inside_and_outside_the_budget(tmp_path):
    ok, text = kl_verdict(load_run(_run(tmp_path, "good", [1e-4, 2e-4, 1.5e-4])))
    assert ok and "INSIDE" in text and "max 2.00e-04 (step 2)" in text
    ok, text = kl_verdict(load_run(_run(tmp_path, "bad", [1e-4, 5e-3, 2e-3])))
    assert not ok and "OUTSIDE" in text and "exceeded at steps [2, 3]" in text


def test_report_for_two_runs_side_by_side(tmp_path):
    a = _run(tmp_path, "r3_on", [1e-4, 1e-4])
    b = _run(tmp_path, "r3_off", [4e-3, 6e-3])
    path = write_report([a, b], tmp_path / "cmp")
    text = path.read_text()
    first = text.splitlines()[2:4]
    assert first[0].startswith("- OK: r3_on") and first[1].startswith("- FAIL: r3_off")
    assert "| r3_on | 2 |" in text and "0.7" in text
    pngs = sorted(p.name for p in (tmp_path / "cmp").glob("*.png"))
    assert pngs == [
        "accuracy.png",
        "eval.png",
        "k3_kl.png",
        "response_length.png",
        "reward.png",
        "step_time.png",
    ]
    assert all((tmp_path / "cmp" / p).stat().st_size > 5000 for p in pngs)


def test_report_cli_names_a_directory_that_is_not_a_run(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err


def test_report_requires_a_run():
    with pytest.raises(ValueError, match="at least one run directory"):
        write_report([])
