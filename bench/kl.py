"""Rollout-trainer mismatch: `rollout_corr/k3_kl` of sampled responses, as a training step measures it.

Responses are sampled from the config's training prompts (`data.train`, `rollout.*` sampling) after the
trainer's policy is synced to the engines; the trainer scores the same tokens (the driver's step 4,
rl.driver.mismatch_metrics), with k3 = mean over response tokens of exp(d) - d - 1, d = logp_trainer -
logp_rollout. Rows:
  r3_on        the rollout's routing replayed in the trainer (`r3.enabled`; the step's own figure);
  r3_off       the same samples with live routing in the trainer (what R3 buys);
  same_engine  the engine's sampled log-probs against its own prefill (teacher-forced) log-probs of the same
               sequences: the kernels' own noise, the lowest a trainer could reach.
With `model.rollout_path` an NVFP4 checkpoint and `model.path` its BF16 twin, the rows hold the quantization
gap too. A row keeps each sample's k3 sum and token count, so that r3_on and r3_off, which score the same
samples, can be compared pairwise.

    python -m bench.kl RECIPE [key=value ...] --prompts 128
"""

from __future__ import annotations

import numpy as np

from bench.common import Bench, main, sync_adapter


def _row(name: str, trainer_logp: list, samples: list, extra: dict | None = None) -> dict:
    from rl.core import algo
    from rl.monitor import mismatch_tensors

    padded = mismatch_tensors(trainer_logp, samples)
    m = algo.rollout_mismatch_metrics(*padded)
    sums, counts = algo.k3_sequence_sums(*padded)
    return {
        "row": name,
        "k3_kl": float(m["rollout_corr/k3_kl"]),
        "k3_kl_max_token": float(m["rollout_corr/k3_kl_max"]),
        "abs_logp_diff_p99": float(m["rollout_corr/abs_logp_diff_p99"]),
        "samples": len(samples),
        "response_tokens": int(sum(len(s.response_ids) for s in samples)),
        **(extra or {}),
        "k3_seq_sums": [float(f"{v:.6g}") for v in sums.tolist()],
        "seq_tokens": [int(v) for v in counts.tolist()],
    }


def measure(s, args) -> list[dict]:
    from rl.setup import load_prompts_for, prompt_requests, sampling_spec

    cfg = s.cfg
    sync_adapter(s, 1)
    prompts = load_prompts_for(cfg, cfg.data.train, s.tokenizer, "bench-kl", args.prompts)[: args.prompts]
    samples = s.rollout.generate(prompt_requests(prompts), sampling_spec(cfg, seed=args.seed))
    samples = [x for x in samples if x.response_ids]
    rows = []
    for name, replay in (("r3_on", True), ("r3_off", False)):
        if not replay and not cfg.r3.enabled:
            continue
        scored = samples if replay else [x.without_routing() for x in samples]
        logp, m = s.trainer.log_probs(scored)
        extra = {
            "r3_replayed_fraction": m.get("r3/replayed_fraction", 0.0),
            "trainer_entropy": m["actor/entropy"],
        }
        rows.append(_row(name if cfg.r3.enabled else "r3_disabled", logp, scored, extra))
    seqs = [x.prompt_ids + x.response_ids for x in samples]
    prefill = s.rollout.prompt_logprobs(seqs, use_adapter=cfg.sync.mode == "adapter")
    rescored = [np.asarray(lp)[len(lp) - len(x.response_ids) :] for lp, x in zip(prefill, samples)]
    rows.append(_row("same_engine", rescored, samples))
    return rows


def _args(p) -> None:
    p.add_argument("--prompts", type=int, default=128, help="prompts taken from data.train")
    p.add_argument("--seed", type=int, default=1, help="the sampling seed")


BENCH = Bench(
    name="kl",
    doc=__doc__.splitlines()[0],
    columns=(
        "row",
        "k3_kl",
        "k3_kl_max_token",
        "abs_logp_diff_p99",
        "samples",
        "response_tokens",
        "r3_replayed_fraction",
    ),
    measure=measure,
    add_args=_args,
)

if __name__ == "__main__":
    raise SystemExit(main(BENCH))
