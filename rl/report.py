"""`sparkrl report RUN_DIR [RUN_DIR ...]`: report.md and PNG plots for one run, or several side by side.

The first lines of report.md say whether each run's KL drift (`rollout_corr/k3_kl` per step) stayed
inside its budget (`monitor.k3_kl_max` from the run's own config.yaml, and the trend limit). The plots:
reward, accuracy, eval mean@k, k3 KL on a log scale, response length, and the step-time breakdown. Where
the run kept its samples (`rollouts/step_<N>.jsonl`), a section shows the best and the worst of a few
steps. A run is labelled by its `run.name`; runs that share one are labelled by their directories.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from pathlib import Path

import yaml

from rl.metrics import best_and_worst, read_metrics
from rl.monitor import KLMonitor
from rl.rollout_records import clip_text

PLOTS = [
    ("reward", "reward/mean", "reward (mean)", False),
    ("accuracy", "acc/mean", "training accuracy (mean)", False),
    ("k3_kl", "rollout_corr/k3_kl", "k3 KL, trainer vs rollout", True),
    ("response_length", "response_length/mean", "response length (tokens)", False),
]
TIME_KEYS = ("perf/rollout_s", "perf/train_s", "perf/sync_s")


def _num(v) -> float | None:
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def load_run(run_dir: Path) -> dict:
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists():
        raise FileNotFoundError(f"report: {run_dir} has no metrics.jsonl (is it a run directory?)")
    config = (
        yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").exists() else {}
    )
    name = (config.get("run") or {}).get("name") or run_dir.name
    return {"dir": run_dir, "name": name, "label": name, "config": config, "records": read_metrics(run_dir)}


def run_labels(runs: list[dict]) -> list[str]:
    """What names each run in the report: its `run.name` where no other run has that name; otherwise the
    shortest ending of its directory's path that sets it apart (`a/demo_cpu` and `b/demo_cpu` for two
    runs of the default name in `a/` and `b/`). The same directory given twice gets ` (2)`."""
    labels = [r["name"] for r in runs]
    parts = [Path(r["dir"]).absolute().parts for r in runs]
    depth = {i: 0 for i, name in enumerate(labels) if labels.count(name) > 1}

    def clashing() -> list[int]:
        return [i for i in depth if labels.count(labels[i]) > 1]

    while grow := [i for i in clashing() if depth[i] < len(parts[i])]:
        for i in grow:
            depth[i] += 1
            labels[i] = Path(*parts[i][-depth[i] :]).as_posix()
    seen: dict[str, int] = {}
    for i in clashing():  # left only where the directories themselves are the same
        seen[labels[i]] = seen.get(labels[i], 0) + 1
        if seen[labels[i]] > 1:
            labels[i] += f" ({seen[labels[i]]})"
    return labels


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        y = _num(r.get(key))
        if y is not None:
            xs.append(r["step"])
            ys.append(y)
    return xs, ys


def kl_verdict(run: dict) -> tuple[bool, str]:
    """(inside budget, one line) from the run's k3 KL series and its monitor settings."""
    mon = run["config"].get("monitor") or {}
    budget, trend_max = float(mon.get("k3_kl_max", 0) or 0), float(mon.get("k3_kl_trend_max", 0) or 0)
    steps, kls = series(run["records"], "rollout_corr/k3_kl")
    missing = [
        r["step"]
        for r in run["records"]
        if r["step"] > 0 and "rollout_corr/k3_kl" in r and _num(r["rollout_corr/k3_kl"]) is None
    ]
    if not kls:
        return False, f"{run['label']}: no rollout_corr/k3_kl recorded"
    monitor = KLMonitor(0.0, trend_max, int(mon.get("trend_window", 10) or 10))
    for k in kls:
        monitor.check(k)
    trend = monitor.trend()
    over = [s for s, k in zip(steps, kls) if budget > 0 and k > budget]
    ok = not over and not missing and not (trend_max > 0 and trend is not None and trend > trend_max)
    worst = max(kls)
    text = (
        f"{run['label']}: KL drift {'INSIDE' if ok else 'OUTSIDE'} its budget: k3 KL max {worst:.2e} "
        f"(step {steps[kls.index(worst)]}), mean {sum(kls) / len(kls):.2e} over {len(kls)} steps"
    )
    if budget > 0:
        text += f"; budget {budget:g}" + (f", exceeded at steps {over[:10]}" if over else "")
    if trend is not None:
        text += f"; trend x{trend:.2f}" + (f" (limit {trend_max:g})" if trend_max > 0 else "")
    if missing:
        text += f"; non-finite KL at steps {missing[:10]}"
    return ok, text


