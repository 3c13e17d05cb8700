"""What every benchmark command shares: its command line, the product's components, the environment
record, and the results written as JSON and as a markdown table.

A command is `python -m bench.NAME RECIPE [key=value ...] [--out DIR] [its own flags]`: the recipe and
overrides are those of `sparkrl train` (rl.config), so what is measured is what a run with that config
runs; engine options with no key of their own go through `rollout.engine_args`. It writes
`DIR/NAME.json` ({"bench", "env", "config", "rows"}) and `DIR/NAME.md` (the rows as a table, the command
and the environment under it).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Bench:
    """One benchmark command: its flags, what it needs started, and the measurement itself."""

    name: str
    doc: str
    columns: tuple[str, ...]  # the markdown table's columns, keys of the rows
    measure: Callable[[Any, argparse.Namespace], Iterable[dict]]  # (Setup, args) -> rows, or yields them
    add_args: Callable[[argparse.ArgumentParser], None] = lambda p: None
    rollout: bool = True
    trainer: Callable[[Any], bool] = lambda cfg: True  # from the config: whether the trainer is started


@dataclass
class Setup:
    """The config and the product's workers a benchmark measures (rl.setup builds them as a run does)."""

    cfg: Any  # rl.config.SparkConfig
    tokenizer: Any
    model_path: str
    rollout_path: str
    rollout: Any = None  # rollout.pool.RolloutPool
    trainer: Any = None  # trainer.group.TrainerGroup
    owns_ray: bool = False
    place: Any = None  # rl.placement's placement: where a command may start another trainer group

    def close(self) -> None:
        import ray

        for part in (self.rollout, self.trainer):
            if part is not None:
                part.shutdown()
        if self.owns_ray:
            ray.shutdown()


def start(cfg, rollout: bool = True, trainer: bool = True) -> Setup:
    """Ray, the placement, and the rollout pool and/or trainer group of `cfg`, as rl.setup makes them."""
    from transformers import AutoTokenizer

    from rl.placement import create_placement
    from rl.setup import build_rollout, build_trainer, init_ray, resolve_model_paths, trainer_spec

    model_path, rollout_path = resolve_model_paths(cfg)
    s = Setup(cfg, AutoTokenizer.from_pretrained(model_path), model_path, rollout_path)
    if not (rollout or trainer):  # the command starts what it needs itself (bench.grpo: rl.driver.Run)
        return s
    s.owns_ray = init_ray(cfg)
    place = s.place = create_placement(cfg)
    try:
        if rollout:
            s.rollout = build_rollout(cfg, place, rollout_path)
        if trainer:
            s.trainer = build_trainer(cfg, place, trainer_spec(cfg, model_path))
    except BaseException:
        s.close()
        raise
    return s


def sync_adapter(s: Setup, version: int) -> dict:
    """The driver's step 6 (rl.driver.Run._export_weights, then _load_weights): the trainer's policy into the rollout engines."""
    if s.cfg.sync.mode == "adapter":
        tensors, peft_config = s.trainer.export_adapter_ref(dtype=s.cfg.model.dtype)
        return s.rollout.load_adapter(tensors, peft_config, version)
    return s.rollout.load_merged_weights(s.trainer.export_merged_ref(), version)


def parser(bench: Bench) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m bench.{bench.name}", description=bench.doc)
    p.add_argument("recipe", help="a recipe (path or name under recipes/), as for `sparkrl train`")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out", help="results folder")
    bench.add_args(p)
    return p


def run(bench: Bench, argv: list[str] | None = None, setup: Setup | None = None) -> dict:
    """Parse, start (unless `setup` is given: tests share one), measure, write; returns the JSON document.

    A measure that yields its rows has each written as it comes (the document's `complete` false until the
    last): a GPU call cut by its time limit, or an engine that dies in a later row, keeps the rows before."""
    from rl.config import load_config

    args = parser(bench).parse_args(argv)
    own = setup is None
    if setup is None:
        cfg = load_config(args.recipe, args.overrides)
        setup = start(cfg, bench.rollout, bench.trainer(cfg))
    s = setup
    doc = {
        "bench": bench.name,
        "env": env_info(bench.name, argv if argv is not None else sys.argv[1:]),
        "config": {"recipe": args.recipe, "overrides": args.overrides, "model": s.model_path},
        "args": {k: v for k, v in vars(args).items() if k not in ("recipe", "overrides", "out")},
        "complete": False,
        "rows": [],
    }
    out = Path(args.out)
    try:
        for row in bench.measure(s, args):
            doc["rows"].append(row)
            _write(doc, bench, out)
    finally:
        if own:
            s.close()
    doc["complete"] = True
    _write(doc, bench, out)
    print(markdown(doc, bench.columns))
    return doc


def _write(doc: dict, bench: Bench, out: Path) -> None:
    write_atomic(out / f"{bench.name}.json", json.dumps(doc, indent=1, default=str) + "\n")
    write_atomic(out / f"{bench.name}.md", markdown(doc, bench.columns))


def main(bench: Bench) -> int:
    run(bench)
    return 0


# ----------------------------------------------------------------------------------------------------
# Output


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file and rename: a killed run leaves the previous complete file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        if v != v:
            return "nan"
        return f"{v:.3g}" if abs(v) < 1e-2 and v != 0 else f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def markdown(doc: dict, columns: tuple[str, ...]) -> str:
    e = doc["env"]
    versions = ", ".join(f"{k} {v}" for k, v in e["versions"].items() if v)
    hardware = e["gpu"] or f"CPU ({e['cpus']} cores)"
    lines = [
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in doc["rows"]),
        "",
        f"{e['date_utc']}, {hardware}; {versions}; commit {e['git_commit']}.",
        f"`{e['command']}`",
        "",
    ]
    if not doc.get("complete", True):
        lines.insert(-1, "Incomplete: the command stopped after these rows.")
    return "\n".join(lines)


def _version(module: str) -> str | None:
    try:
        return getattr(__import__(module), "__version__", "?")
    except Exception:  # noqa: BLE001 - absent or broken: record that, do not fail the run
        return None


def _stdout(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def env_info(name: str, argv: list[str]) -> dict:
    """Date, hardware, versions, commit and the exact command: what a figure needs beside it."""
    return {
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "-m", f"bench.{name}", *argv]),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "gpu": _stdout(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        ),
        "versions": {m: _version(m) for m in ("torch", "vllm", "transformers", "peft", "ray", "verl")},
        "git_commit": _stdout(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"]),
    }


def median(values: list[float]) -> float:
    import numpy as np

    return float(np.median(values))
