"""Batches of tokenized prompts for the driver, in a seeded order that a resumed run reproduces.

Prompts are rendered with the tokenizer's chat template once, at start; those longer than
`max_prompt_len` are dropped (and counted) rather than truncated, since a cut-off problem has no answer.
The order is a fresh permutation per epoch from (seed, epoch); `state_dict()` is (epoch, position), so a
checkpoint restores exactly where the data stood.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Prompt:
    prompt_ids: list[int]
    data_source: str
    ground_truth: Any  # reward_model.ground_truth as the row holds it (text for the math checkers)
    index: int  # row in the source dataset
    # The row's extra_info, with the prompt's chat messages under "prompt" unless the row has that key:
    # what a reward function of the user's own receives (rl.reward).
    extra_info: dict = field(default_factory=dict)

    @property
    def ground_truth_text(self) -> str:
        """The ground truth as the samples, records and reports show it: the text, or the value's JSON."""
        gt = self.ground_truth
        return gt if isinstance(gt, str) else json.dumps(gt, ensure_ascii=False, default=str)


def reward_extra_info(row: dict) -> dict:
    """What a reward function of the user's own gets as `extra_info`: the row's, plus its chat messages under
    "prompt" (unless the row's extra_info has that key)."""
    extra = dict(row.get("extra_info") or {})
    extra.setdefault("prompt", row["prompt"])
    return extra


def tool_schemas(value: Any, where: str) -> list[dict] | None:
    """The tool descriptions a prompt is rendered with (the chat template's `tools`: JSON schemas, e.g.
    {"type": "function", "function": {"name": ..., "parameters": {...}}}): a list of dicts, or its JSON text
    (as a dataset column often stores it); None or empty: none. ValueError naming `where` otherwise."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{where}: tools must be a JSON list of tool schemas, got text that is not JSON ({e})"
            ) from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(x, dict) for x in value):
        raise ValueError(f"{where}: tools must be a list of tool schemas (dicts), got {type(value).__name__}")
    return [dict(x) for x in value] or None


def tokenize_prompts(
    dataset,
    tokenizer,
    max_prompt_len: int,
    chat_template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
) -> tuple[list[Prompt], int]:
    """(prompts that fit, number dropped for length) from a verl-schema dataset (rl.data.sources: its chat
    messages in `prompt`, data.prompt_key's column renamed). `tools`: the tool schemas every prompt is
    rendered with (an environment's `tools`); a row's own `tools` column (checked at load) takes precedence."""
    has_tools = "tools" in dataset.column_names
    kept, dropped = [], 0
    for i, row in enumerate(dataset):
        row_tools = tool_schemas(row["tools"], f"row {i}, column 'tools'") if has_tools else None
        kwargs = dict(chat_template_kwargs or {})
        if row_tools or tools:
            kwargs["tools"] = row_tools or tools
        ids = tokenizer.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=True, **kwargs
        )
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        if len(ids) > max_prompt_len:
            dropped += 1
            continue
        extra = reward_extra_info(row)
        kept.append(Prompt(list(ids), row["data_source"], row["reward_model"]["ground_truth"], i, extra))
    if not kept:
        raise ValueError(
            f"rollout.max_prompt_len: all {dropped} prompts are longer than {max_prompt_len} tokens"
        )
    return kept, dropped


class PromptLoader:
    def __init__(self, prompts: list[Prompt], batch_size: int, shuffle: bool = True, seed: int = 0):
        if batch_size > len(prompts):
            raise ValueError(
                f"data.train_batch_size: {batch_size} is more than the {len(prompts)} prompts available"
            )
        self.prompts, self.batch_size, self.shuffle, self.seed = prompts, batch_size, shuffle, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.prompts))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

    def next_batch(self, size: int | None = None) -> list[Prompt]:
        """The next `size` prompts (default: the batch size); an epoch's tail rolls into the next epoch."""
        size = size or self.batch_size
        out = []
        while len(out) < size:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            take = self._order[self.position : self.position + size - len(out)]
            out.extend(self.prompts[i] for i in take)
            self.position += len(take)
        return out

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_prompts": len(self.prompts),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["num_prompts"] != len(self.prompts) or state["seed"] != self.seed:
            raise ValueError(
                f"data loader state is for {state['num_prompts']} prompts with seed {state['seed']}, "
                f"this run has {len(self.prompts)} with seed {self.seed}: the data or data.seed changed"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