def _eval_keys(runs: list[dict]) -> list[str]:
    keys = {
        k for run in runs for r in run["records"] for k in r if k.startswith("val-core/") and "/mean@" in k
    }
    return sorted(keys)


def make_plots(runs: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        path = out / f"{name}.png"
        tmp = out / f".{name}.png.tmp"  # renamed into place: an earlier report's plot is never half replaced
        fig.tight_layout()
        fig.savefig(tmp, dpi=110, format="png")
        plt.close(fig)
        os.replace(tmp, path)
        written.append(path)

    for name, key, title, log in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for run in runs:
            xs, ys = series(run["records"], key)
            if log:
                xs, ys = (
                    zip(*[(x, y) for x, y in zip(xs, ys) if y > 0]) if any(y > 0 for y in ys) else ([], [])
                )
            ax.plot(xs, ys, marker=".", label=run["label"])
        if key == "rollout_corr/k3_kl":
            ax.set_yscale("log")
            budgets = {float((r["config"].get("monitor") or {}).get("k3_kl_max", 0) or 0) for r in runs}
            for b in sorted(x for x in budgets if x > 0):
                ax.axhline(b, color="red", linestyle="--", linewidth=1, label=f"budget {b:g}")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, name)

    keys = _eval_keys(runs)
    if keys:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for run in runs:
            for key in keys:
                xs, ys = series(run["records"], key)
                label = (
                    key.removeprefix("val-core/")
                    if len(runs) == 1
                    else f"{run['label']}: {key.split('/')[1]}"
                )
                ax.plot(xs, ys, marker="o", label=label)
        ax.set_title("eval accuracy (mean@k)")
        ax.set_xlabel("step")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        save(fig, "eval")

    fig, ax = plt.subplots(figsize=(6, 3.6))
    if len(runs) == 1:
        recs = [r for r in runs[0]["records"] if all(_num(r.get(k)) is not None for k in TIME_KEYS)]
        bottom = [0.0] * len(recs)
        for key in TIME_KEYS:
            vals = [r[key] for r in recs]
            ax.bar([r["step"] for r in recs], vals, bottom=bottom, label=key.removeprefix("perf/"))
            bottom = [b + v for b, v in zip(bottom, vals)]
    else:
        for run in runs:
            ax.plot(*series(run["records"], "perf/step_s"), marker=".", label=run["label"])
    ax.set_title("step time (s)")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    save(fig, "step_time")
    return written


def _final(run: dict, key: str) -> str:
    xs, ys = series(run["records"], key)
    return f"{ys[-1]:.4g}" if ys else "-"


# The rollouts section: this many steps (the first, the last and some between), and a step's best and
# worst this many samples, with their prompt and response cut to about these many characters.
ROLLOUT_STEPS = 4
ROLLOUT_SAMPLES = 4
ROLLOUT_PROMPT_CHARS = 300
ROLLOUT_RESPONSE_CHARS = 600


def rollout_steps(run_dir: Path) -> list[int]:
    """The steps whose samples the run kept (`rollouts/step_<N>.jsonl`), in order."""
    found = (re.fullmatch(r"step_(\d+)\.jsonl", p.name) for p in (Path(run_dir) / "rollouts").glob("*.jsonl"))
    return sorted(int(m.group(1)) for m in found if m)


def spread(steps: list[int], n: int) -> list[int]:
    """At most n of `steps`, evenly spaced, the first and the last among them."""
    if len(steps) <= n:
        return list(steps)
    if n == 1:
        return [steps[-1]]
    return sorted({steps[round(i * (len(steps) - 1) / (n - 1))] for i in range(n)})


def _read_rows(path: Path) -> list[dict]:
    """A rollouts file's rows; a line that does not parse (a file cut short) is left out."""
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _fenced(text: str) -> list[str]:
    """A code block around `text` whose fence is longer than any run of backticks inside it."""
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence + "text", text, fence]


