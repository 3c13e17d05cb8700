"""`sparkrl sweep SWEEP.yaml`: one base recipe and axes over dotted keys give one run per point.

    sweep = load_sweep("recipes/sweeps/demo_lr_clip.yaml")
    for point in sweep.points:           # Point(name, values, overrides)
        print(point.name, point.overrides)

The file format is documented in the header of `recipes/sweeps/demo_lr_clip.yaml`. A grid is the
cartesian product of its axes (the last key varying fastest); a list gives its entries one by one: either
a list of mappings, or a mapping of equally long value lists that are zipped. With both, every list entry
is combined with every grid point, list entries outermost. Each point is exactly
`sparkrl train BASE <overrides> <list entry> <grid point> run.name=<name>/<point>`, and every point's config
is loaded (and so checked) before any run starts.

The run name encodes the point: `<name>/lr=3e-4,clip_ratio_high=0.28` (the last component of each key,
longer where two keys would look alike; values made filesystem-safe). Runs then sit together under
`runs/<name>/`. Runs go through `sparkrl submit` (a Ray cluster) or, with --local, one after another in
subprocesses of `python -m rl train`; at the end a table gives each run's final metrics.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import itertools
import math
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rl.config import ConfigError, find_recipe, is_section, load_config, run_dir, schema_fields
from rl.metrics import read_metrics

SWEEP_KEYS = ("base", "name", "overrides", "grid", "list")
# The sweep names its runs and places them; a fixed run.name or run.dir would make every run the same run.
RESERVED_KEYS = ("run.name", "run.dir")
# Final-metrics columns, in this order, when a run logged them (val-core/* columns follow).
TABLE_KEYS = ("reward/mean", "acc/mean", "response_length/mean", "rollout_corr/k3_kl", "actor/entropy")
_UNSAFE = re.compile(r"[^A-Za-z0-9._+=-]")
_MAX_COMPONENT = 200  # file-name limit is 255 bytes; leave room for suffixes such as .tmp files


@dataclass
class Point:
    """One run of a sweep. `values`: the axis values of this point (key -> value), in name order;
    `overrides`: every `key=value` given to `train` after the base recipe (run.name last)."""

    index: int
    name: str
    values: dict[str, Any]
    overrides: list[str]


@dataclass
class Sweep:
    path: Path
    base: Path
    name: str
    overrides: dict[str, Any]
    points: list[Point]


# ----------------------------------------------------------------------------------------------------
# Formatting values: as override text (read back as YAML) and as part of a run name
# ----------------------------------------------------------------------------------------------------


def yaml_value(value: Any) -> str:
    """A value as override text that `rl.config.parse_override` reads back to the same value."""
    if value == "":
        return "''"
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf).strip()
    return text.removesuffix("...").strip()  # safe_dump ends a lone scalar with a document-end marker


def _short_float(v: float) -> str:
    """0.0003 -> '3e-4', 0.28 -> '0.28', 20.0 -> '20': the shorter of plain and exponent forms."""
    if not math.isfinite(v):
        return str(v)
    plain = re.sub(r"e([+-])0*(\d)", lambda m: "e" + m.group(1).replace("+", "") + m.group(2), f"{v:g}")
    mantissa, _, exp = f"{v:.6e}".partition("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    expo = f"{mantissa}e{int(exp)}"
    # Exponent form only when clearly shorter: '2e1' for 20 would be harder to read than it saves.
    return expo if len(expo) + 2 <= len(plain) else plain


def name_value(value: Any) -> str:
    """A value as it appears in a run name (filesystem-safe)."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = _short_float(value)
    elif isinstance(value, list | tuple):
        text = "+".join(name_value(v) for v in value) or "none"
    elif isinstance(value, dict):
        text = "+".join(f"{k}-{name_value(v)}" for k, v in value.items()) or "none"
    elif value is None:
        text = "null"
    else:
        text = str(value)
    return _UNSAFE.sub("_", text) or "empty"


