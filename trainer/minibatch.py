"""PPO mini-batches and epochs: which samples each optimizer step of one batch trains on.

verl's definitions: a mini-batch is `mini_batch_size` prompts, each with all of its samples (a group is
never split: its samples share one baseline); `ppo_epochs` passes go over the batch, one optimizer step per
mini-batch. The groups are dealt into mini-batches in an order drawn afresh for each epoch from
(seed, batch index, epoch), so a resumed run draws the same order. A batch whose group count the mini-batch
size does not divide (dynamic sampling keeps what it finds) is cut into count // size near-equal
mini-batches (at least one).
"""

from __future__ import annotations

import numpy as np


def mini_batch_plan(
    groups: list[int], mini_batch_size: int, epochs: int, seed: int, batch_index: int
) -> list[list[int]]:
    """Sample indices (ascending) of each optimizer step over one batch, in the order of the steps.
    groups: each sample's group id; mini_batch_size: groups per step (0 = the whole batch)."""
    if mini_batch_size < 0 or epochs < 1:
        raise ValueError(f"mini_batch_size must be >= 0 and epochs >= 1, got {mini_batch_size}, {epochs}")
    ids = sorted(set(groups))
    members: dict[int, list[int]] = {g: [] for g in ids}
    for i, g in enumerate(groups):
        members[g].append(i)
    count = 1 if mini_batch_size == 0 else max(1, len(ids) // mini_batch_size)
    plan = []
    for epoch in range(epochs):
        order = np.random.default_rng([seed, batch_index, epoch]).permutation(len(ids))
        for part in np.array_split(order, count):
            plan.append(sorted(i for k in part for i in members[ids[k]]))
    return plan


def steps_per_batch(num_groups: int, mini_batch_size: int, epochs: int) -> int:
    """Optimizer steps `mini_batch_plan` makes over a batch of num_groups groups."""
    return epochs * (1 if mini_batch_size == 0 else max(1, num_groups // mini_batch_size))
