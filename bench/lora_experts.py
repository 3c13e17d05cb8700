"""The trainer's compute without the rest of the system: expert LoRA by PEFT vs grouped (trainer/lora_experts.py).

    python -m bench.lora_experts [--models muse,qwen3_moe] [--paths peft,grouped] [--ac on,off,0.5]
                                 [--compile none,layers] [--micro-tokens 16384] [--seq-len 1024] [--steps 4]

Per model, path and activation-checkpointing setting (on, off, or a number: no whole-layer checkpointing,
the compiled layers' partitioner recomputing within that memory budget as trainer.activation_memory_budget
does; `--compile layers` only): the bench model's shape (bench/models.py) at random init in bf16 on one
GPU, the recipe's LoRA (rank 32 on attention, all experts and Muse's latent projections, fp32 weights),
FSDP2 and activation checkpointing exactly as the trainer lays them (trainer.parallelize, world size 1), R3
replay of uniform random routing, and one micro-batch of `--micro-tokens` tokens through forward, backward
and AdamW. Rows give tokens/s, MFU (6N and 4N on active parameters, bench/trainer.py's convention), peak
memory, and for the first step a profile (top device ops, device-busy share). Needs only torch,
transformers and PEFT (no vLLM, Ray or verl): it runs on the GPU machine before the kit is installed.
Results: $OUT/lora_experts.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from types import SimpleNamespace

import numpy as np
import torch

from bench import models
from bench.common import Results, env_info, log, out_dir, set_log_file
from bench.host import _sync, matmul_rate, profile_device
from bench.trainer import ac_fields, ac_tag, parse_ac

VOCAB = 1024  # the bench models' tokenizer is ~1k (bench/models.py): the LM head is negligible


def _lora(model_name: str, rank: int):
    # trainer.spec.LoraSpec's fields (trainer.spec imports verl, which the bare GPU machine lacks)
    return SimpleNamespace(
        rank=rank,
        alpha=2.0 * rank,
        dropout=0.0,
        modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        experts=True,
        latent=model_name == "muse",
        extra="",
    )


def _build(
    model_name: str, rank: int, grouped: bool, ac: bool | float, compile: str, mesh, device, tiny: bool
):
    from transformers import AutoModelForCausalLM

    import rl.models.muse  # noqa: F401 - registers Muse Spark with the Auto classes
    from trainer import lora_experts
    from trainer.lora import apply_lora
    from trainer.parallelize import parallelize
    from trainer.routing_replay import RoutingReplay

    spec = models.spec_for(model_name, tiny=tiny)
    config = models.hf_config(spec, VOCAB, eos_id=1, pad_id=0)
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = apply_lora(
        base, _lora(model_name, rank), seed=0, init_lora_weights=False, grouped_experts=grouped
    )
    model.to(device)
    replay = RoutingReplay(base)
    lora_experts.compile_experts(compile == "experts")
    parallelize(
        base,
        base.model.layers,
        mesh,
        compute_dtype=torch.bfloat16,
        compile=compile == "layers",
        **ac_fields(ac),
    )
    return model, replay, config


def _step(model, replay, optimizer, ids, routed):
    valid = torch.ones(routed.shape[0], dtype=torch.bool, device=routed.device)
    with replay.active(routed, valid):
        logits = model(input_ids=ids, use_cache=False).logits.float()
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (-logp.mean()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_one(model_name, path, ac, compile, args, mesh, device, rate) -> dict:
    model, replay, config = _build(
        model_name, args.rank, path == "grouped", ac, compile, mesh, device, args.tiny
    )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    batch = args.micro_tokens // args.seq_len
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, VOCAB - 1, (batch, args.seq_len), generator=g).to(device)
    n_rows, layers, k, experts = ids.numel(), replay.num_layers, replay.top_k, replay.num_experts
    start = torch.randint(0, experts, (n_rows, layers, 1), generator=g)
    routed = ((start + torch.arange(k)) % experts).to(device)  # k distinct experts, uniform load

    t = time.perf_counter()
    for _ in range(args.warmup):
        _step(model, replay, optimizer, ids, routed)
    _sync()
    first = time.perf_counter() - t  # warm-up, compile included
    _sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        _step(model, replay, optimizer, ids, routed)
        _sync()
        times.append(time.perf_counter() - t)
    s = float(np.median(times))
    n = models.active_params(config)["active"]
    row = {
        "model": model_name,
        "path": path,
        **ac_fields(ac),
        "compile": compile,
        "lora_rank": args.rank,
        "micro_batch_tokens": ids.numel(),
        "seq_len": args.seq_len,
        "active_params": n,
        "step_s": s,
        "first_step_s": first,
        "step_s_all": times,
        "tokens_per_s": ids.numel() / s,
        "mfu_6n": 6 * n * ids.numel() / s / (rate * 1e12),
        "mfu_4n": 4 * n * ids.numel() / s / (rate * 1e12),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }
    if args.profile:
        row["profile"] = profile_device(lambda: _step(model, replay, optimizer, ids, routed))
    return row  # the model goes with this frame; main() frees its memory before the next row


def _log_row(tag: str, row: dict) -> None:
    prof = row.get("profile")
    busy = (
        f", device busy {prof['device_busy_fraction']:.0%}, host ops {prof['host_ops_s']:.2f}s of "
        f"{prof['wall_s']:.2f}s"
        if prof
        else ""
    )
    peak = f", peak {row['peak_allocated_gib']:.1f} GiB" if row["peak_allocated_gib"] else ""
    log(
        f"{tag}: {row['tokens_per_s']:.0f} tok/s, MFU(6N) {row['mfu_6n']:.1%}, (4N) {row['mfu_4n']:.1%}"
        f"{peak}{busy}, first step {row['first_step_s']:.1f}s"
    )
    for op in (prof or {}).get("top_ops", [])[:10]:
        log(f"    {op['device_ms']:8.1f} ms  {op['calls']:5d}x  {op['name'][:70]}")


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="muse,qwen3_moe")
    p.add_argument("--paths", default="peft,grouped", help="expert LoRA forward: peft, grouped")
    p.add_argument(
        "--ac",
        default="on",
        help="activation checkpointing: on, off, or a memory budget in (0, 1] for --compile layers "
        "(e.g. on,off,0.5)",
    )
    p.add_argument(
        "--compile",
        default="none",
        help="none, experts (only the grouped expert function), layers (each decoder layer: the trainer's way)",
    )
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--micro-tokens", type=int, default=16384)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--no-profile", dest="profile", action="store_false")
    p.add_argument(
        "--tiny", action="store_true", help="tiny models on CPU: checks the script, figures mean nothing"
    )
    args = p.parse_args(argv)
    for name in args.models.split(","):
        models.spec_for(name, tiny=args.tiny)  # unknown names fail before the GPU work
    paths = args.paths.split(",")
    if bad := [x for x in paths if x not in ("peft", "grouped")]:
        raise SystemExit(f"--paths: unknown {bad}; choose from peft, grouped")
    try:
        acs = parse_ac(args.ac)
    except ValueError as e:
        raise SystemExit(f"--ac: {e}") from None
    compiles = args.compile.split(",")
    if bad := [x for x in compiles if x not in ("none", "experts", "layers")]:
        raise SystemExit(f"--compile: unknown {bad}; choose from none, experts, layers")
    if not torch.cuda.is_available() and not args.tiny:
        raise SystemExit("bench.lora_experts measures the GPU's kernels: it needs CUDA (or --tiny, on CPU)")
    if args.tiny:
        args.micro_tokens, args.seq_len, args.warmup, args.steps = 64, 32, 1, 1

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    set_log_file(out / "log.txt")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (1,))
    rate = matmul_rate(512 if args.tiny else 8192)["tflops"]
    log(f"bf16 matmul {rate:.0f} TFLOP/s")
    results = Results(
        out, "lora_experts", env_info(vars(args), "bench.lora_experts") | {"matmul_tflops": rate}
    )
    torch._dynamo.config.cache_size_limit = 64  # one graph per distinct shape, not per layer
    for name in args.models.split(","):
        for ac in acs:
            for compile in compiles:
                for path in paths:
                    if compile == "experts" and path != "grouped":
                        continue  # PEFT's path has no expert function of ours to compile
                    if not isinstance(ac, bool) and compile != "layers":
                        continue  # a memory budget is the compiled layers' partitioner's
                    what = dict(model=name, path=path, **ac_fields(ac), compile=compile)
                    tag = f"{name} {path} {ac_tag(ac)} compile={compile}"
                    try:
                        row = run_one(name, path, ac, compile, args, mesh, device, rate)
                    except Exception as e:  # noqa: BLE001 - a row of its own; the other settings still run
                        results.add(**what, status=f"error: {type(e).__name__}: {e}"[:500])
                        log(f"{tag}: {type(e).__name__}: {str(e)[:300]}")
                        _free(device)
                        continue
                    _free(device)
                    results.add(**row)
                    _log_row(tag, row)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
