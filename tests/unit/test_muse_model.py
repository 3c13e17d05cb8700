"""The trainer's Muse Spark model: layer cycle, KV-cache ratio, save/load, sliding window, head gate, R3."""

from __future__ import annotations

import logging

import pytest
import torch

from rl.models.muse import MuseSparkConfig, MuseSparkForCausalLM, MuseSparkTopKRouter


def small_config(**kw) -> MuseSparkConfig:
    base = dict(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_latent_size=32,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        sliding_window=4,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    return MuseSparkConfig(**{**base, **kw})


def make(config: MuseSparkConfig, seed: int = 0) -> MuseSparkForCausalLM:
    torch.manual_seed(seed)
    return MuseSparkForCausalLM(config).eval()


def test_62_layers_give_46_window_and_16_full_with_the_last_full():
    c = MuseSparkConfig()
    assert c.layer_types.count("sliding_attention") == 46
    assert c.layer_types.count("full_attention") == 16
    assert c.layer_types[-1] == "full_attention" and c.layer_types[-5] == "full_attention"
    assert c.layer_types[-4:-1] == ["sliding_attention"] * 3
    assert 0.258 <= c.kv_cache_ratio(1_000_000) <= 0.260


def test_announced_widths():
    c = MuseSparkConfig()
    assert (c.hidden_size, c.moe_latent_size, c.num_experts, c.num_experts_per_tok) == (8192, 4096, 256, 8)
    experts = c.num_hidden_layers * c.num_experts * 3 * c.moe_latent_size * c.moe_intermediate_size
    assert abs(experts / 1e9 - 799) < 1
    latent = c.num_hidden_layers * 2 * c.hidden_size * c.moe_latent_size
    assert abs(latent / 1e9 - 4.2) < 0.1


def test_bad_layer_types_and_gate_are_errors():
    with pytest.raises(Exception, match="layer_types"):
        small_config(layer_types=["full_attention"])
    with pytest.raises(Exception, match="head_gate"):
        small_config(head_gate="per_token")


def test_save_pretrained_from_pretrained_round_trip(tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    model = make(small_config())
    ids = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        ref = model(ids).logits
    model.save_pretrained(tmp_path)
    assert type(AutoConfig.from_pretrained(tmp_path)) is MuseSparkConfig
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    # experts per expert on disk (vLLM's and the NVFP4 layout), fused in memory
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in keys
    assert "model.layers.0.mlp.experts.gate_up_proj" not in keys
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is MuseSparkForCausalLM
    assert loaded.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 64, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref, rtol=0, atol=0)


def test_loading_a_full_checkpoint_skips_the_encoders_and_says_so_once(tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    model = make(small_config())
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["vision_tower.blocks.0.attn.qkv.weight"] = torch.zeros(4, 4)
    tensors["audio_encoder.conv.weight"] = torch.zeros(4)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        loaded = MuseSparkForCausalLM.from_pretrained(tmp_path)
    said = [r for r in caplog.records if "vision/audio" in r.getMessage()]
    assert len(said) == 1 and "2 vision/audio" in said[0].getMessage()
    assert not any("vision_tower" in n for n, _ in loaded.named_parameters())


def test_sliding_window_layers_see_exactly_the_last_window_tokens():
    w = 4
    model = make(small_config(num_hidden_layers=1, layer_types=["sliding_attention"], sliding_window=w))
    ids = torch.randint(0, 64, (1, 16))
    t = 12

    def last_logits(x):
        with torch.no_grad():
            return model(x).logits[0, t]

    ref = last_logits(ids)
    outside, inside = ids.clone(), ids.clone()
    outside[0, t - w] = (ids[0, t - w] + 1) % 64
    inside[0, t - w + 1] = (ids[0, t - w + 1] + 1) % 64
    torch.testing.assert_close(last_logits(outside), ref)
    assert not torch.allclose(last_logits(inside), ref)
    full = make(small_config(num_hidden_layers=1, layer_types=["full_attention"]))
    with torch.no_grad():
        assert not torch.allclose(full(outside).logits[0, t], full(ids).logits[0, t])


@pytest.mark.parametrize("head_gate, out", [("headwise", 4), ("elementwise", 64)])
def test_head_gate_width(head_gate, out):
    model = make(small_config(head_gate=head_gate))
    assert model.model.layers[0].self_attn.g_proj.out_features == out
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 64, (1, 8))).logits).all()


def test_router_replay_drives_the_routing_and_keeps_live_weights():
    model = make(small_config())
    ids = torch.randint(0, 64, (2, 10))
    routers = [m for m in model.modules() if isinstance(m, MuseSparkTopKRouter)]
    assert len(routers) == 4
    live = {}
    hooks = [
        r.register_forward_hook(lambda m, a, o, i=i: live.__setitem__(i, o)) for i, r in enumerate(routers)
    ]
    with torch.no_grad():
        ref = model(ids).logits
    # replaying the live choice is bit-identical
    for i, r in enumerate(routers):
        r.replay = (live[i][2].clone(), torch.ones(20, dtype=torch.bool))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=0)
    # replaying other experts: those ids are used, weights are the live softmax gathered there, renormalised
    other = (live[0][2] + 1) % 8
    valid = torch.arange(20) % 2 == 0
    routers[0].replay = (other, valid)
    logits, weights, used = routers[0](torch.randn(20, 64))
    assert torch.equal(used[valid], other[valid])
    probs = torch.softmax(logits.float(), -1).gather(-1, used)
    torch.testing.assert_close(weights, probs / probs.sum(-1, keepdim=True))
    # gradients reach the router through the replayed weights
    for r in routers:
        r.replay = (
            torch.zeros(20, 2, dtype=torch.long) + torch.tensor([0, 1]),
            torch.ones(20, dtype=torch.bool),
        )
    model(ids).logits.sum().backward()
    assert routers[0].weight.grad is not None and routers[0].weight.grad.abs().sum() > 0
    for r in routers:
        r.replay = None
    for h in hooks:
        h.remove()


def test_router_replay_output_is_the_r3_adapter():
    """`replay_output(output, ids, valid)` has trainer/routing_replay.py's adapter signature."""
    router = MuseSparkTopKRouter(small_config())
    torch.nn.init.normal_(router.weight)
    out = router(torch.randn(6, 64))
    ids = torch.tensor([[3, 4]] * 6)
    valid = torch.tensor([True, False] * 3)
    logits, weights, used = router.replay_output(out, ids, valid)
    assert torch.equal(used[valid], ids[valid]) and torch.equal(used[~valid], out[2][~valid])
    torch.testing.assert_close(weights.sum(-1), torch.ones(6))