def short_keys(keys: list[str]) -> dict[str, str]:
    """Each dotted key's shortest distinct suffix: trainer.lr -> lr; rollout.temperature and
    eval.temperature stay whole because their last components are equal."""
    out = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            suffix = ".".join(parts[-n:])
            if not any(o != key and (o == suffix or o.endswith("." + suffix)) for o in keys):
                break
        out[key] = suffix
    return out


def _cap(component: str) -> str:
    if len(component) <= _MAX_COMPONENT:
        return component
    digest = hashlib.sha1(component.encode()).hexdigest()[:8]
    return component[: _MAX_COMPONENT - 9] + "-" + digest


def point_name(sweep_name: str, values: dict[str, Any], short: dict[str, str]) -> str:
    if not values:
        return sweep_name
    text = ",".join(f"{short[k]}={name_value(v)}" for k, v in values.items())
    return f"{sweep_name}/{_cap(text)}"


# ----------------------------------------------------------------------------------------------------
# Reading and expanding a sweep file
# ----------------------------------------------------------------------------------------------------


def _problem(where: str, msg: str) -> ConfigError:
    return ConfigError([f"{where}: {msg}"])


def _check_mapping(value: Any, where: str, section: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _problem(where, f"{section}: expected a mapping of dotted keys, got {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise _problem(where, f"{section}: key {key!r} is not a dotted key string")
        if key in RESERVED_KEYS:
            raise _problem(
                where, f"{section}.{key}: may not be set in a sweep (the sweep names and places its runs)"
            )
    return value


def _list_entries(value: Any, where: str) -> list[dict[str, Any]]:
    """`list:` as entries: a list of mappings, or a mapping of equally long lists (zipped)."""
    if value is None:
        return []
    if isinstance(value, dict):
        axes = _check_mapping(value, where, "list")
        lengths = {k: len(v) if isinstance(v, list) else None for k, v in axes.items()}
        bad = [k for k, n in lengths.items() if not n]
        if bad:
            raise _problem(where, f"list.{bad[0]}: expected a non-empty list of values")
        if len(set(lengths.values())) > 1:
            shown = ", ".join(f"{k}: {n}" for k, n in lengths.items())
            raise _problem(where, f"list: zipped axes must have the same length, got {shown}")
        return [dict(zip(axes, combo)) for combo in zip(*axes.values())]
    if not isinstance(value, list) or not value:
        raise _problem(
            where,
            "list: expected a non-empty list of {dotted.key: value} mappings "
            "(or a mapping of equally long value lists)",
        )
    entries = []
    for i, entry in enumerate(value):
        if not isinstance(entry, dict) or not entry:
            raise _problem(where, f"list[{i}]: expected a non-empty mapping of dotted keys to values")
        entries.append(_check_mapping(entry, where, f"list[{i}]"))
    return entries


def _resolve_base(base: Any, sweep_path: Path) -> Path:
    """`base:` relative to the sweep file, else as `find_recipe` reads it (a shipped recipe's name)."""
    where = str(sweep_path)
    if not isinstance(base, str) or not base.strip():
        raise _problem(
            where,
            "base: required: the recipe every run starts from (a path relative to this "
            "file, or a shipped recipe's name)",
        )
    beside = Path(os.path.normpath(sweep_path.parent / base))
    if beside.is_file():
        return beside
    try:
        return find_recipe(base)
    except ConfigError:
        raise _problem(
            where,
            f"base: {base!r}: no such recipe (looked beside the sweep file, at {beside}, "
            "and among the shipped recipes)",
        ) from None


def read_sweep_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"{path}: no such sweep file"])
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        pos = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise ConfigError([f"{path}{pos}: YAML syntax error: {getattr(e, 'problem', None) or e}"]) from None
    if not isinstance(tree, dict):
        raise _problem(str(path), "expected a mapping with base, name, overrides, grid and list")
    unknown = [k for k in tree if k not in SWEEP_KEYS]
    if unknown:
        near = difflib.get_close_matches(str(unknown[0]), SWEEP_KEYS, n=1)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        raise _problem(str(path), f"unknown key '{unknown[0]}'{hint}; a sweep has {', '.join(SWEEP_KEYS)}")
    return tree


