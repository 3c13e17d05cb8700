"""`python -m bench.dequant`: the trainer's NVFP4 dequantization of one decoder layer's frozen weights, the Triton
kernel (trainer/nvfp4_kernel.py) against compressed-tensors' elementwise path, on the GPU.

Per model preset (`sparkrl make-random`'s: Qwen3-30B-A3B, Muse Spark Open's layer at full width) and per
weight of a decoder layer (the fused expert banks gate_up_proj and down_proj, the attention's q_proj), random
packed codes and FP8 block scales of that shape (a bank's first `--max-weights` weights' worth of experts:
the reference path's int64 temporaries would not fit a whole Muse bank), dequantized to BF16 by each
implementation: median milliseconds of `--repeats`, weights/s, bytes moved per second (packed and scales
read, BF16 written: the kernel's floor), the peak memory above the inputs (the output included), and whether the two gave the same
bits. `layer_ms` scales the time to the whole weight (all experts): what one FSDP all-gather costs in
dequantization per layer, forward and backward each.

    python -m bench.dequant [--models qwen3_30b_a3b,muse_full_width] [--repeats 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench.common import env_info, markdown, median, write_atomic

COLUMNS = (
    "model",
    "weight",
    "shape",
    "measured_experts",
    "impl",
    "ms",
    "layer_ms",
    "gweights_per_s",
    "gb_per_s",
    "peak_extra_gib",
    "same_bits",
)
WEIGHTS = ("gate_up_proj", "down_proj", "q_proj.weight")


def layer_shapes(preset: str) -> dict[str, tuple[int, ...]]:
    """The logical shapes of one decoder layer's packed weights in the trainer's model (meta device)."""
    import torch

    from rl.models import auto_causal_lm
    from rl.quantize import preset_config

    config = preset_config(preset, layers=1)
    with torch.device("meta"):
        model = auto_causal_lm().from_config(config)
    shapes = {}
    for name, p in model.named_parameters():
        for w in WEIGHTS:
            if name.endswith(w) and ".layers.0." in name and w not in shapes:
                shapes[w] = tuple(p.shape)
    return shapes


def random_packed(shape, device):
    """Packed codes and finite FP8 block scales of `shape`, global scales one a leading index (bank) or one."""
    import torch

    *lead, cols = shape
    packed = torch.randint(0, 256, (*lead, cols // 2), dtype=torch.uint8, device=device)
    scale_bytes = torch.randint(0, 0x7F, (*lead, cols // 16), dtype=torch.uint8, device=device)
    scale_bytes |= torch.randint(0, 2, scale_bytes.shape, dtype=torch.uint8, device=device) << 7
    g = torch.rand(shape[0] if len(shape) == 3 else 1, device=device) * 1000 + 1.0
    return packed, scale_bytes.view(torch.float8_e4m3fn), g


def time_one(fn, repeats: int) -> tuple[float, float, object]:
    """(median ms, peak GiB above what was allocated before, the last output)."""
    import torch

    out = fn()  # warm-up: Triton compiles here
    del out
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        if len(times) < repeats:
            del out
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return median(times) * 1e3, peak, out


def measure(preset: str, args, env: dict) -> list[dict]:
    """Every weight of the preset's layer; each one's rows printed as they come (`env`: bench.common's)."""
    import torch

    rows = []
    for weight, shape in layer_shapes(preset).items():
        rows += measure_weight(preset, weight, shape, args)
        print(markdown({"env": env, "rows": rows[-2:]}, COLUMNS), flush=True)
        torch.cuda.empty_cache()
    return rows


def measure_weight(preset: str, weight: str, shape: tuple[int, ...], args) -> list[dict]:
    """Both implementations on one weight: two rows."""
    import torch

    from trainer import nvfp4_tensor

    if len(shape) == 3:  # a bank: as many experts as --max-weights allows
        experts = max(1, min(shape[0], args.max_weights // (shape[1] * shape[2])))
        measured = (experts, *shape[1:])
    else:
        experts, measured = None, shape
    packed, scale, g = random_packed(measured, "cuda")
    n = packed.numel() * 2
    moved = packed.numel() + scale.numel() + 2 * n  # bytes: codes and scales in, BF16 out
    rows, outputs = [], {}
    for impl in ("triton", "torch"):
        nvfp4_tensor.use_implementation(impl)
        try:
            ms, peak, outputs[impl] = time_one(
                lambda: nvfp4_tensor.dequantize(packed, scale, g, torch.bfloat16), args.repeats
            )
        finally:
            nvfp4_tensor.use_implementation("triton")
        rows.append(
            {
                "model": preset,
                "weight": weight,
                "shape": "x".join(map(str, shape)),
                "measured_experts": experts,
                "impl": impl,
                "ms": ms,
                "layer_ms": ms * (shape[0] / experts if experts else 1.0),
                "gweights_per_s": n / ms / 1e6,
                "gb_per_s": moved / ms / 1e6,
                "peak_extra_gib": peak,
            }
        )
    same = torch.equal(outputs["triton"].view(torch.int16), outputs["torch"].view(torch.int16))
    for r in rows:
        r["same_bits"] = same
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dequant", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models", default="qwen3_30b_a3b,muse_full_width", help="make-random presets, comma-separated"
    )
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument(
        "--max-weights", type=int, default=2**30, help="a bank's experts measured: up to this many weights"
    )
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out", help="results folder")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(
            "bench.dequant: needs a CUDA GPU (the kernel is Triton's; on CPU the reference path runs)"
        )
    env = env_info("dequant", argv if argv is not None else sys.argv[1:])
    rows = [r for preset in args.models.split(",") if preset for r in measure(preset, args, env)]
    doc = {
        "bench": "dequant",
        "env": env,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "rows": rows,
    }
    out = Path(args.out)
    write_atomic(out / "dequant.json", json.dumps(doc, indent=1, default=str) + "\n")
    write_atomic(out / "dequant.md", markdown(doc, COLUMNS))
    print(markdown(doc, COLUMNS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
