"""bench.dequant's inputs on CPU (the timing itself needs a GPU): the decoder layer's packed weights it
measures, read from the trainer's model of each make-random preset, and the random packed form it times."""

import torch

from bench.dequant import layer_shapes, random_packed
from rl.quantize import preset_config


def test_the_layer_shapes_are_the_presets_weights():
    for preset in ("qwen3_30b_a3b", "muse_full_width"):
        c = preset_config(preset, layers=1)
        experts = getattr(c, "num_experts", None) or c.num_local_experts
        shapes = layer_shapes(preset)
        gate_up, down = shapes["gate_up_proj"], shapes["down_proj"]
        assert gate_up[0] == down[0] == experts, (preset, shapes)
        assert gate_up[1] == 2 * c.moe_intermediate_size == 2 * down[2], (preset, shapes)
        assert shapes["q_proj.weight"] == (c.num_attention_heads * c.head_dim, c.hidden_size), (
            preset,
            shapes,
        )


def test_random_packed_scales_are_finite_and_global_scales_one_an_expert():
    packed, scale, g = random_packed((3, 16, 64), "cpu")
    assert packed.shape == (3, 16, 32) and scale.shape == (3, 16, 4) and g.shape == (3,)
    assert torch.isfinite(scale.float()).all() and (g > 0).all()
    packed, scale, g = random_packed((16, 64), "cpu")
    assert packed.shape == (16, 32) and g.shape == (1,)
