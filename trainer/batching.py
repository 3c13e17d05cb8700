"""From samples to tensors: the rank split, micro-batch packing, and one padded micro-batch.

Layout of a micro-batch (right padding): input_ids [B, T]. The logits of position p predict token p + 1,
so only the window of positions from the shortest prompt's last token to T - 1 is computed
(`logits_to_keep` = W); per-token tensors of the loss (targets, response mask, old log-probs,
advantages) are [B, W] over that window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rl.core.batch import Sample


def check_lengths(samples: list[Sample], max_seq_len: int, sample_ids: list[int] | None = None) -> None:
    ids = sample_ids if sample_ids is not None else range(len(samples))
    for i, s in zip(ids, samples):
        if not s.prompt_ids or not s.response_ids:
            raise ValueError(f"sample {i}: needs at least one prompt and one response token")
        if s.num_tokens > max_seq_len:
            raise ValueError(
                f"sample {i}: {len(s.prompt_ids)} prompt + {len(s.response_ids)} response tokens = "
                f"{s.num_tokens}, over the trainer's max_seq_len {max_seq_len}"
            )


def split_by_tokens(lengths: list[int], num_ranks: int) -> list[list[int]]:
    """Sample indices per rank, balanced by token count (longest first onto the lightest rank). Each
    rank's list is in ascending index order, so results gathered rank by rank can be put back in place."""
    loads = [0] * num_ranks
    parts: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(num_ranks), key=lambda r: (loads[r], len(parts[r]), r))
        parts[r].append(i)
        loads[r] += lengths[i]
    return [sorted(p) for p in parts]


def in_batch_order(size: int, parts: list[list[int]], values: list[list]) -> list:
    """Per-part results back in the batch's order: values[k][j] belongs at position parts[k][j]."""
    out: list = [None] * size
    for positions, part_values in zip(parts, values):
        for i, v in zip(positions, part_values):
            out[i] = v
    return out


def pack_micro_batches(lengths: list[int], max_samples: int, max_tokens: int) -> list[list[int]]:
    """Groups of sample indices, each within max_samples and max_tokens padded tokens (0 = no limit).
    Samples are sorted by length first so that a micro-batch holds similar lengths (little padding)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if max_tokens and lengths[i] > max_tokens:
            raise ValueError(f"sample {i} has {lengths[i]} tokens, more than micro_batch_tokens {max_tokens}")
        g = groups[-1] if groups else None
        # Sorted longest first: the group's first sample sets its padded length.
        fits = g is not None and (not max_samples or len(g) < max_samples)
        fits = fits and (not max_tokens or (len(g) + 1) * lengths[g[0]] <= max_tokens)
        if fits:
            g.append(i)
        else:
            groups.append([i])
    return groups


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    targets: torch.Tensor  # [B, W] long: the token each kept logit row predicts (0 where none)
    response_mask: torch.Tensor  # [B, W] bool: the response tokens the policy sampled (Sample.loss_mask)
    starts: list[int]  # per sample: window index of its first response token
    response_lens: list[int]
    routed: torch.Tensor | None  # [B * T, L, k] long, or None (live routing everywhere)
    routed_valid: torch.Tensor | None  # [B * T] bool
    replayed_rows: int  # token rows that use replayed routing
    token_rows: int  # real (unpadded) token rows

    @property
    def routable_rows(self) -> int:
        """Token rows that predict a token: all but each sample's last, which the rollout never routed."""
        return self.token_rows - len(self.response_lens)

    @property
    def window(self) -> int:
        return self.targets.shape[1]

    def scatter(self, per_sample: list[np.ndarray] | list[float], dtype=torch.float32) -> torch.Tensor:
        """Per-sample response values (arrays of response length, or scalars) -> [B, W], 0 elsewhere."""
        out = torch.zeros(self.targets.shape, dtype=dtype)
        for b, (v, s, n) in enumerate(zip(per_sample, self.starts, self.response_lens)):
            out[b, s : s + n] = torch.from_numpy(np.array(v, dtype=np.float32)).to(dtype)
        return out

    def gather(self, x: torch.Tensor) -> list[np.ndarray]:
        """[B, W] -> per-sample response values (float32 numpy)."""
        x = x.detach().float().cpu()
        return [
            x[b, s : s + n].numpy().copy() for b, (s, n) in enumerate(zip(self.starts, self.response_lens))
        ]


def make_micro_batch(samples: list[Sample], pad_id: int, replay_shape: tuple[int, int] | None) -> MicroBatch:
    """replay_shape (L, k) when routing replay is on; samples without `routed_experts` then route live."""
    lengths = [s.num_tokens for s in samples]
    T = max(lengths)
    first = min(len(s.prompt_ids) for s in samples) - 1  # first kept logit position
    W = T - first
    B = len(samples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    targets = torch.zeros((B, W), dtype=torch.long)
    response_mask = torch.zeros((B, W), dtype=torch.bool)
    routed = routed_valid = None
    if replay_shape is not None:
        routed = torch.zeros((B, T, *replay_shape), dtype=torch.long)
        routed_valid = torch.zeros((B, T), dtype=torch.bool)
    starts, replayed = [], 0
    for b, s in enumerate(samples):
        ids = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        n = len(ids)
        input_ids[b, :n] = ids
        attention_mask[b, :n] = 1
        # window index w is position first + w and predicts token first + w + 1
        targets[b, : n - 1 - first] = ids[first + 1 :]
        start = len(s.prompt_ids) - 1 - first
        response_mask[b, start : start + len(s.response_ids)] = torch.from_numpy(s.generated())
        starts.append(start)
        if routed is not None and s.routed_experts is not None:
            rows = s.routed_experts.shape[0]  # n - 1: the last token was never routed by the rollout
            routed[b, :rows] = torch.from_numpy(s.routed_experts.astype(np.int64))
            routed_valid[b, :rows] = True
            replayed += rows
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        targets=targets,
        response_mask=response_mask,
        starts=starts,
        response_lens=[len(s.response_ids) for s in samples],
        routed=None if routed is None else routed.flatten(0, 1),
        routed_valid=None if routed_valid is None else routed_valid.flatten(),
        replayed_rows=replayed,
        token_rows=sum(lengths),
    )
