"""NVFP4 checkpoints: the tiny Qwen3-MoE quantized with compressed-tensors' own NVFP4 compressor, then
dequantized by trainer.checkpoint_io; compared with compressed-tensors' decompression and with the
format's formula. No fakes."""

import json

import pytest
import torch

from rl.tiny import make_tiny
from trainer.checkpoint_io import dequantize_checkpoint, load_base_model, resolve_base_model
from trainer.nvfp4 import is_nvfp4_checkpoint, nvfp4_scheme, quantize_nvfp4
from trainer.testing import checkpoint_tensors


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvfp4")
    src = make_tiny("qwen3_moe")
    q = quantize_nvfp4(src, root / "nvfp4")
    return src, q, dequantize_checkpoint(q, root / "bf16")


def test_quantized_checkpoint_has_the_vllm_layout(checkpoints):
    _, q, _ = checkpoints
    assert is_nvfp4_checkpoint(q)
    cfg = json.loads((q / "config.json").read_text())["quantization_config"]
    assert cfg["format"] == "nvfp4-pack-quantized" and cfg["ignore"] == ["lm_head", "re:.*mlp.gate$"]
    group = cfg["config_groups"]["group_0"]
    assert group["input_activations"] is None and group["weights"]["group_size"] == 16
    t = checkpoint_tensors(q)
    e = "model.layers.1.mlp.experts.5.down_proj"  # [hidden 128, expert width 64]
    assert t[f"{e}.weight_packed"].dtype == torch.uint8 and t[f"{e}.weight_packed"].shape == (128, 32)
    assert t[f"{e}.weight_scale"].dtype == torch.float8_e4m3fn and t[f"{e}.weight_scale"].shape == (128, 4)
    assert t[f"{e}.weight_global_scale"].shape == (1,)
    for kept in ("lm_head.weight", "model.layers.0.mlp.gate.weight", "model.embed_tokens.weight"):
        assert kept in t and t[kept].is_floating_point()


def test_dequantized_equals_compressed_tensors_decompression_exactly(checkpoints):
    from compressed_tensors.compressors import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    src, q, dq = checkpoints
    packed, plain, original = checkpoint_tensors(q), checkpoint_tensors(dq), checkpoint_tensors(src)
    assert "quantization_config" not in json.loads((dq / "config.json").read_text())
    modules = [k[: -len(".weight_packed")] for k in packed if k.endswith(".weight_packed")]
    assert len(modules) == 4 * (4 + 8 * 3)  # attention q/k/v/o + 8 experts x 3 per layer
    for m in modules:
        parts = {p: packed[f"{m}.{p}"] for p in ("weight_packed", "weight_scale", "weight_global_scale")}
        want = NVFP4PackedCompressor.decompress(parts, nvfp4_scheme())["weight"]
        got = plain[f"{m}.weight"]
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), m
        # The format's formula: fp4 value * float(scale) / global scale, scale per group of 16 inputs.
        w = parts["weight_packed"]
        fp4 = unpack_fp4_from_uint8(w, w.shape[0], w.shape[1] * 2, dtype=torch.float32)
        scale = parts["weight_scale"].float().repeat_interleave(16, dim=1)
        formula = fp4 * scale / parts["weight_global_scale"]
        torch.testing.assert_close(got.float(), formula, rtol=1e-2, atol=1e-6)  # bf16 rounding
        # and it is a quantization of the original weight
        assert (got.float() - original[f"{m}.weight"]).abs().max() < 0.2 * original[f"{m}.weight"].abs().max()
    for k in ("lm_head.weight", "model.layers.2.mlp.gate.weight", "model.norm.weight"):
        assert torch.equal(plain[k], original[k])


def test_trainer_loads_an_nvfp4_directory_as_its_bf16_twin(checkpoints, tmp_path, monkeypatch):
    _, q, dq = checkpoints
    monkeypatch.setenv("SPARKRL_CACHE", str(tmp_path))
    waited = []
    path = resolve_base_model(str(q), is_writer=True, barrier=lambda: waited.append(1))
    assert waited == [1] and path.startswith(str(tmp_path))
    assert resolve_base_model(str(q), is_writer=False, barrier=lambda: None) == path  # cached
    model = load_base_model(path, torch.bfloat16)
    w = model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(w, checkpoint_tensors(dq)["model.layers.0.self_attn.q_proj.weight"])
    # a plain checkpoint loads as it is
    assert resolve_base_model(str(dq), True, lambda: None) == str(dq)


def test_refuses_to_overwrite_or_to_dequantize_a_plain_checkpoint(checkpoints, tmp_path):
    src, q, dq = checkpoints
    with pytest.raises(FileExistsError, match="exists; not overwriting"):
        dequantize_checkpoint(q, dq)
    with pytest.raises(
        ValueError, match="no compressed-tensors quantization_config of format 'nvfp4-pack-quantized'"
    ):
        dequantize_checkpoint(src, tmp_path / "x")