def expand(tree: dict[str, Any], where: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The points of a parsed sweep as (list entry, grid point) pairs, in run order."""
    grid = _check_mapping(tree.get("grid"), where, "grid")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise _problem(where, f"grid.{key}: expected a non-empty list of values, got {values!r}")
    entries = _list_entries(tree.get("list"), where)
    overrides = _check_mapping(tree.get("overrides"), where, "overrides")
    list_keys = {k for e in entries for k in e}
    for key in grid:
        if key in list_keys:
            raise _problem(where, f"{key}: set by both grid and list; give it in one of them")
    for key in overrides:
        if key in grid or key in list_keys:
            raise _problem(where, f"{key}: set by overrides and by an axis; drop it from overrides")
    grid_points = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]
    return [(entry, gp) for entry in (entries or [{}]) for gp in grid_points]


def load_sweep(path: str | Path, check: bool = True) -> Sweep:
    """Read, expand and (check=True) load every point's config, so that a mistake stops the sweep
    before any run starts. Raises ConfigError naming the sweep file and the point."""
    path = Path(path)
    tree = read_sweep_file(path)
    where = str(path)
    base = _resolve_base(tree.get("base"), path)
    name = tree.get("name", path.stem)
    if not isinstance(name, str) or not name.strip():
        raise _problem(where, f"name: expected a non-empty string, got {name!r}")
    name = _UNSAFE.sub("_", name.strip())
    if set(name) <= {"."}:  # '.' or '..' would put the runs' directories beside or above runs/
        raise _problem(where, f"name: {name!r} is no directory name; name the sweep")
    overrides = _check_mapping(tree.get("overrides"), where, "overrides")
    pairs = expand(tree, where)

    # Name order: grid keys, then list keys as they first appear (entries may differ in their keys).
    keys = list(pairs[0][1])
    for entry, _ in pairs:
        keys += [k for k in entry if k not in keys]
    short = short_keys(keys)

    points, seen = [], {}
    for i, (entry, gp) in enumerate(pairs):
        merged = {**gp, **entry}
        values = {k: merged[k] for k in keys if k in merged}
        run_name = point_name(name, values, short)
        if run_name in seen:  # two values that look alike once made filesystem-safe
            run_name = f"{run_name}-{i}"
        seen[run_name] = i
        ovr = [f"{k}={yaml_value(v)}" for k, v in overrides.items()]
        ovr += [f"{k}={yaml_value(v)}" for k, v in entry.items()]
        ovr += [f"{k}={yaml_value(v)}" for k, v in gp.items()]
        ovr.append(f"run.name={yaml_value(run_name)}")
        points.append(Point(i, run_name, values, ovr))

    sweep = Sweep(path, base, name, overrides, points)
    if check:
        for p in points:
            point_config(sweep, p)
    return sweep


def point_config(sweep: Sweep, point: Point):
    try:
        return load_config(sweep.base, point.overrides)
    except ConfigError as e:
        where = f"{sweep.path}: run {point.index} ({point.name})"
        raise ConfigError([f"{where}: {p}" for p in e.problems]) from None


# ----------------------------------------------------------------------------------------------------
# Config diffs (--dry-run) and the final-metrics table
# ----------------------------------------------------------------------------------------------------


def flat_config(cfg) -> dict[str, Any]:
    """{'trainer.lr': 3e-4, ...} for every leaf key of a loaded config."""
    out = {}
    for path, _, tp in schema_fields():
        if is_section(tp):
            continue
        value = cfg
        for part in path.split("."):
            value = getattr(value, part)
        out[path] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return out


def config_diff(base_cfg, cfg, ignore: tuple[str, ...] = RESERVED_KEYS) -> list[tuple[str, Any, Any]]:
    """(key, base value, this value) for every leaf that differs, in schema order."""
    a, b = flat_config(base_cfg), flat_config(cfg)
    return [(k, a[k], b[k]) for k in a if k not in ignore and a[k] != b[k]]


def dry_run_text(sweep: Sweep) -> str:
    # The base may leave run.name to the sweep: name it so that it loads, and leave run.* out of the diff.
    base_cfg = load_config(sweep.base, [f"run.name={yaml_value(sweep.name)}"])
    lines = [f"sweep {sweep.path}: {len(sweep.points)} run(s) from {sweep.base}"]
    for p in sweep.points:
        cfg = point_config(sweep, p)
        lines.append(f"[{p.index}] {p.name}  (run dir {run_dir(cfg)})")
        diff = config_diff(base_cfg, cfg)
        lines += [f"    {k}: {yaml_value(old)} -> {yaml_value(new)}" for k, old, new in diff]
        if not diff:
            lines.append("    (same as the base recipe)")
    return "\n".join(lines)


def final_metrics(run_dir_: str | Path) -> dict[str, Any]:
    """Each metric's last logged value (eval metrics appear only on eval steps), plus the last `step`."""
    out: dict[str, Any] = {}
    for record in read_metrics(run_dir_):
        out.update(record)
    return out


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def final_metrics_table(
    run_dirs: list[str | Path], keys: list[str] | None = None, status: dict[str, str] | None = None
) -> str:
    """A plain-text table: one row per run (its directory, last step, final metrics). Columns are `keys`,
    else TABLE_KEYS and every `val-core/*` metric any run logged. `status`: run dir -> a note (e.g.
    FAILED)."""
    finals = {str(d): final_metrics(d) for d in run_dirs}
    if keys is None:
        present = {k for f in finals.values() for k in f}
        evals = sorted(k for k in present if k.startswith("val-core/"))
        keys = [k for k in TABLE_KEYS if k in present] + evals
    header = ["run", "step", *keys] + (["status"] if status else [])
    rows = []
    for d, f in finals.items():
        row = [d, _cell(f.get("step")), *(_cell(f.get(k)) for k in keys)]
        if status:
            row.append(status.get(d, ""))
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row: list[str]) -> str:  # run names left-aligned, numbers right-aligned
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)])


