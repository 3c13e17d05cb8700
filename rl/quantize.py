"""`sparkrl quantize SRC DST --scheme nvfp4`: a Hugging Face checkpoint -> its weight-only NVFP4 twin.

The format and the math are trainer/nvfp4.py's (compressed-tensors "nvfp4-pack-quantized", group 16, the
model-free shard-by-shard pathway): every 2D Linear weight is quantized; the routers (`mlp.gate`), norms,
embeddings and lm_head stay in their original precision. Per model family, a few more Linear layers stay
unquantized (its `quantize_ignore`, rl/models/<family>/), named in the checkpoint's `ignore` list so vLLM
builds them unquantized too.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

SCHEMES = ("nvfp4",)


def quantizer_for(src: str | os.PathLike):
    """The NVFP4 converter of checkpoint `src`: the default ignore list plus its family's."""
    from rl.models import registry
    from trainer.nvfp4 import _NVFP4Quantizer

    family = registry.family(json.loads((Path(src) / "config.json").read_text()).get("model_type") or "")
    return _NVFP4Quantizer(src, list(family.quantize_ignore) if family else [])


def quantize(src: str | os.PathLike, dst: str | os.PathLike, scheme: str = "nvfp4") -> Path:
    """Writes the quantized checkpoint (config, tokenizer and all other files copied) to `dst`."""
    from trainer.nvfp4 import _convert_atomically

    if scheme not in SCHEMES:
        raise ValueError(f"quantize: --scheme must be one of {', '.join(SCHEMES)}, got {scheme!r}")
    return _convert_atomically(src, dst, quantizer_for)


def _run(args: argparse.Namespace) -> int:
    path = quantize(args.src, args.dst, scheme=args.scheme)
    print(f"quantize: {args.src} -> {path} ({args.scheme}, weight-only)")
    return 0


def register(subparsers) -> None:
    """Adds `quantize SRC DST --scheme nvfp4` to the `sparkrl` command's subparsers."""
    p = subparsers.add_parser(
        "quantize", help="write a weight-only NVFP4 (compressed-tensors) copy of a checkpoint"
    )
    p.add_argument("src", help="Hugging Face model directory")
    p.add_argument("dst", help="directory to write the quantized model to (must not exist)")
    p.add_argument("--scheme", choices=SCHEMES, default="nvfp4")
    p.set_defaults(func=_run)
