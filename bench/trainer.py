"""Trainer throughput, MFU and peak memory, and the TrainerSpecs every benchmark uses.

One fixed batch of `samples` sequences of `seq_len` random tokens (the last `seq_len - prompt_len` are the
response), with R3 replay of random top-k routing (uniform expert load), through TrainerWorker.log_probs
(forward) and TrainerWorker.train_step (forward + backward + AdamW on the LoRA weights), with the recipe's
LoRA (rank 32, attention + experts (+ Muse latent)), torch.compile per layer (the trainer's GPU default;
the first steps compile), activation checkpointing on, off or a memory budget (`--train-ac on,off,0.5`: a
number is trainer.activation_memory_budget, the compiler's recomputation instead of whole-layer
checkpointing) and micro-batches of `--train-micro-tokens` tokens (a sweep: one row each; the first row
also profiles one step and one log-probs pass: device busy share, top device ops, top host ops; and, on
CUDA, counts where the host waited for the device in each, `host.sync_sites`).

MFU: FLOPs / seconds / the bf16 matmul rate measured on the same GPU (8192^3 GEMMs), FLOPs counted on
active parameters N (routed experts at top_k / num_experts, embeddings excluded, attention scores and
LoRA's own matmuls left out) over all T tokens:
  mfu_6n  = 6 N T: the usual training convention (forward 2NT + backward 4NT); the figure held to the goal;
  mfu_4n  = 4 N T: what LoRA training computes on the frozen base (forward + input gradients, no weight
            gradients), so the share of the GPU actually busy with useful matmuls;
  log_probs: 2 N T.
Recomputation by activation checkpointing is not counted (model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

import numpy as np

from bench.common import log

MICRO_BATCH_TOKENS = 16384


def parse_ac(text: str) -> list[bool | float]:
    """`on,off,0.5` -> [True, False, 0.5]: whole-layer activation checkpointing, none, or none with the
    compiled layers' partitioner recomputing within that memory budget (trainer.activation_memory_budget)."""
    out = []
    for item in str(text).split(","):
        if item in ("on", "off"):
            out.append(item == "on")
            continue
        try:
            budget = float(item)
        except ValueError:
            budget = -1.0
        if not 0 < budget <= 1:
            raise ValueError(f"expected on, off or a memory budget in (0, 1], got {item!r}")
        out.append(budget)
    return out


def ac_fields(ac: bool | float) -> dict:
    """A setting of parse_ac as its rows record it: whole-layer checkpointing, and the budget (0 = none)."""
    budget = 0.0 if isinstance(ac, bool) else float(ac)
    return {"activation_checkpointing": ac is True, "activation_memory_budget": budget}


def ac_tag(ac: bool | float) -> str:
    return f"budget{ac:g}" if not isinstance(ac, bool) else f"ac{int(ac)}"


def trainer_spec(
    model_path: str,
    model_name: str,
    rank: int,
    targets: str,
    tiny: bool,
    ac: bool | float = False,
    max_seq_len: int = 4096,
    micro_batch_tokens: int = MICRO_BATCH_TOKENS,
    compile: bool = False,
):
    from trainer.spec import LoraSpec, OptimSpec, TrainerSpec

    lora = LoraSpec(
        rank=rank,
        alpha=2.0 * rank,
        experts=targets == "all",
        latent=targets == "all" and model_name == "muse",
    )
    return TrainerSpec(
        model_path=model_path,
        dtype="float32" if tiny else "bfloat16",
        lora=lora,
        optim=OptimSpec(lr=1e-5, total_steps=1000),
        micro_batch_tokens=max(micro_batch_tokens, max_seq_len),
        max_seq_len=max_seq_len,
        r3=True,
        **ac_fields(ac),
        compile=compile,
        seed=0,
    )


def make_samples(
    n: int, seq_len: int, prompt_len: int, vocab: int, layers: int, top_k: int, experts: int, seed: int = 0
) -> list:
    from rl.batch import Sample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = rng.integers(10, vocab - 1, size=seq_len).tolist()
        # top_k distinct experts per (token, layer): k consecutive ids from a random start (uniform load)
        start = rng.integers(0, experts, size=(seq_len - 1, layers, 1))
        routed = ((start + np.arange(top_k)) % experts).astype(np.uint8 if experts <= 256 else np.uint16)
        response = ids[prompt_len:]
        out.append(
            Sample(
                ids[:prompt_len],
                response,
                np.full(len(response), -1.0, np.float32),
                "length",
                0,
                i,
                routed_experts=routed,
            )
        )
    return out


def run(
    host,
    trainer: str,
    model: dict,
    args,
    matmul: dict,
    micro_batch_tokens: int = MICRO_BATCH_TOKENS,
    profile: bool = False,
    ac: bool | float = True,
    compile: bool = False,
) -> dict:
    cfg = model["config"]
    experts = cfg.get("num_experts") or cfg["num_local_experts"]  # Qwen3-MoE saves the latter
    samples = make_samples(
        args.train_samples,
        args.train_seq_len,
        args.train_prompt_len,
        cfg["vocab_size"],
        cfg["num_hidden_layers"],
        cfg["num_experts_per_tok"],
        experts,
    )
    tokens = args.train_samples * args.train_seq_len
    r = host.call("train_bench", trainer, samples, args.train_warmup, args.train_steps, profile)
    n, rate = model["params"]["active"], matmul["tflops"] * 1e12
    row = {
        "samples": args.train_samples,
        "seq_len": args.train_seq_len,
        "tokens": tokens,
        "micro_batch_tokens": micro_batch_tokens,
        **ac_fields(ac),
        "compile": compile,
        "lora_rank": 32,
        "lora_targets": "all",
        "r3_replay": True,
        "active_params": n,
        "total_params": model["params"]["total"],
        "matmul_tflops": matmul["tflops"],
        "train_tokens_per_s": tokens / r["train_step_s"],
        "log_probs_tokens_per_s": tokens / r["log_probs_s"],
        "mfu_6n": 6 * n * tokens / r["train_step_s"] / rate,
        "mfu_4n": 4 * n * tokens / r["train_step_s"] / rate,
        "log_probs_mfu_2n": 2 * n * tokens / r["log_probs_s"] / rate,
        **r,
    }
    for key, what in (("profile", "train step"), ("profile_log_probs", "log-probs")):
        if key not in r:
            continue
        p = r[key]
        top = ", ".join(f"{o['name'][:40]} {o['device_ms']:.0f}ms" for o in p["top_ops"][:5])
        host = ", ".join(f"{o['name'][:40]} {o['cpu_ms']:.0f}ms" for o in p.get("top_host_ops", [])[:5])
        log(
            f"    profile {what}: device busy {p['device_busy_fraction'] or 0:.0%} of {p['wall_s']:.2f}s; "
            f"top: {top}; host ops {p.get('host_ops_s', 0):.2f}s: {host}"
        )
    for key, what in (("sync_sites", "train step"), ("sync_sites_log_probs", "log-probs")):
        if r.get(key):
            sites = "; ".join(f"{s['calls']}x {s['site']}" for s in r[key][:6])
            log(f"    host waits for the device, {what}: {sites}")
    log(
        f"    trainer (micro-batch {micro_batch_tokens} tokens, {ac_tag(ac)}, compile {compile}): "
        f"{row['train_tokens_per_s']:.0f} tok/s train step, MFU(6N) {row['mfu_6n']:.1%}, "
        f"MFU(4N) {row['mfu_4n']:.1%}, log-probs {row['log_probs_tokens_per_s']:.0f} tok/s, "
        f"peak {r.get('peak_allocated_gib', float('nan')):.1f} GiB"
    )
    return row
