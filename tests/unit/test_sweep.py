"""`sparkrl sweep`: expansion into points, run names, config diffs, --local runs and the final table."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from rl import sweep as S
from rl.config import ConfigError, parse_override

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "recipes" / "sweeps" / "demo_lr_clip.yaml"


def _write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_demo_sweep_expands_list_outermost_last_grid_key_fastest():
    sweep = S.load_sweep(DEMO)
    assert sweep.base == ROOT / "recipes" / "demo_cpu.yaml"
    assert len(sweep.points) == 8
    values = [
        (p.values["trainer.lr"], p.values["algorithm.clip_ratio_high"], p.values["lora.rank"])
        for p in sweep.points
    ]
    assert values == [
        (1e-4, 0.2, 8),
        (1e-4, 0.28, 8),
        (3e-4, 0.2, 8),
        (3e-4, 0.28, 8),
        (1e-4, 0.2, 16),
        (1e-4, 0.28, 16),
        (3e-4, 0.2, 16),
        (3e-4, 0.28, 16),
    ]
    first, last = sweep.points[0], sweep.points[-1]
    assert first.name == "demo_lr_clip/lr=1e-4,clip_ratio_high=0.2,rank=8,alpha=16"
    assert last.name == "demo_lr_clip/lr=3e-4,clip_ratio_high=0.28,rank=16,alpha=32"
    # base, then overrides, then the list entry, then the grid point; run.name last.
    assert last.overrides == [
        "trainer.total_steps=20",
        "eval.every=10",
        "trainer.mini_batch_size=16",
        "lora.rank=16",
        "lora.alpha=32",
        "trainer.lr=0.0003",
        "algorithm.clip_ratio_high=0.28",
        "run.name=demo_lr_clip/lr=3e-4,clip_ratio_high=0.28,rank=16,alpha=32",
    ]
    assert len({p.name for p in sweep.points}) == 8


def test_point_config_is_the_train_command_config():
    sweep = S.load_sweep(DEMO)
    cfg = S.point_config(sweep, sweep.points[5])
    got = (cfg.trainer.lr, cfg.algorithm.clip_ratio_high, cfg.lora.rank, cfg.lora.alpha)
    assert got == (1e-4, 0.28, 16, 32)
    assert (cfg.trainer.total_steps, cfg.eval.every) == (20, 10)
    assert cfg.run.name == "demo_lr_clip/lr=1e-4,clip_ratio_high=0.28,rank=16,alpha=32"


def test_grid_only_list_only_zipped_and_single(tmp_path):
    base = "base: demo_cpu\n"
    grid = S.load_sweep(
        _write(tmp_path, base + "name: g\ngrid: {trainer.lr: [1.0e-4, 2.0e-4], rollout.n: [4, 8, 16]}\n")
    )
    assert [(p.values["trainer.lr"], p.values["rollout.n"]) for p in grid.points] == [
        (1e-4, 4),
        (1e-4, 8),
        (1e-4, 16),
        (2e-4, 4),
        (2e-4, 8),
        (2e-4, 16),
    ]
    zipped = S.load_sweep(
        _write(tmp_path, base + "name: z\nlist: {lora.rank: [8, 16], lora.alpha: [16, 32]}\n")
    )
    assert [p.name for p in zipped.points] == ["z/rank=8,alpha=16", "z/rank=16,alpha=32"]
    entries = S.load_sweep(
        _write(tmp_path, base + "list: [{lora.rank: 8}, {trainer.lr: 1.0e-3}]\n", "e.yaml")
    )
    assert [p.name for p in entries.points] == ["e/rank=8", "e/lr=0.001"]  # name defaults to the file stem
    single = S.load_sweep(_write(tmp_path, base + "name: one\noverrides: {trainer.total_steps: 2}\n"))
    assert [(p.name, p.overrides) for p in single.points] == [
        ("one", ["trainer.total_steps=2", "run.name=one"])
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        ("base: demo_cpu\ngrid: {run.name: [a, b]}\n", "grid.run.name: may not be set in a sweep"),
        ("base: demo_cpu\noverrides: {run.dir: x}\n", "overrides.run.dir: may not be set in a sweep"),
        ("base: demo_cpu\ngird: {trainer.lr: [1]}\n", "unknown key 'gird' (did you mean 'grid'?)"),
        ("base: demo_cpu\ngrid: {trainer.lr: 1.0e-4}\n", "grid.trainer.lr: expected a non-empty list"),
        (
            "base: demo_cpu\nlist: {lora.rank: [8, 16], lora.alpha: [16]}\n",
            "list: zipped axes must have the same length, got lora.rank: 2, lora.alpha: 1",
        ),
        (
            "base: demo_cpu\ngrid: {lora.rank: [8]}\nlist: [{lora.rank: 16}]\n",
            "lora.rank: set by both grid and list",
        ),
        (
            "base: demo_cpu\noverrides: {trainer.lr: 1}\ngrid: {trainer.lr: [1, 2]}\n",
            "trainer.lr: set by overrides and by an axis",
        ),
        ("base: nowhere.yaml\n", "base: 'nowhere.yaml': no such recipe"),
        ("name: x\n", "base: required"),
        ("base: demo_cpu\nlist: [{}]\n", "list[0]: expected a non-empty mapping"),
    ],
)
def test_sweep_file_mistakes_name_the_file_and_key(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        S.load_sweep(path)
    assert str(e.value).startswith(f"{path}: ")
    assert message in str(e.value)


def test_bad_point_config_names_sweep_point_and_key(tmp_path):
    path = _write(tmp_path, "base: demo_cpu\nname: b\ngrid: {trainer.lr: [1.0e-4, -1]}\n")
    with pytest.raises(ConfigError) as e:
        S.load_sweep(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: run 1 (b/lr=-1): ")
    assert "trainer.lr: must be greater than 0, got -1" in msg
    typo = _write(tmp_path, "base: demo_cpu\ngrid: {trainer.lrr: [1]}\n", "t.yaml")
    with pytest.raises(ConfigError, match=r"unknown key 'trainer.lrr' \(did you mean 'trainer.lr'\?\)"):
        S.load_sweep(typo)


def test_values_in_names_and_as_overrides():
    assert [S.name_value(v) for v in (3e-4, 1e-4, 0.28, 20.0, 1e-5, 100000.0, 0.001, 7, True, None)] == [
        "3e-4",
        "1e-4",
        "0.28",
        "20",
        "1e-5",
        "1e5",
        "0.001",
        "7",
        "true",
        "null",
    ]
    assert S.name_value(["q_proj", "v_proj"]) == "q_proj+v_proj"
    assert S.name_value("org/data set?split=test") == "org_data_set_split=test"
    assert S.short_keys(["rollout.temperature", "eval.temperature", "trainer.lr"]) == {
        "rollout.temperature": "rollout.temperature",
        "eval.temperature": "eval.temperature",
        "trainer.lr": "lr",
    }
    for value in (3e-4, 0.28, 20, True, "", "3", "synthetic:arith", [1, 2], {"enable_thinking": False}, None):
        text = S.yaml_value(value)
        assert parse_override(f"k={text}") == ("k", value), text


def test_names_that_collide_once_sanitized_get_their_index(tmp_path):
    path = _write(tmp_path, "base: demo_cpu\nname: c\ngrid: {eval.data: ['a/b', 'a_b']}\n")
    sweep = S.load_sweep(path, check=False)
    assert [p.name for p in sweep.points] == ["c/data=a_b", "c/data=a_b-1"]


BASE_RECIPE = """
run: {name: base}
model: {make_tiny: {arch: qwen3_moe}}
trainer: {total_steps: 30, lr: 3.0e-4}
lora: {rank: 8, alpha: 16}
algorithm: {clip_ratio_high: 0.28}
data: {train: "synthetic:arith"}
eval: {every: 5}
"""


def test_dry_run_prints_points_and_diffs(tmp_path):
    (tmp_path / "base.yaml").write_text(BASE_RECIPE)
    path = _write(tmp_path, DEMO.read_text().replace("base: ../demo_cpu.yaml", "base: base.yaml"))
    text = S.dry_run_text(S.load_sweep(path))
    lines = text.splitlines()
    assert lines[0] == f"sweep {path}: 8 run(s) from {tmp_path / 'base.yaml'}"
    block = text.split("[3] ")[1].split("[4] ")[0].splitlines()
    assert block[0] == (
        "demo_lr_clip/lr=3e-4,clip_ratio_high=0.28,rank=8,alpha=16  "
        "(run dir runs/demo_lr_clip/lr=3e-4,clip_ratio_high=0.28,rank=8,alpha=16)"
    )
    # point 3 keeps the base's lr, clip and rank: only the shared overrides differ
    assert block[1:] == [
        "    trainer.total_steps: 30 -> 20",
        "    trainer.mini_batch_size: 0 -> 16",
        "    eval.every: 5 -> 10",
    ]
    block = text.split("[4] ")[1].split("[5] ")[0].splitlines()
    assert block[1:] == [
        "    trainer.total_steps: 30 -> 20",
        "    trainer.lr: 0.0003 -> 0.0001",
        "    trainer.mini_batch_size: 0 -> 16",
        "    lora.rank: 8 -> 16",
        "    lora.alpha: 16.0 -> 32.0",
        "    algorithm.clip_ratio_high: 0.28 -> 0.2",
        "    eval.every: 5 -> 10",
    ]


def _metrics(run: Path, records: list[dict]) -> None:
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_final_metrics_table(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    _metrics(
        a,
        [
            {"step": 1, "reward/mean": 0.1, "val-core/arith/acc/mean@8": 0.25},
            {"step": 2, "reward/mean": 0.5, "rollout_corr/k3_kl": 0.0001},
        ],
    )
    _metrics(b, [{"step": 1, "reward/mean": 0.3}])
    table = S.final_metrics_table([a, b, c], status={str(a): "ok", str(b): "ok", str(c): "FAILED (exit 1)"})
    rows = [line.split() for line in table.splitlines()]
    assert rows[0] == [
        "run",
        "step",
        "reward/mean",
        "rollout_corr/k3_kl",
        "val-core/arith/acc/mean@8",
        "status",
    ]
    assert rows[2] == [str(a), "2", "0.5", "0.0001", "0.25", "ok"]  # eval value from step 1 kept
    assert rows[3] == [str(b), "1", "0.3", "-", "-", "ok"]
    assert rows[4] == [str(c), "-", "-", "-", "-", "FAILED", "(exit", "1)"]


FAKE_PYTHON = """#!{python}
# Stands in for `python -m rl train BASE overrides...` (writes one metrics line per run; one point fails, with
# FAKE_PARTIAL after its first step) and for `python -m rl train RUN_DIR --resume trainer.total_steps=N`
# (appends step N). Each call is logged to calls.log.
import json, os, sys
assert sys.argv[1:4] == ["-m", "rl", "train"], sys.argv
with open("calls.log", "a") as log:
    log.write(" ".join(sys.argv[4:]) + "\\n")
