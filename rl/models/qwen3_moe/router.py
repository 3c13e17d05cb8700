"""Routing replay (R3) of transformers' `Qwen3MoeTopKRouter` (the `RouterAdapter` of rl/models/family.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def replay(router, output: tuple, ids: torch.Tensor, valid: torch.Tensor) -> tuple:
    """Mirrors Qwen3MoeTopKRouter.forward: softmax in fp32, top-k, optional renormalisation, cast back.
    tests/unit/test_trainer_routing_replay.py pins that replaying the live ids is bit-identical."""
    logits, _, live_ids = output
    idx = torch.where(valid[:, None], ids, live_ids)
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top = probs.gather(-1, idx)
    if router.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), idx
