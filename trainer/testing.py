"""Test helpers: random samples, the live routing of a sequence, and a plain single-process reference of
the trainer's math (one sequence at a time, no padding, no FSDP) to compare the trainer against."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch

from rl.core import algo
from rl.core.batch import Sample
from trainer.routing_replay import RoutingReplay, moe_routers


def random_samples(n: int, seed: int, prompt_len=(3, 8), response_len=(2, 9), vocab=(5, 300)) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = rng.integers(*vocab, rng.integers(*prompt_len)).tolist()
        r = rng.integers(*vocab, rng.integers(*response_len)).tolist()
        out.append(Sample(p, r, rng.normal(-2.0, 0.5, len(r)).astype(np.float32), "stop", 0, i // 2))
    return out


@torch.no_grad()
def live_routing(model, token_ids: list[int]) -> np.ndarray:
    """The experts the model itself picks for a sequence: uint8 [len - 1, MoE layers, top_k] (the rollout's
    layout: the last token is never routed)."""
    picked = []
    hooks = [r.register_forward_hook(lambda m, a, out: picked.append(out[2])) for r in moe_routers(model)]
    try:
        model(input_ids=torch.tensor([token_ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(picked, dim=1)[:-1].numpy().astype(np.uint8)


def reference_logprobs(
    model, sample: Sample, replay: RoutingReplay | None, with_entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Response-token log-probs [R] of one sample, computed alone (grad follows torch's grad mode); with
    with_entropy, (log-probs, entropies [R])."""
    ids = sample.prompt_ids + sample.response_ids
    n, p = len(ids), len(sample.prompt_ids)
    ctx = nullcontext()
    if replay is not None and sample.routed_experts is not None:
        routed = torch.zeros((n, replay.num_layers, replay.top_k), dtype=torch.long)
        routed[: n - 1] = torch.from_numpy(sample.routed_experts.astype(np.int64))
        ctx = replay.active(routed, torch.arange(n) < n - 1)
    with ctx:
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits[p - 1 : n - 1], dim=-1)
    picked = logp.gather(-1, torch.tensor(sample.response_ids)[:, None]).squeeze(-1)
    if with_entropy:
        return picked, -(logp.exp() * logp).sum(-1)
    return picked


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def reference_loss(
    model, samples, advantages, old_logprobs, cfg: algo.AlgoConfig, replay, ref_logprobs=None
) -> tuple:
    """The whole batch's GRPO loss, unsplit (the normalisers are this batch's own counts), with cfg's KL
    term (ref_logprobs: the reference's per-sample log-probs) and entropy bonus."""
    if cfg.entropy_coeff:
        pairs = [reference_logprobs(model, s, replay, with_entropy=True) for s in samples]
        logp, entropy = _pad([lp for lp, _ in pairs]), _pad([e for _, e in pairs])
    else:
        logp, entropy = _pad([reference_logprobs(model, s, replay) for s in samples]), None
    mask = _pad([torch.from_numpy(s.generated()) for s in samples])
    old = _pad([torch.as_tensor(o) for o in old_logprobs]) if old_logprobs is not None else logp.detach()
    return algo.policy_loss(
        logp,
        old,
        torch.tensor(advantages, dtype=torch.float32),
        mask,
        loss_mode=cfg.loss_mode,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c,
        loss_agg_mode=cfg.loss_agg_mode,
        ref_log_prob=None if ref_logprobs is None else _pad([torch.as_tensor(r) for r in ref_logprobs]),
        kl_coef=cfg.kl_coef,
        kl_type=cfg.kl_type,
        entropy=entropy,
        entropy_coeff=cfg.entropy_coeff,
    )


def checkpoint_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in the checkpoint directory `path`, by name."""
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out