if "--resume" in sys.argv:
    steps = int(sys.argv[6].split("=")[1])
    with open(os.path.join(sys.argv[4], "metrics.jsonl"), "a") as f:
        f.write(json.dumps({{"step": steps, "reward/mean": 0.5}}) + "\\n")
    sys.exit(0)
args = dict(a.split("=", 1) for a in sys.argv[5:])
run = os.path.join("runs", args["run.name"])
os.makedirs(run, exist_ok=True)
if args["trainer.lr"] == "0.0003" and args["algorithm.clip_ratio_high"] == "0.2":
    if os.environ.get("FAKE_PARTIAL"):
        with open(os.path.join(run, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({{"step": 1, "reward/mean": 0.1}}) + "\\n")
    sys.exit(3)
with open(os.path.join(run, "metrics.jsonl"), "w") as f:
    record = {{"step": int(args["trainer.total_steps"]), "reward/mean": float(args["trainer.lr"]) * 1000}}
    f.write(json.dumps(record) + "\\n")
"""


def _fake_sweep(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """(FAKE_PYTHON as an executable, a 2 x 2 grid sweep of 2-step demo runs named `name`)."""
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    sweep_file = _write(
        tmp_path,
        f"base: {ROOT / 'recipes' / 'demo_cpu.yaml'}\nname: {name}\n"
        "overrides: {trainer.total_steps: 2}\n"
        "grid: {trainer.lr: [1.0e-4, 3.0e-4], algorithm.clip_ratio_high: [0.2, 0.28]}\n",
    )
    return fake, sweep_file


def test_local_sweep_runs_each_point_and_prints_table(tmp_path, monkeypatch, capsys):
    fake, sweep_file = _fake_sweep(tmp_path, "loc")
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser(prog="sparkrl")
    S.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["sweep", str(sweep_file), "--local", "--python", str(fake)])
    assert args.func(args) == 1  # one run failed
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("runs/")}
    assert rows == {
        "runs/loc/lr=1e-4,clip_ratio_high=0.2": ["2", "0.1", "ok"],
        "runs/loc/lr=1e-4,clip_ratio_high=0.28": ["2", "0.1", "ok"],
        "runs/loc/lr=3e-4,clip_ratio_high=0.2": ["-", "-", "FAILED", "(exit", "3)"],
        "runs/loc/lr=3e-4,clip_ratio_high=0.28": ["2", "0.3", "ok"],
    }
    assert os.path.isfile(tmp_path / "runs" / "loc" / "lr=1e-4,clip_ratio_high=0.2" / "metrics.jsonl")
    # `sparkrl report` over the three finished runs, beside them
    report = (tmp_path / "runs" / "loc" / "report" / "report.md").read_text()
    assert f"sweep: report {tmp_path / 'runs' / 'loc' / 'report' / 'report.md'}" in out
    assert "| lr=3e-4,clip_ratio_high=0.28 | 2 | 0.3 |" in report
    assert "lr=3e-4,clip_ratio_high=0.2 |" not in report  # the failed run has no metrics


def test_a_sweep_run_again_skips_the_done_runs_and_resumes_the_started_one(tmp_path, monkeypatch, capsys):
    fake, sweep_file = _fake_sweep(tmp_path, "again")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FAKE_PARTIAL", "1")  # the failing point stops after its first step
    parser = argparse.ArgumentParser(prog="sparkrl")
    S.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["sweep", str(sweep_file), "--local", "--python", str(fake), "--no-report"])
    assert args.func(args) == 1
    (tmp_path / "calls.log").unlink()
    capsys.readouterr()
    assert args.func(args) == 0  # run again: the three done runs skipped, the started one resumed
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert calls == ["runs/again/lr=3e-4,clip_ratio_high=0.2 --resume trainer.total_steps=2"]
    out = capsys.readouterr().out
    assert out.count("done before") == 3 and "resumed from its newest checkpoint" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("runs/")}
    assert rows["runs/again/lr=3e-4,clip_ratio_high=0.2"] == ["2", "0.5", "ok"]
    assert rows["runs/again/lr=1e-4,clip_ratio_high=0.2"] == ["2", "0.1", "ok"]


def test_a_sweep_named_dot_dot_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="name: '..' is no directory name"):
        S.load_sweep(
            _write(
                tmp_path,
                f"base: {ROOT / 'recipes' / 'demo_cpu.yaml'}\nname: ..\ngrid: {{trainer.lr: [1.0e-4]}}\n",
            )
        )


def test_dry_run_command(capsys):
    parser = argparse.ArgumentParser(prog="sparkrl")
    S.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["sweep", str(DEMO), "--dry-run"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert out.count("\n[") == 8 and out.startswith(f"sweep {DEMO}: 8 run(s)")