# ----------------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------------


# `sparkrl train`'s exit codes for a run a signal stopped after its checkpoint (rl.cli.stop_exit_code).
STOPPED_EXIT = {128 + int(s): s.name for s in (signal.SIGINT, signal.SIGTERM)}


def point_state(rdir: Path, total_steps: int) -> str:
    """Where a point's run stands on disk: 'new' (nothing of it there), 'done' (its record reaches
    total_steps) or 'started' (steps or checkpoints, not all steps): a sweep run again skips the done runs
    and resumes the started ones, so nothing finished is redone and nothing written is lost."""
    if not (rdir / "metrics.jsonl").exists() and not (rdir / "checkpoints").exists():
        return "new"
    records = read_metrics(rdir)
    return "done" if records and records[-1].get("step", 0) >= total_steps else "started"


def _announce(sweep: Sweep, p: Point, state: str, rdir: Path) -> None:
    head = f"sweep: [{p.index + 1}/{len(sweep.points)}] {p.name}"
    note = {
        "done": f": done before ({rdir}), not run again",
        "started": ": resumed from its newest checkpoint",
    }
    print(head + note.get(state, ""), flush=True)


def launch_args(sweep: Sweep, p: Point, cfg, state: str, rdir: Path) -> tuple[str, list[str]]:
    """What a point runs with, as `sparkrl train` takes it: the sweep's base recipe and the point's overrides;
    for a point started before (`point_state`), its run directory, resumed at the sweep file's step count
    (the one setting a resume may change)."""
    if state == "started":
        return str(rdir), [f"trainer.total_steps={cfg.trainer.total_steps}"]
    return str(sweep.base), list(p.overrides)


