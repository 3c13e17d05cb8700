"""`sparkrl make-random`: a random-weight checkpoint written in NVFP4 directly. Same layout as `sparkrl
quantize` writes for the architecture (names, dtypes, shapes, quantization_config); the trainer's loader reads
it packed; its weights dequantize to the asked standard deviation; the model gives finite logits."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rl.quantize import (
    fp4_code_probs,
    make_random,
    packed_byte_table,
    padded_tokenizer,
    preset_config,
    quantize,
    random_nvfp4,
)
from rl.tiny import make_tiny
from trainer.testing import checkpoint_tensors


def test_codes_follow_a_quantized_gaussian_and_dequantize_to_the_asked_std():
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    p = fp4_code_probs()
    assert math.isclose(sum(p), 1.0) and p[8] == 0.0 and p[0] == max(p)  # +0 the likeliest, -0 never
    assert p[1:8] == p[9:16]  # symmetric
    t = random_nvfp4((256, 512), std=0.02, seed=3)
    assert t["weight_packed"].dtype == torch.uint8 and t["weight_packed"].shape == (256, 256)
    assert t["weight_scale"].dtype == torch.float8_e4m3fn and t["weight_scale"].shape == (256, 32)
    assert t["weight_global_scale"].dtype == torch.float32 and t["weight_global_scale"].shape == (1,)
    w = unpack_fp4_from_uint8(t["weight_packed"], 256, 512, dtype=torch.float32)
    w = w * t["weight_scale"].float().repeat_interleave(16, dim=1) / t["weight_global_scale"]
    assert abs(w.std().item() - 0.02) < 0.0005 and abs(w.mean().item()) < 0.0005
    assert w.abs().max().item() <= 6 * 0.02 / packed_byte_table()[1] + 1e-6
    assert torch.equal(random_nvfp4((256, 512), 0.02, 3)["weight_packed"], t["weight_packed"])  # seeded


def test_tokenizer_is_padded_to_the_vocabulary_and_decodes_every_id():
    tok = padded_tokenizer(4096)
    assert len(tok) == 4096
    assert tok.decode([4095]) == "<|filler_4095|>"
    assert tok.eos_token == "<|end|>" and tok.eos_token_id < 64
    assert tok.apply_chat_template([{"role": "user", "content": "1 + 2 ="}], tokenize=False)


@pytest.fixture(scope="module", params=["qwen3_moe", "muse"])
def written(request, tmp_path_factory):
    """make-random of the tiny arch's config, beside `sparkrl quantize` of the tiny model itself."""
    root = tmp_path_factory.mktemp(request.param)
    tiny = make_tiny(request.param)
    reference = quantize(tiny, root / "quantized")
    out = make_random(
        str(tiny), root / "random", seed=0, device="cpu", max_shard_bytes=2**16, report=lambda line: None
    )
    return request.param, reference, out


def test_same_layout_as_sparkrl_quantize(written):
    _, reference, out = written
    want, got = checkpoint_tensors(reference), checkpoint_tensors(out)
    assert sorted(got) == sorted(want)
    for k in want:
        assert (got[k].dtype, got[k].shape) == (want[k].dtype, want[k].shape), k
    qc_want = json.loads((reference / "config.json").read_text())["quantization_config"]
    qc_got = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc_got == qc_want
    # vLLM picks the model class, and that it generates, by the architectures a checkpoint names
    arch = json.loads((reference / "config.json").read_text())["architectures"]
    assert json.loads((out / "config.json").read_text())["architectures"] == arch
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(got) and len(set(index["weight_map"].values())) > 1
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in got.values())


def test_fused_groups_share_a_global_scale(written):
    _, _, out = written
    t = checkpoint_tensors(out)
    q, k, v = (t[f"model.layers.0.self_attn.{p}_proj.weight_global_scale"] for p in "qkv")
    assert torch.equal(q, k) and torch.equal(q, v)
    e = "model.layers.1.mlp.experts.3"
    assert torch.equal(t[f"{e}.gate_proj.weight_global_scale"], t[f"{e}.up_proj.weight_global_scale"])


def test_trainer_reads_it_packed_and_it_dequantizes_to_an_init(written):
    from trainer.nvfp4_tensor import NVFP4Weight
    from trainer.sharded_load import CheckpointRows, build_empty_model, checkpoint_name

    _, _, out = written
    model = build_empty_model(str(out), torch.float32)
    std = model.config.initializer_range
    packed = 0
    with CheckpointRows(out) as ckpt:
        for name, p in model.named_parameters():
            source = checkpoint_name(name)
            if not ckpt.is_packed(source):
                continue
            assert ckpt.packed_shape(source) == tuple(p.shape), source
            triple = ckpt.packed_rows(source, 0, p.shape[0])
            w = NVFP4Weight(triple["packed"], triple["scale"], triple["global_scale"], p.shape, torch.float32)
            d = w.dequantize()
            assert torch.isfinite(d).all() and abs(d.std().item() - std) < 0.1 * std, source
            packed += 1
    assert packed >= 6  # q, k, v, o, gate_up, down of a layer at least


def test_the_model_gives_finite_logits(written, tmp_path):
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint_io import dequantize_checkpoint

    _, _, out = written
    model = AutoModelForCausalLM.from_pretrained(
        dequantize_checkpoint(out, tmp_path / "bf16"), dtype=torch.float32
    )
    ids = torch.arange(5, 69)[None]
    logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all() and logits.std() > 0.1  # not flat: the weights are not all tiny


def test_presets_at_their_real_shapes():
    from rl.models.qwen3_moe import QWEN3_30B_A3B
    from rl.plan import builtin_shape, shape_from_hf
    from rl.quantize import checkpoint_layout

    qwen = preset_config("qwen3_30b_a3b")
    for k, v in QWEN3_30B_A3B.items():
        assert getattr(qwen, k) == v or (k == "mlp_only_layers" and getattr(qwen, k) == []), k
    written_shape = shape_from_hf(qwen.to_dict(), "random", "make-random")
    assert (
        written_shape.params == builtin_shape("Qwen/Qwen3-30B-A3B").params
    )  # the planner sees the same model
    layout = checkpoint_layout(qwen)
    assert layout["model.layers.47.mlp.experts.127.down_proj.weight"].shape == (2048, 768)
    assert len([k for k in layout if ".mlp.experts." in k]) == 48 * 128 * 3

    muse = preset_config("muse_full_width", layers=3)
    assert (muse.hidden_size, muse.num_experts, muse.moe_intermediate_size, muse.moe_latent_size) == (
        8192,
        256,
        4096,
        4096,
    )
    assert muse.num_hidden_layers == 3 and muse.layer_types[-1] == "full_attention"
    layout = checkpoint_layout(muse)
    assert layout["model.layers.2.mlp.experts.255.gate_proj.weight"].shape == (4096, 4096)
    assert layout["model.layers.0.self_attn.q_proj.weight"].shape == (96 * 128, 8192)
    with pytest.raises(ValueError, match="ARCH must be one of"):
        preset_config("no_such_model")
