"""Rollout-trainer mismatch: `rollout_corr/k3_kl` of sampled responses, as a training step measures it.

Responses are sampled from the config's training prompts (`data.train`, `rollout.*` sampling) after the
trainer's policy is synced to the engines; the trainer scores the same tokens (the driver's step 4,
rl.driver.mismatch_metrics), with k3 = mean over response tokens of exp(d) - d - 1, d = logp_trainer -
logp_rollout. Rows:
  r3_on        the rollout's routing replayed in the trainer (`r3.enabled`; the step's own figure);
  r3_off       the same samples with live routing in the trainer (what R3 buys);
  same_engine  the engine's sampled log-probs against its own prefill (teacher-forced) log-probs of the same
               sequences: the kernels' own noise, the lowest a trainer could reach;
  trainer_vs_fp32, rollout_vs_fp32 (`--rows` with fp32): a second trainer group computing in float32 on the
               checkpoint's weights as they are (an NVFP4 checkpoint's exact values, dequantized), with the
               same adapter and the rollout's routing replayed, scores the same samples; the trainer's and
               the engine's log-probs each against it: how far each stack's own arithmetic is from exact.
               When the two are about as large as r3_on, the step's KL is the two stacks rounding apart,
               which no change on one side alone removes. The reference needs the model's float32 copy
               on the trainer's devices, and takes the trainer's place for the rest of the command.
With `model.rollout_path` an NVFP4 checkpoint and `model.path` its BF16 twin, the rows hold the quantization
gap too. A row keeps each sample's k3 sum and token count, so that r3_on and r3_off, which score the same
samples, can be compared pairwise.

    python -m bench.kl RECIPE [key=value ...] --prompts 128 [--rows r3,fp32,same_engine]
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterator

import numpy as np

from bench.common import Bench, main, sync_adapter

ROWS = ("r3", "fp32", "same_engine")


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


def measure(s, args) -> Iterator[dict]:
    from rl.setup import load_prompts_for, prompt_requests, sampling_spec

    cfg = s.cfg
    sync_adapter(s, 1)
    prompts = load_prompts_for(cfg, cfg.data.train, s.tokenizer, "bench-kl", args.prompts)[: args.prompts]
    samples = s.rollout.generate(prompt_requests(prompts), sampling_spec(cfg, seed=args.seed))
    samples = [x for x in samples if x.response_ids]
    replayed = None  # the trainer's log-probs with the rollout's routing
    if "r3" in args.rows or "fp32" in args.rows:
        for name, replay in (("r3_on", True), ("r3_off", False)):
            if not replay and (not cfg.r3.enabled or "r3" not in args.rows):
                continue
            scored = samples if replay else [x.without_routing() for x in samples]
            logp, m = s.trainer.log_probs(scored)
            extra = {
                "r3_replayed_fraction": m.get("r3/replayed_fraction", 0.0),
                "trainer_entropy": m["actor/entropy"],
            }
            if replay:
                replayed = logp
            if "r3" in args.rows:
                yield _row(name if cfg.r3.enabled else "r3_disabled", logp, scored, extra)
    if "fp32" in args.rows:
        reference, m = _fp32_log_probs(s, samples)
        extra = {"r3_replayed_fraction": m.get("r3/replayed_fraction", 0.0), "reference_dtype": "float32"}
        # the trainer against the reference: the reference's log-probs in the samples' rollout field
        as_reference = [
            dataclasses.replace(x, response_logprobs=np.asarray(r)) for x, r in zip(samples, reference)
        ]
        yield _row("trainer_vs_fp32", replayed, as_reference, {**extra, "trainer_dtype": cfg.model.dtype})
        yield _row("rollout_vs_fp32", reference, samples, extra)
    if "same_engine" in args.rows:
        seqs = [x.prompt_ids + x.response_ids for x in samples]
        prefill = s.rollout.prompt_logprobs(seqs, use_adapter=cfg.sync.mode == "adapter")
        rescored = [np.asarray(lp)[len(lp) - len(x.response_ids) :] for lp, x in zip(prefill, samples)]
        yield _row("same_engine", rescored, samples)


def _fp32_log_probs(s, samples: list) -> tuple[list, dict]:
    """The samples' log-probs from a trainer group computing in float32 with the trainer's adapter, on the
    trainer's placement (the trainer group is shut down first: a device holds one of them). The adapter
    reaches the new ranks through a temporary directory of this process: one node or a shared filesystem."""
    from rl.setup import build_trainer, trainer_spec
    from trainer.checkpoint_io import write_adapter

    tensors, peft_config = s.trainer.export_adapter(dtype="float32")
    # bf16: the checkpoint's dequantized twin, the NVFP4 values exactly, held and computed in float32
    spec = dataclasses.replace(trainer_spec(s.cfg, s.model_path), dtype="float32", base_format="bf16")
    s.trainer.shutdown()
    s.trainer = build_trainer(s.cfg, s.place, spec)
    with tempfile.TemporaryDirectory(prefix="bench-kl-adapter-") as tmp:
        s.trainer.load_adapter(write_adapter(tmp, tensors, peft_config))
    return s.trainer.log_probs(samples)


def _rows(text: str) -> list[str]:
    import argparse

    rows = [r for r in text.split(",") if r]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown or not rows:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of {', '.join(ROWS)}")
    return rows


def _args(p) -> None:
    p.add_argument("--prompts", type=int, default=128, help="prompts taken from data.train")
    p.add_argument("--seed", type=int, default=1, help="the sampling seed")
    p.add_argument(
        "--rows",
        type=_rows,
        default=["r3", "same_engine"],
        help=f"comma-separated, of {', '.join(ROWS)} (the module docstring says what each measures)",
    )


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
        "trainer_dtype",
    ),
    measure=measure,
    add_args=_args,
)

if __name__ == "__main__":
    raise SystemExit(main(BENCH))
