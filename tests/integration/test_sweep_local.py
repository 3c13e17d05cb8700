"""`sparkrl sweep --local`: a 2-point grid of the CPU demo, each point trained for real, one after the other,
in subprocesses of `python -m rl train` (each its own Ray instance, engine and 2 trainer ranks), then the
table of final metrics and the side-by-side report. The runs are named `<sweep>/<point>`, a slash inside
the name, as users' sweeps name them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_local_sweep_trains_every_point_and_reports_them_side_by_side(tmp_path, one_step_sweep):
    sweep_file = one_step_sweep(tmp_path / "tinysweep.yaml", "tinysweep")
    proc = subprocess.run(
        [sys.executable, "-m", "rl", "sweep", str(sweep_file), "--local"],
        cwd=tmp_path,  # runs/ under the user's working directory, not the checkout
        capture_output=True,
        text=True,
        timeout=1200,
        env={**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    runs = [tmp_path / "runs" / "tinysweep" / p for p in ("lr=0.001", "lr=0.004")]
    table = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if "tinysweep/lr=" in line}
    assert all(table[str(r.relative_to(tmp_path))][-1] == "ok" for r in runs), proc.stdout[-3000:]
    for run in runs:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1] and records[0]["rollout_corr/k3_kl"] < 1e-3
        assert (run / "checkpoints" / "step_1" / "manifest.json").is_file()
    report = (tmp_path / "runs" / "tinysweep" / "report" / "report.md").read_text()
    assert "tinysweep/lr=0.001" in report and "tinysweep/lr=0.004" in report
