"""trainer.minibatch: which samples each optimizer step of a batch trains on."""

import pytest

from trainer.minibatch import mini_batch_plan, steps_per_batch

GROUPS = [g for g in (10, 11, 12, 13, 14, 15, 16, 17) for _ in range(4)]  # 8 prompts x 4 samples, in order


def test_groups_are_never_split_and_each_epoch_covers_the_batch_once():
    plan = mini_batch_plan(GROUPS, 2, 3, seed=0, batch_index=5)
    assert len(plan) == 12 == steps_per_batch(8, 2, 3)
    for epoch in range(3):
        steps = plan[epoch * 4 : (epoch + 1) * 4]
        assert sorted(i for s in steps for i in s) == list(range(32))
        for s in steps:
            assert len({GROUPS[i] for i in s}) == 2 and len(s) == 8 and s == sorted(s)


def test_order_is_drawn_per_epoch_from_seed_and_batch_index():
    plan = mini_batch_plan(GROUPS, 2, 2, seed=0, batch_index=5)
    assert plan == mini_batch_plan(GROUPS, 2, 2, seed=0, batch_index=5)  # a resumed run draws the same
    assert plan[:4] != plan[4:]  # reshuffled for the second epoch
    assert plan != mini_batch_plan(GROUPS, 2, 2, seed=1, batch_index=5)
    assert plan != mini_batch_plan(GROUPS, 2, 2, seed=0, batch_index=6)


def test_whole_batch_and_uneven_group_counts():
    assert mini_batch_plan(GROUPS, 0, 1, seed=0, batch_index=0) == [list(range(32))]
    assert mini_batch_plan(GROUPS, 0, 2, seed=0, batch_index=0) == [list(range(32))] * 2
    # 8 groups, 3 a step: 2 near-equal mini-batches (4 + 4 groups), not 3 + 3 + 2.
    plan = mini_batch_plan(GROUPS, 3, 1, seed=0, batch_index=0)
    assert [len({GROUPS[i] for i in s}) for s in plan] == [4, 4]
    # Fewer groups than a mini-batch (dynamic sampling fell short): one step.
    assert len(mini_batch_plan(GROUPS[:4], 2, 1, seed=0, batch_index=0)) == 1
    with pytest.raises(ValueError, match="mini_batch_size must be >= 0 and epochs >= 1"):
        mini_batch_plan(GROUPS, 2, 0, seed=0, batch_index=0)
