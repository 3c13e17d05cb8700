"""The benchmark models: a Muse-shaped and a Qwen3-MoE-shaped MoE sized for one H200, built from a seed.

Each is random init, then a short supervised fine-tune on 2-digit arithmetic (rl.data.arith) so that its
outputs are peaked: a random model has near-tied logits, and then NVFP4-vs-BF16 KL and routing agreement
measure noise, not the quantization (docs/benchmarks.md, "Setup"). Three copies are written per model:
`bf16/` (the SFT result), `nvfp4/` (rl.quantize, weight-only NVFP4) and `dq/` (its exact BF16
dequantization: the trainer's base with `trainer.base_format=bf16`; `nvfp4` reads `nvfp4/` packed). The
tokenizer is rl.tiny's local BPE (vocab ~1k), so the LM head is negligible and the figures are those of the
decoder layers.

Built once into `<root>/<name>-<hash>/` (the hash covers the spec and BUILD_VERSION); a later call reuses it,
and `<root>/<name>` links to the last one built or reused.
`python -m bench.models --root DIR [--tiny] [--models muse,qwen3_moe]` builds them on their own.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

SEED = 0
BUILD_VERSION = 1  # bump when a change here changes what is built (the directory name hashes it)


@dataclass(frozen=True)
class ModelSpec:
    name: str  # "muse" or "qwen3_moe"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    moe_intermediate: int
    latent: int = 0  # Muse only: the pooler's width
    sliding_window: int = 0  # Muse only
    sft_steps: int = 150
    sft_batch: int = 64
    sft_lr: float = 3e-4
    max_operand: int = 99  # the arithmetic the SFT (and the GRPO run) uses: 2 terms, + and -


# Muse keeps the announced model's proportions: 1.5x wider queries than the hidden size, GQA 12:1, experts
# working at half the hidden width with intermediate = latent. ~3.5B parameters, ~0.7B active.
MUSE = ModelSpec(
    "muse",
    hidden=2048,
    layers=16,
    heads=24,
    kv_heads=2,
    head_dim=128,
    experts=64,
    top_k=8,
    moe_intermediate=1024,
    latent=1024,
    sliding_window=512,
)
# Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 KV heads of 128, experts of 768, top-8) with 16 layers and
# 64 experts instead of 48 and 128: ~5.1B parameters, ~0.9B active.
QWEN3_MOE = ModelSpec(
    "qwen3_moe",
    hidden=2048,
    layers=16,
    heads=32,
    kv_heads=4,
    head_dim=128,
    experts=64,
    top_k=8,
    moe_intermediate=768,
)
# --tiny (CPU): rl.tiny's sizes; the SFT only has to run, not to converge.
TINY = {
    "muse": ModelSpec(
        "muse",
        hidden=128,
        layers=8,
        heads=4,
        kv_heads=2,
        head_dim=32,
        experts=8,
        top_k=2,
        moe_intermediate=64,
        latent=64,
        sliding_window=16,
        sft_steps=12,
        sft_batch=16,
        sft_lr=3e-3,
    ),
    "qwen3_moe": ModelSpec(
        "qwen3_moe",
        hidden=128,
        layers=4,
        heads=4,
        kv_heads=2,
        head_dim=32,
        experts=8,
        top_k=2,
        moe_intermediate=64,
        sft_steps=12,
        sft_batch=16,
        sft_lr=3e-3,
    ),
}
FULL = {"muse": MUSE, "qwen3_moe": QWEN3_MOE}
NAMES = tuple(FULL)


def spec_for(name: str, tiny: bool) -> ModelSpec:
    if name not in FULL:
        raise ValueError(f"bench: unknown model {name!r}; known: {', '.join(NAMES)}")
    return (TINY if tiny else FULL)[name]


def hf_config(spec: ModelSpec, vocab_size: int, eos_id: int, pad_id: int):
    from transformers import Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        num_experts=spec.experts,
        num_experts_per_tok=spec.top_k,
        moe_intermediate_size=spec.moe_intermediate,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        initializer_range=0.02,
    )
    if spec.name == "muse":
        from rl.models.muse import MuseSparkConfig

        return MuseSparkConfig(moe_latent_size=spec.latent, sliding_window=spec.sliding_window, **common)
    return Qwen3MoeConfig(intermediate_size=4 * spec.hidden, **common)


def active_params(config) -> dict[str, int]:
    """Parameters a token goes through: everything but the embedding table, with the routed experts counted
    top_k / num_experts (MFU convention: FLOPs = 2 * active per token forward)."""
    from rl.models import auto_causal_lm

    with torch.device("meta"):
        model = auto_causal_lm().from_config(config)
    total = active = 0
    share = config.num_experts_per_tok / config.num_experts
    for name, p in model.named_parameters():
        total += p.numel()
        if "embed_tokens" in name:
            continue
        active += p.numel() * share if ".experts." in name else p.numel()
    return {"total": int(total), "active": int(active)}


# ----------------------------------------------------------------------------------------------------
# Build.


def model_dir(root: Path, spec: ModelSpec) -> Path:
    h = hashlib.sha256(json.dumps([BUILD_VERSION, dataclasses.asdict(spec)], sort_keys=True).encode())
    return Path(root) / f"{spec.name}-{h.hexdigest()[:12]}"


def link_latest(root: Path, spec: ModelSpec) -> Path:
    """`<root>/<name>` -> the model's build directory, replaced in one rename: the fixed path that configs
    name (bench/bench_models_1gpu.yaml: `<root>/qwen3_moe/nvfp4`). It follows the last build or reuse, full
    size or `--tiny`."""
    link = Path(root) / spec.name
    tmp = Path(root) / f".{spec.name}.link"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(model_dir(root, spec).name)
    os.replace(tmp, link)
    return link


def build(spec: ModelSpec, root: Path, log=print) -> dict:
    """Build (or reuse) the model's bf16/, nvfp4/ and dq/ copies; returns build.json's contents.
    `<root>/<name>` then links to them (link_latest)."""
    d = model_dir(root, spec)
    done = d / "build.json"
    if done.exists():
        info = json.loads(done.read_text())
        log(f"model {spec.name}: reusing {d}")
        link_latest(root, spec)
        return info
    import shutil

    from transformers import AutoModelForCausalLM

    from rl.tiny import EOS_TOKEN, PAD_TOKEN, train_tokenizer

    shutil.rmtree(d, ignore_errors=True)  # a half-built one from a killed run
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0 = time.time()
    tokenizer = train_tokenizer(SEED)
    config = hf_config(
        spec,
        -(-len(tokenizer) // 64) * 64,
        tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    )
    torch.manual_seed(SEED)
    try:  # initialise on the GPU: seconds instead of a minute for billions of weights
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as e:  # noqa: BLE001 - slower but sure
        log(f"model {spec.name}: init on {device} failed ({type(e).__name__}: {e}); on CPU instead")
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    log(f"model {spec.name}: init on {device} in {time.time() - t0:.1f}s; SFT {spec.sft_steps} steps")
    report = sft(model, tokenizer, spec, device, log)
    t1 = time.time()
    model.save_pretrained(d / "bf16")
    tokenizer.save_pretrained(d / "bf16")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    t2 = time.time()
    try:
        quantize_and_dequantize(d, device)
    except Exception as e:  # noqa: BLE001 - the CPU path is rl.quantize's own, tested one
        if device == "cpu":
            raise
        log(
            f"model {spec.name}: NVFP4 conversion on {device} failed ({type(e).__name__}: {e}); "
            "on CPU instead"
        )
        for sub in ("nvfp4", "dq"):
            shutil.rmtree(d / sub, ignore_errors=True)
        quantize_and_dequantize(d, "cpu")
    t3 = time.time()
    info = {
        "spec": dataclasses.asdict(spec),
        "dir": str(d),
        "bf16": str(d / "bf16"),
        "nvfp4": str(d / "nvfp4"),
        "dq": str(d / "dq"),
        "params": active_params(config),
        "sft": report,
        "device": device,
        "seconds": {
            "sft": report["train_s"],
            "save": round(t2 - t1, 1),
            "quantize": round(t3 - t2, 1),
            "total": round(t3 - t0, 1),
        },
        "bytes": {k: _dir_bytes(d / k) for k in ("bf16", "nvfp4", "dq")},
    }
    done.write_text(json.dumps(info, indent=1))
    link_latest(root, spec)
    log(
        f"model {spec.name}: built in {t3 - t0:.0f}s (sft {report['train_s']}s, quantize {t3 - t2:.0f}s); "
        f"final loss {report['final_loss']:.3f}, held-out acc {report['heldout_acc']:.2f}, "
        f"entropy {report['response_entropy']:.3f} nats/token"
    )
    return info


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


class _OnDevice:
    """A compressed-tensors converter whose tensor math runs on `device` (the CPU path takes minutes for
    billions of weights; the GPU path seconds). Everything but `process` is the wrapped converter's."""

    def __init__(self, inner, device: str):
        self.inner, self.device = inner, device

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def process(self, tensors):
        out = self.inner.process({k: v.to(self.device) for k, v in tensors.items()})
        return {k: v.cpu() for k, v in out.items()}


