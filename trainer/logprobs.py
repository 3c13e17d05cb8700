"""Target log-probs and entropy from the LM head applied a chunk of tokens at a time.

The model runs without its head's logits (`logits_to_keep` an empty index: the head sees no row); a
forward hook on the decoder keeps its final hidden states, and `head_logprobs` applies the LM head to
`chunk_tokens` rows at a time: log_softmax and the gather per chunk, so the [tokens, vocab] fp32 tensor
never exists. Under autograd each chunk is checkpointed: backward recomputes that chunk's logits instead
of keeping them (the head's weight is the FSDP root's, unsharded from the root's forward until the end of
backward: FSDP2 does not reshard the root after forward).

Per row the computation is the one the trainer ran on the full logits (the head's fp32 logits, then the fp32
log_softmax; entropy from the same logits, no gradient), so the values match. The head's matmul keeps its fp32
accumulator (`model.head_dtype: float32`, as vLLM's `head_dtype` does for the engine): logits rounded to
bf16 are off by up to half a bf16 step of their size (0.06 at a logit of 16), and two stacks whose hidden
states differ in the last bits round some of them apart, which moves those tokens' log-probs by as much.
`head_dtype: model` rounds to the model dtype first, as the head computed before. The fp32 logits are
divided by the rollout's sampling temperature first and, with a nucleus (top_p < 1), the tokens outside it
are masked out, as vLLM's sampler does before the log-probs it returns (`logprobs_mode="processed_logprobs"`):
the trainer scores the distribution the samples were drawn from.
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
        self.hook = decoder.register_forward_hook(self._keep)

    def _keep(self, module, args, output):
        self.value = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    @contextmanager
    def taken(self):
        """Yields nothing; afterwards the held tensor is dropped (its graph lives on in what used it)."""
        try:
            yield
        finally:
            self.value = None


@torch.no_grad()
def outside_nucleus(logits: torch.Tensor, top_p: float, targets: torch.Tensor) -> torch.Tensor:
    """[N, V] bool: the tokens top-p sampling excludes, by vLLM's rule (`apply_top_k_top_p_pytorch`):
    sorted ascending, a token is out while the probability mass up to and including it is at most 1 - top_p;
    the most likely token always stays. The target never counts as out: a sampled token that sits on the
    nucleus' edge in the engine's arithmetic and just past it in the trainer's keeps a finite log-prob."""
    ascending, order = logits.sort(dim=-1)
    out_sorted = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
    out_sorted[:, -1] = False
    out = torch.empty_like(out_sorted).scatter_(-1, order, out_sorted)
    out[torch.arange(out.shape[0], device=out.device), targets] = False
    return out


class _Float32Head(torch.autograd.Function):
    """logits = hidden @ weight^T (+ bias) in fp32 from model-dtype operands: on CUDA one matmul with an fp32
    output (torch.mm's out_dtype), elsewhere the operands cast to fp32 (exact: a bf16 value is an fp32
    one). Backward is the model-dtype head's: the fp32 gradient rounded to the model dtype, then matmuls in
    it (no fp32 copy of a vocabulary-sized weight)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias):
        if hidden.is_cuda:
            logits = torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        else:
            logits = hidden.float() @ weight.float().t()
        if bias is not None:
            logits = logits + bias.float()
        ctx.save_for_backward(hidden, weight)
        ctx.has_bias = bias is not None
        return logits

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        g = grad.to(weight.dtype)
        grad_hidden = g @ weight if ctx.needs_input_grad[0] else None
        grad_weight = g.t() @ hidden if ctx.needs_input_grad[1] else None
        grad_bias = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias


def head_logits(head: nn.Module, hidden: torch.Tensor, float32: bool) -> torch.Tensor:
    """[N, V] fp32 logits of the LM head (an nn.Linear) on hidden [N, H]: its matmul kept in fp32 (float32),
    or rounded to the model dtype first."""
    weight = getattr(head, "weight", None)
    if not float32 or weight is None or weight.dtype == torch.float32:
        return head(hidden).float()
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"model.head_dtype=float32: the LM head is a {type(head).__name__}, not a linear layer; "
            "model.head_dtype=model computes it as it is"
        )
    return _Float32Head.apply(hidden, weight, head.bias)


def _chunk(
    head: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    with_entropy: bool,
    entropy_grad: bool,
    temperature: float,
    top_p: float,
    float32_head: bool = True,
):
    logits = head_logits(head, hidden, float32_head)
    if temperature != 1.0:
        logits = logits / temperature
    if top_p < 1.0:
        # the dtype's lowest finite value, not -inf: exp gives 0 and the entropy's p * logit stays 0, not nan
        logits = logits.masked_fill(outside_nucleus(logits, top_p, targets), torch.finfo(logits.dtype).min)
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
    temperature: float = 1.0,
    top_p: float = 1.0,
    float32_head: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [B, W, H] (the positions that predict `targets` [B, W]) -> log-probs of the targets [B, W]
    fp32 (with grad when enabled) and entropy [B, W] fp32 or None. chunk_tokens: rows per head call
    (0 = all rows in one call). entropy_grad: the entropy carries grad too (the entropy bonus). temperature,
    top_p: the sampling distribution the log-probs and entropy are of (the logits divided by temperature,
    renormalised over the top_p nucleus; top_p = 1: the whole vocabulary). float32_head: the head's logits
    unrounded (`model.head_dtype: float32`), else rounded to the model dtype."""
    shape = targets.shape
    rows = hidden.reshape(-1, hidden.shape[-1])
    flat = targets.reshape(-1)
    size = chunk_tokens if chunk_tokens > 0 else max(rows.shape[0], 1)
    grad = torch.is_grad_enabled() and rows.requires_grad
    logps, entropies = [], []
    for h, t in zip(rows.split(size), flat.split(size)):
        if grad:
            lp, ent = checkpoint(
                _chunk,
                head,
                h,
                t,
                with_entropy,
                entropy_grad,
                temperature,
                top_p,
                float32_head,
                use_reentrant=False,
            )
        else:
            lp, ent = _chunk(head, h, t, with_entropy, entropy_grad, temperature, top_p, float32_head)
        logps.append(lp)
        entropies.append(ent)
    if not logps:  # zero rows
        empty = rows.new_zeros(shape, dtype=torch.float32)
        return empty, (empty.clone() if with_entropy else None)
    logp = torch.cat(logps).reshape(shape)
    entropy = torch.cat(entropies).reshape(shape) if with_entropy else None
    return logp, entropy