def run_local(sweep: Sweep, python: str = sys.executable, fail_fast: bool = False) -> dict[str, str]:
    """Each point in turn as `python -m rl train BASE overrides...` in this working directory (a point done
    before is skipped, one started before resumed: `point_state`).
    Returns run dir -> 'ok', 'FAILED (exit N)', or 'STOPPED by SIG...' for a run a signal stopped (the
    sweep stops there: the runs after it are not started)."""
    status = {}
    for p in sweep.points:
        cfg = point_config(sweep, p)
        rdir = run_dir(cfg)
        state = point_state(rdir, cfg.trainer.total_steps)
        _announce(sweep, p, state, rdir)
        if state == "done":
            status[str(rdir)] = "ok"
            continue
        recipe, overrides = launch_args(sweep, p, cfg, state, rdir)
        resume = ["--resume"] if state == "started" else []
        rc = run_forwarding_signals([python, "-m", "rl", "train", recipe, *resume, *overrides])
        if rc in STOPPED_EXIT:
            status[str(run_dir(cfg))] = f"STOPPED by {STOPPED_EXIT[rc]}"
            print(
                f"sweep: {p.name} stopped by {STOPPED_EXIT[rc]} after its checkpoint (continue it with "
                f"`sparkrl train {run_dir(cfg)} --resume`); the sweep stops here",
                flush=True,
            )
            break
        status[str(run_dir(cfg))] = "ok" if rc == 0 else f"FAILED (exit {rc})"
        if rc != 0 and fail_fast:
            break
    return status


def run_forwarding_signals(cmd: list[str]) -> int:
    """Run `cmd` in a session of its own and hand it each SIGINT/SIGTERM the sweep gets, once: a run stops
    on its first signal after a checkpoint and at once on a second, so the terminal's Ctrl-C (sent to the
    whole foreground group) must not reach it twice, through the group and through the sweep."""
    proc = subprocess.Popen(cmd, start_new_session=True)

    def forward(signum, frame):
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_submitted(sweep: Sweep, args: argparse.Namespace) -> dict[str, str]:
    """Each point as a Ray job (rl.submit), at most --max-concurrent at once; waits for all of them."""
    from rl import submit

    client = submit.make_client(args.address)
    env = submit.parse_env(args.env)
    pending = list(sweep.points)
    running: dict[str, tuple[Point, Path]] = {}
    status: dict[str, str] = {}
    finished: dict[int, str] = {}
    try:
        while pending or running:
            while pending and len(running) < args.max_concurrent:
                p = pending.pop(0)
                cfg = point_config(sweep, p)
                rdir = submit.job_run_dir(cfg, args.runs_root)
                state = point_state(rdir, cfg.trainer.total_steps)
                _announce(sweep, p, state, rdir)
                if state == "done":
                    status[str(rdir)], finished[p.index] = "ok", str(rdir)
                    continue
                recipe, overrides = launch_args(sweep, p, cfg, state, rdir)
                job = submit.submit_run(
                    client,
                    recipe,
                    overrides,
                    python=args.python,
                    env=env,
                    runs_root=args.runs_root,
                    resume=state == "started",
                )
                print(
                    f"sweep: {p.name}: job {job.job_id} (follow: ray job logs --follow {job.job_id})",
                    flush=True,
                )
                running[job.job_id] = (p, job.run_dir)
            if not running:
                break
            job_id, final = submit.wait_any(client, list(running))
            p, rdir = running.pop(job_id)
            status[str(rdir)] = "ok" if final == "SUCCEEDED" else final
            finished[p.index] = str(rdir)
            print(f"sweep: {p.name}: {final}", flush=True)
            if final != "SUCCEEDED" and args.fail_fast:
                pending.clear()  # the jobs running go on; nothing more is submitted
    except (KeyboardInterrupt, RuntimeError, ConnectionError) as e:
        # As `sparkrl submit` does: stop watching, the jobs keep running; say which, and what they hold.
        why = "interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
        print(f"sweep: stopped watching ({why}); not submitted: {len(pending)} point(s)", file=sys.stderr)
        for job_id, (p, rdir) in running.items():
            print(
                f"sweep: {p.name}: job {job_id} keeps running (`ray job stop {job_id}` ends it)",
                file=sys.stderr,
            )
            status[str(rdir)], finished[p.index] = f"RUNNING (job {job_id})", str(rdir)
    return {d: status[d] for _, d in sorted(finished.items())}  # in sweep order, not finishing order