def quantize_and_dequantize(d: Path, device: str) -> None:
    """nvfp4/ = rl.quantize's converter (its ignore list, e.g. Muse's head gate); dq/ = its BF16 twin."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    from rl.quantize import quantizer_for
    from trainer.nvfp4 import _convert_atomically

    _convert_atomically(d / "bf16", d / "nvfp4", lambda src: _OnDevice(quantizer_for(src), device))
    _convert_atomically(
        d / "nvfp4",
        d / "dq",
        lambda src: _OnDevice(CompressedTensorsDequantizer(src, dtype=torch.bfloat16), device),
    )


# ----------------------------------------------------------------------------------------------------
# The short SFT (rl.tiny_sft's task and batching, on the GPU, clean targets: peaked outputs).


def sft_rows(spec: ModelSpec, n: int, split: str):
    from rl.data.arith import ArithSpec, make_rows

    return make_rows(n, SEED, ArithSpec(num_terms=2, max_operand=spec.max_operand, ops="+-"), split=split)


def sft(model, tokenizer, spec: ModelSpec, device: str, log) -> dict:
    from rl.data.arith import sft_response
    from rl.tiny_sft import _batch, _encode

    rng = random.Random(SEED)
    rows = sft_rows(spec, spec.sft_steps * spec.sft_batch, "sft")
    # bf16 weights and Adam state on the GPU: half the memory of fp32 master weights, and 100 steps of a
    # toy task do not need more precision.
    opt = torch.optim.AdamW(model.parameters(), lr=spec.sft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, spec.sft_steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * 0.5
            * (1 + math.cos(math.pi * min(s, spec.sft_steps) / spec.sft_steps))
        ),
    )
    model.train()
    start = time.time()
    losses = []
    for step in range(spec.sft_steps):
        chunk = rows[step * spec.sft_batch : (step + 1) * spec.sft_batch]
        ids, mask, labels = _batch(
            [_encode(tokenizer, r, sft_response(r, rng)) for r in chunk], tokenizer.pad_token_id
        )
        loss = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 25 == 0 or step == spec.sft_steps - 1:
            log(f"  sft {spec.name} step {step}: loss {losses[-1]:.3f}")
    del opt
    train_s = round(time.time() - start, 1)
    model.eval()
    acc, entropy = heldout(model, tokenizer, spec, device)
    return {
        "steps": spec.sft_steps,
        "batch": spec.sft_batch,
        "lr": spec.sft_lr,
        "train_s": train_s,
        "final_loss": sum(losses[-5:]) / len(losses[-5:]),
        "heldout_acc": acc,
        "response_entropy": entropy,
        "task": f"arith 2 terms, operands 0..{spec.max_operand}, + and -",
    }


@torch.no_grad()
def heldout(model, tokenizer, spec: ModelSpec, device: str, n: int = 64) -> tuple[float, float]:
    """(sampled accuracy at temperature 1, mean entropy of the next-token distribution over the sampled
    response tokens, in nats): how peaked the model is where the benchmarks sample it."""
    from rl.reward import score
    from rl.tiny_sft import _encode, left_pad

    rows = sft_rows(spec, n, "heldout")
    ids, mask = left_pad([_encode(tokenizer, r, "")[0] for r in rows], tokenizer.pad_token_id)
    width = ids.shape[1]
    torch.manual_seed(SEED)
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=24,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    seq = out.sequences[:, width:]
    ended = (seq == tokenizer.eos_token_id).cumsum(-1)
    live = (ended == 0) | ((ended == 1) & (seq == tokenizer.eos_token_id))  # up to and including the EOS
    logp = torch.stack(out.scores, dim=1).float().log_softmax(-1)
    ent = -(logp.exp() * logp).sum(-1)
    entropy = float(ent[live].mean())
    texts = tokenizer.batch_decode(seq, skip_special_tokens=True)
    acc = sum(score(t, r["reward_model"]["ground_truth"])["acc"] for t, r in zip(texts, rows)) / n
    return float(acc), entropy


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.models", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default="/tmp/sparkrl_bench/models")
    p.add_argument("--models", default=",".join(NAMES))
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    for name in args.models.split(","):
        print(json.dumps(build(spec_for(name, args.tiny), Path(args.root)), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