def _facts(row: dict) -> str:
    def num(key, fmt):
        v = row.get(key)
        return format(v, fmt) if isinstance(v, int | float) and not isinstance(v, bool) else "-"

    one_line = {k: clip_text(row.get(k), 80).replace("\n", " ") for k in ("pred", "ground_truth")}
    acc = row.get("acc")
    return (
        f"reward {num('reward', '.3g')}, acc {'-' if acc is None else int(acc)}, pred `{one_line['pred']}`, "
        f"ground truth `{one_line['ground_truth']}`, {num('response_length', 'd')} tokens "
        f"({row.get('finish_reason', '-')}), k3 KL {num('k3_kl', '.2e')}, group {row.get('group', '-')} "
        f"sample {row.get('index', '-')}, adapter v{row.get('adapter_version', '-')}"
    )


def rollout_section(runs: list[dict]) -> list[str]:
    """report.md's lines on the kept samples: for each run with `rollouts/`, ROLLOUT_STEPS of its steps,
    each with its best and worst ROLLOUT_SAMPLES samples by reward. Nothing when no run kept any."""
    lines: list[str] = []
    for run in runs:
        steps = spread(rollout_steps(run["dir"]), ROLLOUT_STEPS)
        if not steps:
            continue
        if len(runs) > 1:
            lines += ["", f"### {run['label']}"]
        for step in steps:
            rows = _read_rows(run["dir"] / "rollouts" / f"step_{step}.jsonl")
            rewards = [r["reward"] for r in rows if isinstance(r.get("reward"), int | float)]
            mean = f", reward mean {sum(rewards) / len(rewards):.3g}" if rewards else ""
            lines += ["", f"**step {step}**: {len(rows)} samples kept{mean}; the best and the worst:", ""]
            for row in best_and_worst(rows, ROLLOUT_SAMPLES):
                text = (
                    f"prompt: {clip_text(row.get('prompt'), ROLLOUT_PROMPT_CHARS)}\n"
                    f"response: {clip_text(row.get('response'), ROLLOUT_RESPONSE_CHARS)}"
                )
                lines += [f"- {_facts(row)}", "", *_fenced(text), ""]
    if not lines:
        return []
    # One blank line between the parts (a step's last sample and the next step's line both add one).
    lines = [x for i, x in enumerate(lines) if x or i == 0 or lines[i - 1]]
    return ["", "## Rollout samples", *lines]


def write_report(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Write report.md and the plots; returns the report.md path."""
    if not run_dirs:
        raise ValueError("report: name at least one run directory")
    runs = [load_run(Path(d)) for d in run_dirs]
    for run, label in zip(runs, run_labels(runs)):
        run["label"] = label
    if out is None:
        out = (
            runs[0]["dir"] / "report"
            if len(runs) == 1
            else Path("reports") / "_vs_".join(r["label"].replace("/", "_") for r in runs)
        )
    out.mkdir(parents=True, exist_ok=True)
    verdicts = [kl_verdict(run) for run in runs]
    plots = make_plots(runs, out)
    keys = [
        "reward/mean",
        "acc/mean",
        "rollout_corr/k3_kl",
        "response_length/mean",
        "perf/step_s",
    ] + _eval_keys(runs)
    lines = [f"# sparkrl report: {', '.join(r['label'] for r in runs)}", ""]
    lines += [f"- {'OK' if ok else 'FAIL'}: {text}" for ok, text in verdicts]
    lines += [
        "",
        "## Final metrics",
        "",
        "| run | steps | " + " | ".join(keys) + " |",
        "|---" * (len(keys) + 2) + "|",
    ]
    for run in runs:
        steps = max((r["step"] for r in run["records"]), default=0)
        lines.append(f"| {run['label']} | {steps} | " + " | ".join(_final(run, k) for k in keys) + " |")
    evals = _eval_keys(runs)
    if evals:
        lines += ["", "## Eval", ""]
        for run in runs:
            for key in evals:
                xs, ys = series(run["records"], key)
                if ys:
                    lines.append(
                        f"- {run['label']} {key}: " + ", ".join(f"step {x}: {y:.3f}" for x, y in zip(xs, ys))
                    )
    lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    lines += rollout_section(runs)
    path = out / "report.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path


def register(sub) -> None:
    p = sub.add_parser("report", help="report.md and plots for one run, or several side by side")
    p.add_argument("run_dirs", nargs="+", type=Path)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: RUN/report, or reports/<a>_vs_<b> for several runs)",
    )
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    path = write_report(args.run_dirs, args.out)
    print(path.read_text().split("\n## ")[0].strip())
    print(f"report: {path}")
    return 0