def write_sweep_report(run_dirs: list[Path]) -> Path | None:
    """`sparkrl report` over the finished runs, side by side, in <their common parent>/report. A failure
    here is reported, not raised: the runs and the table above are the sweep's result."""
    from rl.report import write_report

    out = Path(os.path.commonpath([d.absolute() for d in run_dirs])) / "report"
    try:
        path = write_report(run_dirs, out)
    except Exception as e:  # a run without config.yaml, no plotting backend, ...
        print(f"sweep: no combined report ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    print(f"sweep: report {path}")
    return path


def main(args: argparse.Namespace) -> int:
    if args.max_concurrent < 1:
        raise ValueError(f"--max-concurrent must be at least 1, got {args.max_concurrent}")
    sweep = load_sweep(args.sweep)
    if args.dry_run:
        print(dry_run_text(sweep))
        return 0
    try:
        status = run_local(sweep, args.python, args.fail_fast) if args.local else run_submitted(sweep, args)
    except ConnectionError as e:  # no cluster at the address, or it refused our token
        print(f"sparkrl sweep: {e}", file=sys.stderr)
        return 2
    print()
    print(final_metrics_table(list(status), status=status))
    finished = [Path(d) for d in status if (Path(d) / "metrics.jsonl").is_file()]
    if finished and not args.no_report:
        write_sweep_report(finished)
    stopped = [s for s in status.values() if s.startswith("STOPPED by ")]
    if stopped:  # as `sparkrl train` exits for a run a signal stopped: 130 (SIGINT) or 143 (SIGTERM)
        return next(rc for rc, name in STOPPED_EXIT.items() if stopped[0].endswith(name))
    return 0 if all(s == "ok" for s in status.values()) and len(status) == len(sweep.points) else 1


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "sweep",
        help="one run per point of a grid/list over config keys (Ray jobs, or --local)",
        description="Expand SWEEP.yaml (format: recipes/sweeps/demo_lr_clip.yaml) into runs named after "
        "their point, run them, and print a table of their final metrics.",
    )
    p.add_argument("sweep", metavar="SWEEP.yaml")
    p.add_argument(
        "--dry-run", action="store_true", help="print the points and their config diffs; run nothing"
    )
    p.add_argument(
        "--local",
        action="store_true",
        help="run the points one after another here (python -m rl train), not as Ray jobs",
    )
    p.add_argument(
        "--fail-fast",
        action="store_true",
        help="stop at the first failed run (Ray jobs: submit no more; those running go on)",
    )
    p.add_argument("--address", default=None, help="Ray dashboard address (default: $RAY_ADDRESS)")
    p.add_argument(
        "--python",
        default=sys.executable,
        help="interpreter the runs use (default: this one; for Ray jobs, a path on the head node)",
    )
    p.add_argument(
        "--max-concurrent",
        type=int,
        default=1,
        help="Ray jobs running at once (default 1: each run gets the whole cluster)",
    )
    p.add_argument("--runs-root", default=None, help="where submitted runs write (see `sparkrl submit -h`)")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY[=VALUE]",
        help="environment variable for the jobs (repeatable; KEY alone copies it from here)",
    )
    p.add_argument(
        "--no-report",
        action="store_true",
        help="skip `sparkrl report` over the finished runs (written to <runs>/<name>/report)",
    )
    p.set_defaults(func=main)
    return p
