"""The `sparkrl` command (also `python -m rl`). Each subcommand imports its heavy modules lazily."""

from __future__ import annotations

import argparse
import sys


def _make_tiny(args: argparse.Namespace) -> int:
    from rl.models.tiny import make_tiny

    path = make_tiny(args.arch, args.out, seed=args.seed, sft=args.sft)
    print(f"make-tiny: {args.arch} model{' (sft ' + args.sft + ')' if args.sft else ''} at {path}")
    report = path / "sft_report.json"
    if report.exists():
        import json

        r = json.loads(report.read_text())
        lo, hi = r["acc_band"]
        inside = "inside" if lo <= r["heldout_acc"] <= hi else "OUTSIDE"
        print(
            f"make-tiny: held-out sampled accuracy {r['heldout_acc']:.3f} on {r['heldout_problems']} problems, "
            f"{inside} the band {lo}-{hi}"
        )
    return 0


def _train(args: argparse.Namespace) -> int:
    from rl.config import load_config, run_dir

    cfg = load_config(args.recipe, args.overrides)
    if args.resume:
        _check_resume_config(cfg, run_dir(cfg))
    from rl.driver import train

    summary = train(cfg, resume=args.resume)
    print_summary(summary)
    return 0


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
        k for k in new.keys() | old.keys() if new.get(k) != old.get(k) and k != "trainer.total_steps"
    )
    if changed:
        diff = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:8])
        raise ValueError(
            f"--resume: the config differs from the run's own {saved_path} ({diff}); resume with "
            f"`sparkrl train {rdir} --resume` (only trainer.total_steps may change)"
        )


def print_summary(s: dict) -> None:
    lines = [f"run: {s['run_dir']} ({s['steps']} steps, {s['seconds']:.0f} s)"]
    if s.get("eval_key"):
        lines.append(
            f"{s['eval_key']}: {s['eval_start']:.3f} -> {s['eval_end']:.3f} "
            f"({s['eval_end'] - s['eval_start']:+.3f})"
        )
    if s.get("k3_kl_max") is not None:
        lines.append(f"rollout_corr/k3_kl: mean {s['k3_kl_mean']:.2e}, max {s['k3_kl_max']:.2e}")
    if s.get("report"):
        lines.append(f"report: {s['report']}")
    print("\n".join(lines))


def _dequantize(args: argparse.Namespace) -> int:
    from trainer.checkpoint_io import dequantize_checkpoint

    out = dequantize_checkpoint(args.src, args.dst)
    print(f"dequantize: BF16 checkpoint at {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparkrl", description="LoRA GRPO post-training of MoE models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="run GRPO: a recipe (or a run directory) plus key=value overrides")
    p.add_argument("recipe", help="recipe YAML, shipped recipe name (demo_cpu), or a run directory")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. trainer.lr=1e-5")
    p.add_argument(
        "--resume", action="store_true", help="continue from the run directory's newest checkpoint"
    )
    p.set_defaults(func=_train)

    p = sub.add_parser(
        "make-tiny", help="build a small test model (tokenizer trained locally, no hub access)"
    )
    p.add_argument("--arch", required=True, choices=["dense", "qwen3_moe", "muse"])
    p.add_argument("--out", required=True, help="directory to write the Hugging Face model to")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sft",
        choices=["arith"],
        default=None,
        help="fine-tune on noisy arithmetic so held-out accuracy lands in 0.3-0.6 (cached)",
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


def main(argv: list[str] | None = None) -> int:
    from rl.monitor import StopRun

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError, StopRun) as e:
        print(f"sparkrl {args.command}: error: {e}", file=sys.stderr)
        return 2
