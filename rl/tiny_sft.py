"""`make-tiny --sft arith`: fit a tiny model to noisy arithmetic so that it starts as a mediocre policy.

The targets state a wrong result (off by 1 to 3) for `noise` of the rows, so a model that fits them
samples the right answer about (1 - noise) of the time at temperature 1: the held-out accuracy lands in
the 0.3-0.6 band that the CPU demo then lifts with GRPO, much as the reference run lifts AIME.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from rl.data.arith import ArithSpec, make_rows, sft_response

SPEC = ArithSpec(num_terms=2, max_operand=9, ops="+-")
NOISE = 0.3
STEPS = 500
BATCH = 64
LR = 3e-3
EVAL_PROBLEMS = 256
ACC_BAND = (0.3, 0.6)
PROGRESS_EVERY = 0.05  # without a terminal: a progress line every 5% of the steps


def _encode(tokenizer, row: dict, response: str) -> tuple[list[int], list[int]]:
    prompt_ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
    if hasattr(prompt_ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        prompt_ids = prompt_ids["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return list(prompt_ids), response_ids


def _batch(pairs, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 outside the response)."""
    width = max(len(p) + len(r) for p, r in pairs)
    ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    mask = torch.zeros((len(pairs), width), dtype=torch.long)
    for i, (p, r) in enumerate(pairs):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r)
        labels[i, len(p) : n] = torch.tensor(r)
        mask[i, :n] = 1
    return ids, mask, labels


@contextmanager
def _progress(steps: int) -> Iterator[Callable[[float], None]]:
    """A live bar on a terminal; otherwise (a log file, CI, a pipe) a plain line every PROGRESS_EVERY of the
    steps, so that the minutes of training do not pass in silence."""
    if sys.stdout.isatty():
        with Progress(
            TextColumn("sft arith"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} loss {task.fields[loss]:.3f}"),
            TimeElapsedColumn(),
        ) as progress:
            task = progress.add_task("sft", total=steps, loss=float("nan"))
            yield lambda loss: progress.update(task, advance=1, loss=loss)
        return
    every, done, start = max(1, round(steps * PROGRESS_EVERY)), [0], time.perf_counter()

    def advance(loss: float) -> None:
        done[0] += 1
        if done[0] % every == 0 or done[0] == steps:
            print(
                f"sft arith: step {done[0]}/{steps} ({100 * done[0] / steps:.0f}%), loss {loss:.3f}, "
                f"{time.perf_counter() - start:.0f} s",
                flush=True,
            )

    yield advance


def train(model, tokenizer, seed: int, steps: int = STEPS, noise: float = NOISE) -> dict:
    """Fine-tune `model` in place; returns a report with the held-out sampled accuracy."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    rows = make_rows(steps * BATCH, seed, SPEC, split="sft")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = steps // 20
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model.train()
    start = time.perf_counter()
    with _progress(steps) as advance:
        for step in range(steps):
            chunk = rows[step * BATCH : (step + 1) * BATCH]
            ids, mask, labels = _batch(
                [_encode(tokenizer, r, sft_response(r, rng, noise)) for r in chunk], tokenizer.pad_token_id
            )
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            advance(loss.item())
    train_s = time.perf_counter() - start
    model.eval()
    acc = heldout_accuracy(model, tokenizer, seed)
    report = {
        "steps": steps,
        "batch": BATCH,
        "noise": noise,
        "final_loss": loss.item(),
        "train_s": round(train_s, 1),
        "heldout_acc": acc,
        "heldout_problems": EVAL_PROBLEMS,
        "acc_band": list(ACC_BAND),
    }
    print(
        f"sft arith: held-out sampled accuracy {acc:.3f} on {EVAL_PROBLEMS} problems "
        f"(band {ACC_BAND[0]}-{ACC_BAND[1]}), {train_s:.0f} s of training"
    )
    return report


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded input ids and attention mask: generation continues every row from the same column."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


@torch.no_grad()
def heldout_accuracy(
    model,
    tokenizer,
    seed: int,
    n: int = EVAL_PROBLEMS,
    temperature: float = 1.0,
    sample_seed: int | None = None,
) -> float:
    """Sampled (temperature 1) accuracy on held-out problems of `seed`, scored by rl.reward (math_dapo)."""
    from rl.reward import score

    rows = make_rows(n, seed, SPEC, split="heldout")
    ids, mask = left_pad([_encode(tokenizer, r, "")[0] for r in rows], tokenizer.pad_token_id)
    width = ids.shape[1]
    torch.manual_seed(seed if sample_seed is None else sample_seed)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        max_new_tokens=24,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    correct = [score(t, r["reward_model"]["ground_truth"])["acc"] for t, r in zip(texts, rows)]
    return sum(correct) / n
