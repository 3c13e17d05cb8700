"""`make-tiny --sft arith_tool`: teach the arithmetic-SFT tiny model the calculator tool-call format.

A short fine-tune of the `arith` model (rl.tiny_sft) on multi-turn transcripts of rl.data.arith_tool: the
call, the tool's message, the final "Answer:". Each transcript is tokenized exactly as a rollout episode is
(the prompt's chat template, each assistant turn's ids then its end-of-turn token, each tool message as
rollout.env.continuation_ids renders it), and only the assistant's tokens carry a loss. The transcripts'
deliberate mistakes (arith_tool.NOISE) leave a policy with clear room for RL.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch

from rl.data import arith_tool
from rl.tiny_sft import _batch, _encode

STEPS = 200
BATCH = 32
LR = 3e-3


def sources() -> list[Path]:
    """The files whose bytes the model depends on beyond the `arith` model's (rl.tiny.cache_key)."""
    return [Path(__file__), Path(arith_tool.__file__)]


def encode(tokenizer, row: dict, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, labels) of the prompt and `messages` as one episode's tokens; labels -100 off the assistant's."""
    from rollout.env import continuation_ids

    eos = tokenizer.eos_token_id
    ids = _encode(tokenizer, row, "")[0]
    labels = [-100] * len(ids)
    for m in messages:
        if m["role"] == "assistant":
            turn = tokenizer(m["content"], add_special_tokens=False)["input_ids"] + [eos]
            ids, labels = ids + turn, labels + turn
        else:
            cont = continuation_ids(tokenizer, [m], eos)
            ids, labels = ids + cont, labels + [-100] * len(cont)
    return ids, labels


def train(model, tokenizer, seed: int, steps: int = STEPS) -> dict:
    """Fine-tune `model` in place on `steps` batches of transcripts; returns a report."""
    torch.manual_seed(seed)
    rng = random.Random(f"{seed}/arith_tool")
    rows = arith_tool.make_tool_rows(steps * BATCH, seed, split="sft")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    kinds: dict[str, int] = {}
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        pairs = []
        for r in rows[step * BATCH : (step + 1) * BATCH]:
            kind, messages = arith_tool.transcript(r, rng)
            kinds[kind] = kinds.get(kind, 0) + 1
            pairs.append(encode(tokenizer, r, messages))
        ids, mask, labels = _batch_labelled(pairs, tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % max(1, steps // 10) == 0 or step + 1 == steps:  # minutes need not pass in silence
            print(
                f"sft arith_tool: step {step + 1}/{steps}, loss {loss.item():.3f}, "
                f"{time.perf_counter() - start:.0f} s",
                flush=True,
            )
    train_s = time.perf_counter() - start
    model.eval()
    report = {
        "base": "arith",
        "steps": steps,
        "batch": BATCH,
        "lr": LR,
        "noise": arith_tool.NOISE,
        "transcripts": dict(sorted(kinds.items())),
        "final_loss": loss.item(),
        "train_s": round(train_s, 1),
    }
    print(f"sft arith_tool: final loss {loss.item():.3f}, {train_s:.0f} s of training")
    return report


def _batch_labelled(pairs, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and the labels `encode` gave (-100 on the padding)."""
    ids, mask, labels = _batch([(p, []) for p, _ in pairs], pad_id)
    for i, (_, lab) in enumerate(pairs):
        labels[i, : len(lab)] = torch.tensor(lab)
    return ids, mask, labels
