"""Rollout throughput: output tokens/s at batch 1 to 256 on one engine.

Each request is a distinct random prompt (no prefix-cache hits) that generates exactly `output_len`
tokens (`ignore_eos`), sampled at temperature 1 with a per-request seed (none for an engine configuration
with `request_seeds=False`) and the sampled token's log-prob,
as `RolloutWorker.generate` asks for them; the timed region also holds the conversions `generate` does on
the outputs (log-prob extraction, and with R3 the routed-experts check), since they are part of what R3
costs a real rollout. Before timing, every batch size runs once with a few tokens, so that kernel
compilation and autotuning at new shapes (Triton MoE / LoRA kernels) stay out of the timed runs; then each
batch size is timed REPEATS times on fresh prompts and the median is the figure (single runs differed by
up to 4x at small batches on the H200, and three repeats still by 2.5x, which made a 3 % R3 budget
unreadable).
"""

from __future__ import annotations

import time

import numpy as np

from bench.common import log

WARMUP_TOKENS = 4
REPEATS = 5


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(10, vocab - 1, size=(batch, prompt_len)).tolist()


def timed_generate(worker, prompts: list[list[int]], output_len: int, seed: int | None) -> tuple[float, int]:
    """(seconds, output tokens) of one batch through the worker's engine and adapter; request i seeded with
    seed + i (None: no request seeds, the engine's generator)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rollout.worker import check_routed_experts, sampled_logprobs

    params = [
        SamplingParams(
            n=1,
            temperature=1.0,
            top_p=1.0,
            top_k=-1,
            max_tokens=output_len,
            ignore_eos=True,
            seed=None if seed is None else seed + i,
            logprobs=0,
            detokenize=False,  # as RolloutWorker.generate asks
        )
        for i in range(len(prompts))
    ]
    capture = worker.spec.return_routed_experts and worker.info.is_moe
    start = time.perf_counter()
    outs = worker.llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=worker._lora, use_tqdm=False
    )
    tokens = 0
    for p, out in zip(prompts, outs):
        c = out.outputs[0]
        ids = list(c.token_ids)
        tokens += len(ids)
        sampled_logprobs(ids, c.logprobs, "bench")
        if capture:
            check_routed_experts(
                c.routed_experts, len(p) + len(ids) - 1, worker.info.top_k, worker.info.num_experts
            )
    return time.perf_counter() - start, tokens


def rollout_row(batch: int, prompt_len: int, output_len: int, runs: list[tuple[float, int]]) -> dict:
    """One batch size's row from its timed runs, (seconds, output tokens) each: the median rate is the figure."""
    rates = [tokens / seconds for seconds, tokens in runs]
    median = float(np.median(rates))
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "output_tokens": runs[0][1],
        "repeats": len(runs),
        "seconds": [round(seconds, 4) for seconds, _ in runs],
        "tokens_per_s": median,
        "tokens_per_s_all": [round(x, 1) for x in rates],
        "ms_per_step": 1000 * batch / median,  # prefill included
    }


def sweep(
    worker,
    batch_sizes: list[int],
    prompt_len: int,
    output_len: int,
    vocab: int,
    repeats: int = REPEATS,
    request_seeds: bool = True,
) -> list[dict]:
    def seed(r: int) -> int | None:
        return r if request_seeds else None

    for b in batch_sizes:
        timed_generate(worker, _prompts(b, prompt_len, vocab, seed=10_000 + b), WARMUP_TOKENS, seed(0))
    rows = []
    for b in batch_sizes:
        runs = [
            timed_generate(worker, _prompts(b, prompt_len, vocab, seed=b + 1000 * r), output_len, seed(1 + r))
            for r in range(repeats)
        ]
        row = rollout_row(b, prompt_len, output_len, runs)
        log(
            f"    batch {b:4d}: {row['tokens_per_s']:9.1f} tok/s (median of {repeats}: "
            f"{', '.join(f'{x:.0f}' for x in row['tokens_per_s_all'])}; {row['ms_per_step']:.2f} ms/step)"
        )
        rows.append(row)
    return rows
