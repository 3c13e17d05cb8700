"""Trainer throughput: tokens/s of the trainer group's log-probs pass and GRPO update, and MFU.

One fixed batch of `--samples` sequences of `--seq-len` random tokens (the last `--seq-len - --prompt-len`
the response) with random advantages and, with `r3.enabled`, R3 replay of uniformly random routing,
through `TrainerGroup.log_probs` (forward) and `TrainerGroup.train_step` (forward, backward, the optimizer
on the LoRA weights), with the config's LoRA, micro-batching, activation checkpointing and compilation.
`--warmup` untimed steps first (a compiled trainer compiles there), then `--steps` timed ones; the median.

MFU counts active parameters N (routed experts at top_k / num_experts, embeddings left out, attention
scores and LoRA's own matmuls left out) over all T tokens against `--peak-tflops` (the GPU's bf16 matmul
rate; 0 leaves MFU out): mfu_6n = 6 N T / s (the usual training convention), mfu_4n = 4 N T / s (what LoRA
training computes on the frozen base: forward and input gradients, no weight gradients).

On GPUs the device memory in use is sampled through the timed steps (bench.grpo's DeviceMemory: every
process on the GPU): `peak_gib`, beside `plan_peak_gib`, `sparkrl plan`'s trainer peak for the config.

    python -m bench.trainer RECIPE [key=value ...] --samples 32 --seq-len 1024 --peak-tflops 720
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from bench.common import Bench, main, median
from bench.grpo import DeviceMemory


def active_params(model_path: str) -> tuple[int, int]:
    """(total, active) parameters of the checkpoint's model, built on the meta device."""
    import torch

    from rl.models import auto_causal_lm, auto_config

    config = auto_config(model_path)
    text = getattr(config, "text_config", None) or config
    with torch.device("meta"):
        model = auto_causal_lm().from_config(config)
    from rl.core.model_info import num_experts

    experts = num_experts(text.to_dict())
    share = text.num_experts_per_tok / experts if experts else 1.0
    total = active = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if "embed_tokens" not in name:
            active += p.numel() * (share if ".experts." in name else 1.0)
    return int(total), int(active)


def make_samples(args, vocab: int, layers: int, top_k: int, experts: int) -> list:
    from rl.core.batch import Sample

    rng = np.random.default_rng(0)
    out = []
    for i in range(args.samples):
        ids = rng.integers(10, vocab - 1, size=args.seq_len).tolist()
        routed = None
        if experts:  # top_k distinct experts per (token, layer): consecutive ids from a random start
            start = rng.integers(0, experts, size=(args.seq_len - 1, layers, 1))
            routed = ((start + np.arange(top_k)) % experts).astype(np.uint8 if experts <= 256 else np.uint16)
        response = ids[args.prompt_len :]
        out.append(
            Sample(
                ids[: args.prompt_len],
                response,
                np.full(len(response), -1.0, np.float32),
                "length",
                0,
                i,
                routed_experts=routed,
            )
        )
    return out


def measure(s, args) -> list[dict]:
    from rl.core.model_info import num_experts
    from rl.models import auto_config

    ro = s.cfg.rollout
    if args.seq_len > ro.max_prompt_len + ro.max_response_len or args.prompt_len >= args.seq_len:
        raise SystemExit(
            f"bench.trainer: --seq-len {args.seq_len} must exceed --prompt-len {args.prompt_len} and be at most "
            f"rollout.max_prompt_len + rollout.max_response_len ({ro.max_prompt_len + ro.max_response_len}), "
            "the trainer's longest sequence"
        )
    text = auto_config(s.model_path)
    text = getattr(text, "text_config", None) or text
    experts = num_experts(text.to_dict()) if s.cfg.r3.enabled else 0
    samples = make_samples(
        args, len(s.tokenizer), text.num_hidden_layers, getattr(text, "num_experts_per_tok", 0), experts
    )
    advantages = np.random.default_rng(1).standard_normal(len(samples)).tolist()
    log_probs_s, train_s = [], []
    memory = DeviceMemory.on_gpus() if s.cfg.resources.num_gpus else None
    with memory or contextlib.nullcontext():
        for step in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            old, _ = s.trainer.log_probs(samples)
            t1 = time.perf_counter()
            s.trainer.train_step(samples, advantages, old)
            t2 = time.perf_counter()
            if step >= args.warmup:
                log_probs_s.append(t1 - t0)
                train_s.append(t2 - t1)
    tokens = args.samples * args.seq_len
    total, active = active_params(s.model_path)
    t = s.cfg.trainer
    row = {
        "samples": args.samples,
        "seq_len": args.seq_len,
        "tokens": tokens,
        "ranks": t.num_ranks,
        "micro_batch_tokens": t.micro_batch_tokens,
        "activation_checkpointing": t.activation_checkpointing,
        "compile": t.compile,
        "activation_memory_budget": t.activation_memory_budget,
        "lora_rank": s.cfg.lora.rank,
        "r3_replay": bool(experts),
        "total_params": total,
        "active_params": active,
        "train_step_s": median(train_s),
        "log_probs_s": median(log_probs_s),
    }
    if memory is not None and memory.samples:
        from rl.plan import make_plan

        row["peak_gib"] = max(used for _, used in memory.samples) / 2**30
        row["plan_peak_gib"] = make_plan(s.cfg, advise=False).t_peak / 2**30
    row["train_tokens_per_s"] = tokens / row["train_step_s"]
    row["log_probs_tokens_per_s"] = tokens / row["log_probs_s"]
    if args.peak_tflops:
        rate = args.peak_tflops * 1e12 * t.num_ranks
        row["mfu_6n"] = 6 * active * tokens / row["train_step_s"] / rate
        row["mfu_4n"] = 4 * active * tokens / row["train_step_s"] / rate
    return [row]


def _args(p) -> None:
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--peak-tflops", type=float, default=0.0, help="bf16 matmul TFLOP/s of one GPU (0: no MFU)"
    )


BENCH = Bench(
    name="trainer",
    doc=__doc__.splitlines()[0],
    columns=(
        "tokens",
        "ranks",
        "micro_batch_tokens",
        "activation_checkpointing",
        "compile",
        "r3_replay",
        "train_tokens_per_s",
        "log_probs_tokens_per_s",
        "mfu_6n",
        "mfu_4n",
        "peak_gib",
        "plan_peak_gib",
    ),
    measure=measure,
    add_args=_args,
    rollout=False,
)

if __name__ == "__main__":
    raise SystemExit(main(BENCH))
