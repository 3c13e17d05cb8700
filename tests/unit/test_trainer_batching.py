"""trainer.batching: the rank split, micro-batch packing and the padded layout (pure functions)."""

import numpy as np
import pytest
import torch

from rl.core.batch import Sample
from trainer.batching import check_lengths, make_micro_batch, pack_micro_batches, split_by_tokens


def sample(prompt, response, routed=None):
    return Sample(prompt, response, np.zeros(len(response), np.float32), "stop", 0, 0, routed_experts=routed)


def test_split_balances_tokens_and_keeps_every_index_once():
    lengths = [50, 10, 40, 10, 30, 20, 20]
    parts = split_by_tokens(lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(7))
    assert all(p == sorted(p) for p in parts)
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert loads == [90, 90]


def test_split_with_more_ranks_than_samples_leaves_ranks_empty():
    assert split_by_tokens([5, 7], 3) == [[1], [0], []]


def test_packing_respects_sample_and_padded_token_limits():
    lengths = [10, 4, 9, 3, 8]
    groups = pack_micro_batches(lengths, max_samples=2, max_tokens=0)
    assert groups == [[0, 2], [4, 1], [3]]  # longest first
    groups = pack_micro_batches(lengths, max_samples=0, max_tokens=20)
    assert groups == [[0, 2], [4, 1], [3]]  # 2 x 10 fits, 3 x 10 does not; then 8 + 8 (padded), then 3
    assert all(len(g) * max(lengths[i] for i in g) <= 20 for g in groups)
    with pytest.raises(ValueError, match="sample 0 has 10 tokens, more than micro_batch_tokens 9"):
        pack_micro_batches(lengths, 0, 9)


def test_too_long_sample_is_named():
    with pytest.raises(
        ValueError, match=r"sample 7: 3 prompt \+ 2 response tokens = 5, over the trainer's max_seq_len 4"
    ):
        check_lengths([sample([1, 2, 3], [4, 5])], 4, [7])


def test_micro_batch_layout_window_targets_and_replay_rows():
    routed = np.arange(4 * 2 * 1, dtype=np.uint8).reshape(4, 2, 1) % 3
    a = sample([11, 12, 13], [14, 15], routed)  # 5 tokens, routed rows 0..3
    b = sample([21, 22], [23, 24, 25, 26])  # 6 tokens, no routing
    mb = make_micro_batch([a, b], pad_id=0, replay_shape=(2, 1))
    assert mb.input_ids.tolist() == [[11, 12, 13, 14, 15, 0], [21, 22, 23, 24, 25, 26]]
    assert mb.attention_mask.sum(1).tolist() == [5, 6]
    # window starts at the shortest prompt's last token (position 1): positions 1..5
    assert mb.window == 5
    assert mb.targets.tolist() == [[13, 14, 15, 0, 0], [23, 24, 25, 26, 0]]
    assert mb.response_mask.tolist() == [[False, True, True, False, False], [True, True, True, True, False]]
    assert mb.starts == [1, 0] and mb.response_lens == [2, 4]
    assert mb.routed.shape == (12, 2, 1)
    assert mb.routed_valid.tolist() == [True] * 4 + [False] * 8
    assert torch.equal(mb.routed[:4], torch.from_numpy(routed.astype(np.int64)))
    assert (mb.replayed_rows, mb.token_rows, mb.routable_rows) == (4, 11, 9)
    x = mb.scatter([np.array([1.0, 2.0]), np.array([3.0, 4.0, 5.0, 6.0])])
    assert x.tolist() == [[0, 1, 2, 0, 0], [3, 4, 5, 6, 0]]
    assert [v.tolist() for v in mb.gather(x)] == [[1, 2], [3, 4, 5, 6]]


def test_tokens_outside_the_loss_mask_are_outside_the_response_mask():
    """A response with environment tokens in it (Sample.loss_mask False): the micro-batch's response mask,
    which the loss, the k3 check and the entropy read, covers the sampled tokens only."""
    a = sample([1, 2, 3], [4, 5, 6, 7, 8])
    a.loss_mask = np.array([True, True, False, False, True])
    b = sample([1, 2], [9, 10])
    mb = make_micro_batch([a, b], pad_id=0, replay_shape=None)
    s = mb.starts[0]
    assert mb.response_mask[0, s : s + 5].tolist() == [True, True, False, False, True]
    assert mb.response_mask[1].sum() == 2 and mb.response_mask.sum() == 5
    assert (a.num_generated, b.num_generated) == (3, 2)
    with pytest.raises(ValueError, match="loss_mask has shape"):
        Sample([1], [2, 3], np.zeros(2, np.float32), "stop", 0, 0, loss_mask=np.ones(3, bool))
