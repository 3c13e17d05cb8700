"""Rollout-trainer mismatch: `rollout_corr/k3_kl` on teacher-forced sampled responses.

Responses are sampled (temperature 1, the sampled token's log-prob kept, as in a real step) on held-out
arithmetic prompts, from the SFT'd model whose outputs are peaked; the trainer then scores the same
tokens (TrainerWorker.log_probs, as in step 4 of the design) and k3 = mean over response tokens of
exp(d) - d - 1, d = logp_trainer - logp_rollout (rl.driver.mismatch_metrics, the driver's own code).

Rows:
  nvfp4_r3_on   NVFP4 + LoRA engine with routing capture; trainer on the BF16 dequantization with the
                same adapter, the rollout's routing replayed;
  nvfp4_r3_off  the same samples and trainer, live routing (what R3 buys);
  floor_bf16    BF16 engine vs a trainer on the same BF16 weights (live routing; no quantization at all);
  floor_same_engine_<engine>  the engine's sampling log-probs vs its own teacher-forced (prefill)
                log-probs of the same tokens: the kernels' own noise, the lowest a trainer could reach.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from bench.common import log


def arith_requests(tokenizer_path: str, n: int, max_operand: int) -> list:
    from transformers import AutoTokenizer

    from rl.data.arith import ArithSpec, make_rows
    from rollout.spec import PromptRequest

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    rows = make_rows(n, 0, ArithSpec(num_terms=2, max_operand=max_operand, ops="+-"), split="bench-kl")
    out = []
    for i, r in enumerate(rows):
        ids = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        out.append(PromptRequest(list(ids), i, r["data_source"], r["reward_model"]["ground_truth"]))
    return out


def collect(worker, requests: list, n: int, max_tokens: int, seed: int = 1) -> list:
    from rollout.spec import SamplingSpec

    samples = worker.generate(requests, SamplingSpec(n=n, temperature=1.0, max_tokens=max_tokens, seed=seed))
    # A response of one token has nothing to compare after the prompt; keep the rest.
    return [s for s in samples if len(s.response_ids) >= 1]


def _summary(trainer_logp: list, samples: list) -> dict:
    """A KL row: the driver's `rollout_corr/*` figures, and each sample's k3 sum and token count, so that two
    rows that scored the same samples (R3 on and off) compare pairwise (bench.goals.kl_goal)."""
    from rl import algo
    from rl.driver import mismatch_tensors

    padded = mismatch_tensors(trainer_logp, samples)  # once, for both figures (the driver's own padding)
    metrics = algo.rollout_mismatch_metrics(*padded)
    sums, counts = algo.k3_sequence_sums(*padded)
    return {
        "k3_kl": metrics["rollout_corr/k3_kl"],
        "k3_kl_max_token": metrics["rollout_corr/k3_kl_max"],
        "abs_logp_diff_p50": metrics["rollout_corr/abs_logp_diff_p50"],
        "abs_logp_diff_p99": metrics["rollout_corr/abs_logp_diff_p99"],
        "log_ppl_abs_diff": metrics["rollout_corr/log_ppl_abs_diff"],
        "samples": len(samples),
        "response_tokens": int(sum(len(s.response_ids) for s in samples)),
        "mean_response_logp": float(np.mean(np.concatenate([s.response_logprobs for s in samples]))),
        "k3_seq_sums": [float(f"{v:.6g}") for v in sums.tolist()],
        "seq_tokens": [int(v) for v in counts.tolist()],
    }


def nonfinite_report(logps: list, samples: list) -> str | None:
    """Where prefill log-probs (one array per prompt + response, `prompt_logprobs` layout) are NaN or inf,
    in words; None when all are finite. Qwen3-MoE's NVFP4 + LoRA engine gave NaN/inf for most response
    tokens of its own samples on the H200 (the tenth session) while sampling them was fine: this says which
    kind, where in the sequence it starts, and how many sequences, so that the next run can tell a kernel
    that breaks past some length from one that breaks for every token."""
    flat = np.concatenate([np.asarray(lp, dtype=np.float64) for lp in logps])
    if np.isfinite(flat).all():
        return None
    first_bad, bad_in_response, seq_len = [], 0, []
    for lp, s in zip(logps, samples):
        lp = np.asarray(lp, dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(lp))
        if len(bad):
            first_bad.append(int(bad[0]) + 1)  # position in the sequence (entry 0 scores token 1)
            seq_len.append(len(lp) + 1)
            bad_in_response += int(np.sum(bad >= len(lp) - len(s.response_ids)))
    return (
        f"{int(np.isnan(flat).sum())} NaN, {int(np.isneginf(flat).sum())} -inf, "
        f"{int(np.isposinf(flat).sum())} +inf of {flat.size} positions ({bad_in_response} in responses); "
        f"{len(first_bad)} of {len(samples)} sequences; first bad position median {np.median(first_bad):.0f} "
        f"(min {min(first_bad)}, max {max(first_bad)}) of lengths median {np.median(seq_len):.0f} "
        f"(prompt median {np.median([len(s.prompt_ids) for s in samples]):.0f})"
    )


def same_engine_floor(worker, samples: list) -> dict:
    """The engine's sampled log-probs against its own prefill log-probs of the same sequences. Non-finite
    prefill log-probs fail with nonfinite_report's account, with and without the adapter (is it LoRA's?)."""
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    full = worker.prompt_logprobs(seqs, use_adapter=True)
    broken = nonfinite_report(full, samples)
    if broken:
        without = nonfinite_report(worker.prompt_logprobs(seqs, use_adapter=False), samples)
        raise ValueError(
            f"prefill log-probs not finite: with the adapter {broken}; without it {without or 'all finite'}"
        )
    rescored = [lp[len(lp) - len(s.response_ids) :] for lp, s in zip(full, samples)]
    return _summary(rescored, samples)


def adapter_effect(worker, samples: list) -> float:
    """Mean |logp with the adapter - logp without| over response tokens: the adapter is really applied."""
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    with_a = worker.prompt_logprobs(seqs, use_adapter=True)
    without = worker.prompt_logprobs(seqs, use_adapter=False)
    diffs = [
        np.abs(a[-len(s.response_ids) :] - b[-len(s.response_ids) :])
        for a, b, s in zip(with_a, without, samples)
    ]
    return float(np.concatenate(diffs).mean())


def score(host, trainer: str, samples: list, replay: bool) -> dict:
    """The trainer's log-probs of `samples` (routing replayed or live) against the rollout's."""
    if not replay:
        samples = [dataclasses.replace(s, routed_experts=None) for s in samples]
    logp, metrics, seconds = host.call("log_probs", trainer, samples)
    row = _summary(logp, samples)
    row.update(
        r3_replayed_fraction=metrics["r3/replayed_fraction"],
        trainer_entropy=metrics["actor/entropy"],
        trainer_s=seconds,
    )
    log(
        f"    k3 {trainer} replay={replay}: {row['k3_kl']:.3e} over {row['response_tokens']} tokens "
        f"(entropy {row['trainer_entropy']:.3f}, replayed {row['r3_replayed_fraction']:.2f})"
    )
    return row
