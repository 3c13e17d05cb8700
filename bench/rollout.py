"""Rollout throughput: output tokens/s of the rollout pool at each batch size.

Each request is a distinct random prompt of `--prompt-len` tokens (no prefix-cache hits), sampled as a
training step samples (`rollout.temperature`, a seed per request, the sampled token's log-prob, routed
experts with `r3.enabled`) for at most `--output-len` tokens, through `RolloutPool.generate`: the figure
includes the conversions the pool does on the outputs. Every batch size first runs once with a few tokens,
so that kernel compilation at new shapes stays out of the timed runs; then `--repeats` timed runs on fresh
prompts, the median rate the figure (single runs of small batches varied by up to 4x on the H200).
With `sync.mode=adapter` the trainer is started and its adapter loaded first, so LoRA is computed.

    python -m bench.rollout RECIPE [key=value ...] --batch-sizes 1,16,256 --output-len 128
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from bench.common import Bench, main, median, sync_adapter

WARMUP_TOKENS = 4


def _requests(batch: int, prompt_len: int, vocab: int, seed: int) -> list:
    from rollout.spec import PromptRequest

    ids = np.random.default_rng(seed).integers(10, vocab - 1, size=(batch, prompt_len)).tolist()
    return [PromptRequest(p, i) for i, p in enumerate(ids)]


def timed(s, batch: int, prompt_len: int, max_tokens: int, seed: int) -> tuple[float, int]:
    """(seconds, response tokens) of one batch through the pool."""
    from rollout.spec import SamplingSpec

    sampling = SamplingSpec(
        n=1,
        temperature=s.cfg.rollout.temperature,
        max_tokens=max_tokens,
        seed=seed,
        seed_scope=s.cfg.rollout.seed_scope,
    )
    requests = _requests(batch, prompt_len, len(s.tokenizer), seed)
    t = time.perf_counter()
    samples = s.rollout.generate(requests, sampling)
    return time.perf_counter() - t, sum(len(x.response_ids) for x in samples)


def measure(s, args) -> Iterator[dict]:
    if s.trainer is not None:
        sync_adapter(s, 1)
    for b in args.batch_sizes:
        timed(s, b, args.prompt_len, WARMUP_TOKENS, seed=10_000 + b)
    for b in args.batch_sizes:
        runs = [timed(s, b, args.prompt_len, args.output_len, seed=b + 1000 * r) for r in range(args.repeats)]
        rates = [tokens / seconds for seconds, tokens in runs]
        rate = median(rates)
        yield (
            {
                "batch": b,
                "prompt_len": args.prompt_len,
                "output_len": args.output_len,
                "tokens_per_s": rate,
                "ms_per_step": 1000 * b / rate,  # one decode step of the batch, prefill included
                "mean_response_tokens": float(np.mean([t for _, t in runs])) / b,
                "tokens_per_s_runs": [round(x, 1) for x in rates],
                "r3": s.cfg.r3.enabled,
                "lora": s.cfg.sync.mode == "adapter",
            }
        )


def _args(p) -> None:
    p.add_argument("--batch-sizes", type=lambda t: [int(x) for x in t.split(",")], default=[1, 16, 256])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)


BENCH = Bench(
    name="rollout",
    doc=__doc__.splitlines()[0],
    columns=(
        "batch",
        "prompt_len",
        "output_len",
        "mean_response_tokens",
        "tokens_per_s",
        "ms_per_step",
        "r3",
        "lora",
    ),
    measure=measure,
    add_args=_args,
    trainer=lambda cfg: cfg.sync.mode == "adapter",
)

if __name__ == "__main__":
    raise SystemExit(main(BENCH))
