"""The `sparkrl` command (also `python -m rl`). Each subcommand imports its heavy modules lazily."""

from __future__ import annotations

import argparse
import json
import os
import sys

# Keys a resumed run may change: the schedule's length, and where the run directory now is.
_MAY_CHANGE_ON_RESUME = ("trainer.total_steps", "run.dir")


def _make_tiny(args: argparse.Namespace) -> int:
    from rl.tiny import make_tiny

    if args.quantize:
        from rl.quantize import quantized_copy
        from rl.tiny import copy_model

        path = quantized_copy(make_tiny(args.arch, seed=args.seed, sft=args.sft), args.quantize)
        path = copy_model(path, args.out)
    else:
        path = make_tiny(args.arch, args.out, seed=args.seed, sft=args.sft)
    print(f"make-tiny: {args.arch} model{' (sft ' + args.sft + ')' if args.sft else ''} at {path}")
    report = path / "sft_report.json"
    r = json.loads(report.read_text()) if report.exists() else {}
    if "acc_band" in r:  # the arith warm-up measures its model; the tool warm-up's is measured by a run
        lo, hi = r["acc_band"]
        inside = "inside" if lo <= r["heldout_acc"] <= hi else "OUTSIDE"
        print(
            f"make-tiny: held-out sampled accuracy {r['heldout_acc']:.3f} on {r['heldout_problems']} problems, "
            f"{inside} the band {lo}-{hi}"
        )
    return 0


def _train(args: argparse.Namespace) -> int:
    from rl.preflight import preflight
    from rl.target import absolute_run_dir, load_target

    cfg = load_target(args.recipe, args.overrides)
    rdir = absolute_run_dir(cfg)
    if args.resume:
        _check_resume_config(cfg, rdir)
    preflight(cfg)
    print(f"run: {rdir}", flush=True)
    from rl.driver import StoppedAtOnce, train

    try:
        summary = train(cfg, resume=args.resume)
    except KeyboardInterrupt as e:  # a second signal, or Ctrl-C before the run's own handlers were in place
        from rl.checkpoint import latest_checkpoint

        name = e.signal_name if isinstance(e, StoppedAtOnce) else "SIGINT"
        ckpt = latest_checkpoint(rdir, report=lambda line: None)
        then = f"the newest checkpoint is {ckpt.name}" if ckpt else "no checkpoint was written"
        print(f"sparkrl train: {str(e) or name + ': stopped'}; {then}", file=sys.stderr)
        return stop_exit_code(name)
    print_summary(summary)
    return stop_exit_code(summary["stopped_by"]) if summary.get("stopped_by") else 0


def stop_exit_code(signal_name: str) -> int:
    """128 + the signal's number, as a shell reports a process the signal ended: 130 for SIGINT, 143 for
    SIGTERM. A run stopped by a signal is not a finished run, and a scheduler can tell the two apart."""
    import signal

    return 128 + int(signal.Signals[signal_name])


def _check_resume_config(cfg, rdir) -> None:
    """A resumed run must have the config it started with: same data order, same schedule."""
    import dataclasses

    from rl.config import flatten, load_config

    saved_path = rdir / "config.yaml"
    if not saved_path.exists():
        raise FileNotFoundError(f"--resume: {rdir} holds no run (no config.yaml)")
    saved = load_config(saved_path)
    new, old = flatten(dataclasses.asdict(cfg)), flatten(dataclasses.asdict(saved))
    changed = sorted(
        k for k in new.keys() | old.keys() if new.get(k) != old.get(k) and k not in _MAY_CHANGE_ON_RESUME
    )
    if changed:
        diff = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:8])
        raise ValueError(
            f"--resume: the config differs from the run's own {saved_path} ({diff}); resume with "
            f"`sparkrl train {rdir} --resume` (only trainer.total_steps may change)"
        )


