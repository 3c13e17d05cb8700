"""Routing replay (R3) on the tiny Qwen3-MoE with a LoRA adapter (random A and B, so gradients reach both),
single process. No fakes: the real transformers model and PEFT wrapper."""

import numpy as np
import pytest
import torch

from rl.tiny import make_tiny
from trainer.config import LoraConfig
from trainer.lora import apply_lora, expert_slices
from trainer.routing_replay import RoutingReplay
from trainer.testing import live_routing, random_samples, reference_logprobs

NUM_EXPERTS = 8


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(make_tiny("qwen3_moe"), dtype=torch.float32)
    model = apply_lora(base, LoraConfig(rank=4, alpha=16.0), seed=0, init_lora_weights=False)
    model.eval()
    replay = RoutingReplay(base)
    sample = random_samples(1, seed=3, prompt_len=(6, 7), response_len=(8, 9))[0]
    return model, replay, sample


def with_routing(sample, routed):
    sample.routed_experts = routed
    return sample


def test_replaying_own_routing_gives_identical_log_probs(setup):
    model, replay, sample = setup
    with torch.no_grad():
        live = reference_logprobs(model, with_routing(sample, None), replay)
        own = live_routing(model, sample.prompt_ids + sample.response_ids)
        replayed = reference_logprobs(model, with_routing(sample, own), replay)
    assert own.shape == (sample.num_tokens - 1, 4, 2)
    assert torch.equal(live, replayed)  # bit for bit: the weights are recomputed exactly as the router does


def test_replaying_other_ids_changes_log_probs(setup):
    model, replay, sample = setup
    with torch.no_grad():
        live = reference_logprobs(model, with_routing(sample, None), replay)
        own = live_routing(model, sample.prompt_ids + sample.response_ids)
        other = (own.astype(np.int64) + 3) % NUM_EXPERTS  # no id stays in place
        replayed = reference_logprobs(model, with_routing(sample, other.astype(np.uint8)), replay)
    assert (live - replayed).abs().max() > 1e-3


def test_gradients_reach_only_the_replayed_experts(setup):
    model, replay, sample = setup
    replayed = {1, 4}
    routed = np.zeros((sample.num_tokens - 1, 4, 2), dtype=np.uint8)
    routed[..., 0], routed[..., 1] = 1, 4
    model.zero_grad(set_to_none=True)
    # Only response log-probs (positions up to len - 2) enter the loss, as in training: the last token's
    # live routing then cannot reach any gradient.
    reference_logprobs(model, with_routing(sample, routed), replay).sum().backward()
    expert_params = [(n, p) for n, p in model.named_parameters() if ".mlp.experts." in n and p.requires_grad]
    assert len(expert_params) == 4 * 2 * 2  # layers x (gate_up, down) x (A, B)
    for name, p in expert_params:
        for e in range(NUM_EXPERTS):
            g = p.grad[expert_slices(name, NUM_EXPERTS, 4, e)]
            if e in replayed:
                assert g.abs().max() > 0, f"{name} expert {e}"
            else:
                assert torch.count_nonzero(g) == 0, f"{name} expert {e}"


def test_unrouted_rows_keep_the_live_choice(setup):
    model, replay, _ = setup
    router = replay.routers[0]
    x = torch.randn(5, 128)
    live_logits, live_w, live_ids = router(x)
    ids = torch.full((5, 4, 2), 7, dtype=torch.long)
    ids[:, :, 1] = 6
    valid = torch.tensor([True, True, False, True, False])
    with replay.active(ids, valid):
        logits, w, idx = router(x)
    assert torch.equal(logits, live_logits)
    assert torch.equal(idx[~valid], live_ids[~valid]) and (idx[valid] == torch.tensor([7, 6])).all()
    probs = torch.softmax(live_logits.float(), -1)[valid][:, [7, 6]]
    assert torch.allclose(w[valid], probs / probs.sum(-1, keepdim=True))  # norm_topk_prob renormalises
    assert torch.equal(w[~valid], live_w[~valid])


def test_replay_metadata_and_bad_ids_are_named(setup):
    _, replay, _ = setup
    assert (replay.num_layers, replay.top_k, replay.num_experts) == (4, 2, NUM_EXPERTS)
    with pytest.raises(ValueError, match=r"sample 3: routed_experts holds expert ids 0\.\.8.*8 experts"):
        replay.check(np.array([[[0, 8]] * 4], dtype=np.uint8), "sample 3")
    with pytest.raises(
        ValueError, match=r"shape \(2, 3, 2\), expected \[tokens - 1, 4 MoE layers, top_k 2\]"
    ):
        replay.check(np.zeros((2, 3, 2), dtype=np.uint8), "sample 0")
    with pytest.raises(ValueError, match="ids must be"):
        with replay.active(torch.zeros(3, 4, 3, dtype=torch.long), torch.ones(3, dtype=torch.bool)):
            pass
