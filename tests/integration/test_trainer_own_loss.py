"""A policy loss of the user's own, named by import path (`algorithm.policy_loss: "file.py:name"`, verl's
PolicyLossFn), on 2 gloo ranks (real Ray actors through TrainerGroup): each rank resolves the file itself,
the loss's own metric is reported (a token-weighted mean over both ranks), and its gradient is what it
says: verl's vanilla loss times 3, against a single-process reference of the vanilla loss."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import ray
import torch

from rl.core.algo import AlgoConfig
from rl.tiny import make_tiny
from trainer.config import LoraConfig, TrainerConfig
from trainer.group import TrainerGroup
from trainer.lora import apply_lora
from trainer.routing_replay import RoutingReplay
from trainer.spec import TrainerSpec
from trainer.testing import random_samples, reference_logprobs, reference_loss

pytestmark = pytest.mark.slow

LOSS = """
from verl.trainer.ppo import core_algos

SCALE = 3.0


def tripled(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights=None):
    vanilla = core_algos.get_policy_loss_fn("vanilla")
    loss, metrics = vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
    return SCALE * loss, {**metrics, "actor/own_scale": SCALE, "actor/own_adv_mean": float(advantages[response_mask > 0].mean())}
"""
ALGO = AlgoConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
TRAINER = TrainerConfig(
    lr=1e-2, grad_clip=0.0, warmup_steps=0, micro_batch_tokens=0, micro_batch_size=2, compile=False
)


@pytest.fixture(scope="module")
def loss_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("own_loss") / "my_loss.py"
    path.write_text(LOSS)
    return f"{path}:tripled"


def test_an_own_loss_reaches_every_rank_with_its_metric_and_gradient(loss_file):
    spec = TrainerSpec(
        model_path=str(make_tiny("qwen3_moe")),
        dtype="float32",
        lora=LoraConfig(rank=8, alpha=16.0),
        trainer=copy.deepcopy(TRAINER),
        optimizer_steps=4,
        algo=dataclasses.replace(ALGO, loss_mode=loss_file),
        max_seq_len=32,
        r3=False,
        seed=1,
        init_lora_weights=False,
    )
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=torch.float32)
    model = apply_lora(base, spec.lora, spec.seed, init_lora_weights=False)
    model.eval()
    samples = random_samples(5, seed=7)  # ranks get 3 and 2 samples
    advantages = [1.0, -0.5, 0.7, -1.2, 0.3]
    rng = np.random.default_rng(0)
    with torch.no_grad():
        ref_lp = [reference_logprobs(model, s, None) for s in samples]
    old = [
        (lp + torch.from_numpy(rng.uniform(-0.3, 0.3, len(lp)).astype(np.float32))).numpy() for lp in ref_lp
    ]
    model.zero_grad(set_to_none=True)
    loss, ref_metrics = reference_loss(model, samples, advantages, old, ALGO, RoutingReplay(base))
    loss.backward()
    params = {n.replace(".default.", "."): p for n, p in model.named_parameters() if p.requires_grad}

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        group = TrainerGroup(spec, num_ranks=2)
        try:
            step = group.train_step(samples, advantages, old)
            grads = group.gradients()
        finally:
            group.shutdown()
    finally:
        ray.shutdown()

    # the metric the loss adds, over both ranks; verl's own metrics through it as well
    assert step["actor/own_scale"] == pytest.approx(3.0)
    tokens = np.array([len(s.response_ids) for s in samples])
    assert step["actor/own_adv_mean"] == pytest.approx(
        float((np.array(advantages) * tokens).sum() / tokens.sum())
    )
    assert step["actor/pg_clipfrac"] == pytest.approx(ref_metrics["actor/pg_clipfrac"], abs=1e-6)
    assert step["actor/pg_loss"] == pytest.approx(3.0 * float(loss.detach()), rel=1e-4, abs=1e-6)
    # the gradient it changes: three times the vanilla loss's, element by element
    assert set(grads) == set(params)
    for name, g in grads.items():
        torch.testing.assert_close(
            g, 3.0 * params[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert step["actor/grad_norm"] == pytest.approx(
        3.0 * float(torch.nn.utils.get_total_norm([p.grad for p in params.values()])), rel=1e-4
    )
