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
        print(f"make-tiny: held-out sampled accuracy {r['heldout_acc']:.3f} on {r['heldout_problems']} problems, "
              f"{inside} the band {lo}-{hi}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparkrl", description="LoRA GRPO post-training of MoE models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("make-tiny", help="build a small test model (tokenizer trained locally, no hub access)")
    p.add_argument("--arch", required=True, choices=["dense", "qwen3_moe"])
    p.add_argument("--out", required=True, help="directory to write the Hugging Face model to")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft", choices=["arith"], default=None,
                   help="fine-tune on noisy arithmetic so held-out accuracy lands in 0.3-0.6 (cached)")
    p.set_defaults(func=_make_tiny)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"sparkrl {args.command}: error: {e}", file=sys.stderr)
        return 2
