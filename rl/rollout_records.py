"""What the policy generated, kept where a person can read it: `rollouts/step_<N>.jsonl` in the run directory.

One JSON object a trained sample (keys in `ROW_KEYS`), at most `logging.rollouts_per_step` of them a step
(whole GRPO groups, in group order, so that a group's rewards can be compared), every
`logging.rollouts_every` steps. Texts longer than `logging.rollouts_max_chars` keep their start and their
end (where a math answer is) around a marker of what was cut. Each file is written to a temporary name
and renamed, so a reader never sees half a step.

Also here: the check that a step carried any gradient at all (`flat_reward_warning`). A step whose every
group had equal rewards has zero advantages everywhere: nothing to learn from, and many such steps in a
row most often mean the reward never matches.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rl.core.batch import Sample

ROW_KEYS = (
    "step",
    "group",
    "index",
    "data_source",
    "prompt",
    "response",
    "ground_truth",
    "reward",
    "acc",
    "pred",
    "response_length",
    "finish_reason",
    "k3_kl",
    "adapter_version",
)


def rollouts_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "rollouts" / f"step_{step}.jsonl"


def clip_text(text, max_chars: int) -> str:
    """`text` (made a string; None as "") whole, or its start and end around `[... N cut ...]` when it is
    longer than `max_chars` (0 = no limit): a math response's answer is at its end. The one cut for the
    rollout files, the trackers' tables and the report."""
    text = "" if text is None else str(text)
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    return f"{text[:head]}[... {len(text) - max_chars} cut ...]{text[-tail:]}"


def whole_groups(samples: Sequence[Sample], limit: int) -> list[int]:
    """Indices of the samples of the first groups (in group order) that fit in `limit` samples; at least
    one group, so a step whose groups are larger than the limit still shows one (0 = every sample)."""
    order = sorted(range(len(samples)), key=lambda i: (samples[i].group, i))
    if limit <= 0:
        return order
    chosen: list[int] = []
    for group in dict.fromkeys(samples[i].group for i in order):
        members = [i for i in order if samples[i].group == group]
        if chosen and len(chosen) + len(members) > limit:
            break
        chosen.extend(members)
    return chosen


def rollout_rows(
    step: int,
    samples: Sequence[Sample],
    k3: Sequence[float | None],
    tokenizer,
    per_step: int,
    max_chars: int,
) -> list[dict]:
    """The rows of `rollouts/step_<step>.jsonl`: `k3[i]` is sample i's mean k3 over its response tokens
    (None where not measured). The prompt keeps its chat template's special tokens; the response is decoded
    as the reward reads it (without them)."""
    chosen = whole_groups(samples, per_step)
    prompts = tokenizer.batch_decode([samples[i].prompt_ids for i in chosen], skip_special_tokens=False)
    responses = tokenizer.batch_decode([samples[i].response_ids for i in chosen], skip_special_tokens=True)
    rows = []
    for i, prompt, response in zip(chosen, prompts, responses):
        s = samples[i]
        rows.append(
            {
                "step": step,
                "group": s.group,
                "index": i,
                "data_source": s.data_source,
                "prompt": clip_text(prompt, max_chars),
                "response": clip_text(response, max_chars),
                "ground_truth": clip_text(str(s.ground_truth), max_chars),
                "reward": None if s.reward is None else float(s.reward),
                "acc": None if s.acc is None else bool(s.acc),
                "pred": None if s.pred is None else clip_text(str(s.pred), max_chars),
                "response_length": s.num_generated,
                "finish_reason": s.finish_reason,
                "k3_kl": None if k3[i] is None or not np.isfinite(k3[i]) else float(k3[i]),
                "adapter_version": int(s.adapter_version),
            }
        )
    return rows


def write_rollouts(run_dir: Path, step: int, rows: list[dict]) -> Path:
    path = rollouts_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    os.replace(tmp, path)
    return path


def read_rollouts(run_dir: Path, step: int) -> list[dict]:
    path = rollouts_path(run_dir, step)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def flat_group_fraction(samples: Sequence[Sample]) -> float:
    """The fraction of the groups in `samples` whose rewards are all equal (no GRPO gradient)."""
    rewards: dict[int, set[float]] = {}
    for s in samples:
        rewards.setdefault(s.group, set()).add(float(s.reward))
    return sum(len(r) == 1 for r in rewards.values()) / max(len(rewards), 1)


def flat_reward_warning(step: int, in_a_row: int, limit: int, reward: float, run_dir: Path) -> str | None:
    """The warning for a step whose every group had equal rewards; `in_a_row` counts it. Louder, with the
    likely causes, from `limit` steps in a row (monitor.flat_reward_steps) on; none when limit is 0."""
    if limit <= 0 or in_a_row <= 0:
        return None
    head = f"step {step}: every group had equal rewards (mean {reward:.3g}): zero advantages, no gradient"
    if in_a_row > 1:
        head += f" ({in_a_row} steps in a row)"
    if in_a_row < limit:
        return f"[yellow]{head}"
    return (
        f"[red]{head}. Likely causes: the reward never matches the answers' format (read the responses "
        f"and preds in {Path(run_dir) / 'rollouts'}), the ground truth column holds something else, "
        f"responses cut at rollout.max_response_len (response_length/clip_ratio), or the task is too hard "
        f"or too easy for the model (rollout.n larger, or algorithm.dynamic_sampling.enabled=true)"
    )