def print_summary(s: dict) -> None:
    """One line for the run (steps, time, the held-out rise, the KL), then where the report and logs are."""
    ran = s["steps"] - s.get("first_step", 1) + 1  # the steps this invocation ran
    which = {0: "no step", 1: f"step {s['steps']}"}.get(ran, f"steps {s['first_step']}-{s['steps']}")
    if s.get("stopped_by"):
        head = f"stopped at step {s['steps']} of {s['total_steps']} by {s['stopped_by']} (checkpoint written)"
        from rl.submit import SUBMITTED_ENV

        command = "submit" if os.environ.get(SUBMITTED_ENV) else "train"  # a Ray job resumes as a job
        tail = f"; continue with `sparkrl {command} {s['run_dir']} --resume`"
    else:
        head, tail = f"done: {s['steps']} of {s['total_steps']} steps", ""
    parts = [f"{head}: {ran} this run ({which}) in {s['seconds'] / 60:.1f} min{tail}"]
    if s.get("eval_key"):
        name = s["eval_key"].rsplit("/", 1)[-1]
        parts.append(
            f"{name} {s['eval_start']:.3f} -> {s['eval_end']:.3f} ({s['eval_end'] - s['eval_start']:+.3f})"
        )
    if s.get("k3_kl_max") is not None:
        parts.append(f"k3 KL mean {s['k3_kl_mean']:.2e} max {s['k3_kl_max']:.2e}")
    print(" | ".join(parts))
    print(f"run: {s['run_dir']}  (workers' logs in logs/)")
    if s.get("report"):
        print(f"report: {s['report']}")


def _dequantize(args: argparse.Namespace) -> int:
    from trainer.checkpoint_io import dequantize_checkpoint

    out = dequantize_checkpoint(args.src, args.dst)
    print(f"dequantize: BF16 checkpoint at {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from rl import __version__
    from rl.models.registry import TINY_ARCHES

    parser = argparse.ArgumentParser(prog="sparkrl", description="LoRA GRPO post-training of MoE models.")
    parser.add_argument("--version", action="version", version=f"sparkrl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "train",
        help="run GRPO: a recipe (or a run directory) plus key=value overrides",
        description="Run GRPO with LoRA. Your own task: your dataset (JSON lines or parquet in verl's schema) in "
        'data.train, your reward function in reward.function="path/to/reward.py:name" (verl\'s signature '
        "name(data_source, solution_str, ground_truth, extra_info)), per data source in reward.by_source, your "
        'loss in algorithm.policy_loss="file.py:name": docs/your_task.md, recipes/examples/equations.yaml.',
    )
    p.add_argument("recipe", help="recipe YAML, shipped recipe name (demo_cpu), or a run directory")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. trainer.lr=1e-5")
    p.add_argument(
        "--resume", action="store_true", help="continue from the run directory's newest checkpoint"
    )
    p.set_defaults(func=_train)

    p = sub.add_parser(
        "make-tiny", help="build a small test model (tokenizer trained locally, no hub access)"
    )
    p.add_argument("--arch", required=True, choices=TINY_ARCHES)
    p.add_argument("--out", required=True, help="directory to write the Hugging Face model to")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sft",
        choices=["arith", "arith_tool"],
        default=None,
        help="fine-tune on noisy arithmetic so held-out accuracy lands in 0.3-0.6; arith_tool: then on "
        "noisy calculator tool-call transcripts, the tool-use demo's model (cached)",
    )
    p.add_argument(
        "--quantize",
        choices=["nvfp4"],
        default=None,
        help="write its weight-only NVFP4 copy instead (cached; vLLM serves it on GPUs only)",
    )
    p.set_defaults(func=_make_tiny)

    p = sub.add_parser("dequantize", help="write the BF16 twin of an NVFP4 compressed-tensors checkpoint")
    p.add_argument("src", help="NVFP4 checkpoint directory")
    p.add_argument("dst", help="output directory (must not exist)")
    p.set_defaults(func=_dequantize)

    from rl import eval_run, plan, quantize, report, submit, sweep

    eval_run.register(sub)
    report.register(sub)
    submit.register(sub)
    sweep.register(sub)
    plan.register(sub)
    quantize.register(sub)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Options and `key=value` overrides in any order (`train RUN --resume a=1` as well as
    `train RUN a=1 --resume`): argparse stops a positional list at the first option, so what it leaves
    over joins the overrides; an unknown option is still an error."""
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-") or not hasattr(args, "overrides")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    from rl.monitor import StopRun

    args = parse_args(build_parser(), argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError, StopRun, TimeoutError) as e:
        print(f"sparkrl {args.command}: error: {e}", file=sys.stderr)
        return 2
