"""Target log-probs and entropy from the LM head applied a chunk of tokens at a time.

The model runs without its head's logits (`logits_to_keep` an empty index: the head sees no row); a
forward hook on the decoder keeps its final hidden states, and `head_logprobs` applies the LM head to
`chunk_tokens` rows at a time: log_softmax and the gather per chunk, so the [tokens, vocab] fp32 tensor
never exists. Under autograd each chunk is checkpointed: backward recomputes that chunk's logits instead
of keeping them (the head's weight is the FSDP root's, unsharded from the root's forward until the end of
backward: FSDP2 does not reshard the root after forward).

Per row the computation is the one the trainer ran on the full logits (head in the model dtype, then fp32
log_softmax; entropy from the same fp32 logits, no gradient), so the values match.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rl.core import algo

# The index that keeps no logits: the decoder runs, the head in the model's forward sees zero rows.
NO_LOGITS = torch.zeros(0, dtype=torch.long)


class FinalHidden:
    """Holds the decoder's last hidden state [B, T, H] of the latest forward (a hook on `decoder`)."""

    def __init__(self, decoder: nn.Module):
        self.value: torch.Tensor | None = None
        decoder.register_forward_hook(self._keep)

    def _keep(self, module, args, output):
        self.value = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    @contextmanager
    def taken(self):
        """Yields nothing; afterwards the held tensor is dropped (its graph lives on in what used it)."""
        try:
            yield
        finally:
            self.value = None


def _chunk(
    head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, with_entropy: bool, entropy_grad: bool
):
    logits = head(hidden).float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    entropy = None
    if with_entropy:
        with nullcontext() if entropy_grad else torch.no_grad():
            entropy = algo.token_entropy(logits if entropy_grad else logits.detach())
    return logp, entropy


def head_logprobs(
    head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk_tokens: int,
    with_entropy: bool,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [B, W, H] (the positions that predict `targets` [B, W]) -> log-probs of the targets [B, W]
    fp32 (with grad when enabled) and entropy [B, W] fp32 or None. chunk_tokens: rows per head call
    (0 = all rows in one call). entropy_grad: the entropy carries grad too (the entropy bonus)."""
    shape = targets.shape
    rows = hidden.reshape(-1, hidden.shape[-1])
    flat = targets.reshape(-1)
    size = chunk_tokens if chunk_tokens > 0 else max(rows.shape[0], 1)
    grad = torch.is_grad_enabled() and rows.requires_grad
    logps, entropies = [], []
    for h, t in zip(rows.split(size), flat.split(size)):
        if grad:
            lp, ent = checkpoint(_chunk, head, h, t, with_entropy, entropy_grad, use_reentrant=False)
        else:
            lp, ent = _chunk(head, h, t, with_entropy, entropy_grad)
        logps.append(lp)
        entropies.append(ent)
    if not logps:  # zero rows
        empty = rows.new_zeros(shape, dtype=torch.float32)
        return empty, (empty.clone() if with_entropy else None)
    logp = torch.cat(logps).reshape(shape)
    entropy = torch.cat(entropies).reshape(shape) if with_entropy else None
    return logp, entropy
