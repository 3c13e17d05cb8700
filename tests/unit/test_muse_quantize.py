"""`sparkrl quantize --scheme nvfp4` on every make-tiny architecture: what is quantized, and the error bound."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from rl.models.tiny import ARCHES


@pytest.fixture(scope="module", params=ARCHES)
def quantized(request, tmp_path_factory):
    from rl.models.tiny import make_tiny
    from rl.quantize import quantize
    from trainer.nvfp4 import dequantize_nvfp4

    src = make_tiny(request.param)
    root = tmp_path_factory.mktemp(request.param)
    quantize(src, root / "nvfp4", scheme="nvfp4")
    dequantize_nvfp4(root / "nvfp4", root / "deq", dtype=torch.float32)
    return request.param, src, root / "nvfp4", root / "deq"


def _tensors(path):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_what_stays_in_high_precision(quantized):
    arch, src, q, _ = quantized
    config = json.loads((q / "config.json").read_text())["quantization_config"]
    assert config["format"] == "nvfp4-pack-quantized" and config["quant_method"] == "compressed-tensors"
    group = next(iter(config["config_groups"].values()))
    assert group["input_activations"] is None and group["weights"]["group_size"] == 16
    t = _tensors(q)
    for keep in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
    ):
        assert keep in t and t[keep].dtype != torch.uint8
    if arch != "dense":
        assert "model.layers.0.mlp.gate.weight" in t  # the router
        assert t["model.layers.0.mlp.experts.0.down_proj.weight_packed"].dtype == torch.uint8
    assert t["model.layers.0.self_attn.q_proj.weight_scale"].dtype == torch.float8_e4m3fn
    if arch == "muse":
        assert (
            "model.layers.0.mlp.pooler.weight_packed" in t
            and "model.layers.0.mlp.unpooler.weight_packed" in t
        )
        assert "model.layers.0.self_attn.g_proj.weight" in t  # head gate: too few rows for FP4 tiles
        assert "re:.*self_attn.g_proj$" in config["ignore"]


def test_dequantized_weights_are_within_the_nvfp4_error_bound(quantized):
    """Per group of 16 the FP4 grid {0, .5, 1, 1.5, 2, 3, 4, 6} x s is at most 2s apart (between 4 and 6),
    so rounding errs by at most s; s is amax / 6 stored as FP8 e4m3 (3 mantissa bits, within 1/8 of it).
    Bound: err <= amax / 6 * (1 + 1/8). Weights that are not quantized come back bit for bit."""
    _, src, q, deq = quantized
    orig, qt, back = _tensors(src), _tensors(q), _tensors(deq)
    checked = 0
    for name, w in orig.items():
        module = name.removesuffix(".weight")
        if module + ".weight_packed" not in qt:
            torch.testing.assert_close(back[name].float(), w.float(), rtol=0, atol=0)
            continue
        groups = w.float().reshape(w.shape[0], -1, 16)
        err = (back[name].float().reshape_as(groups) - groups).abs().amax(-1)
        bound = groups.abs().amax(-1) / 6 * (1 + 1 / 8) + 1e-12
        assert (err <= bound).all(), f"{name}: worst err/bound {(err / bound).max():.3f}"
        assert (back[name].float() - w.float()).norm() / w.float().norm() < 0.12
        checked += 1
    assert checked > 0


def test_quantize_refuses_unknown_schemes_and_existing_outputs(tmp_path, tiny_dense_path):
    from rl.quantize import quantize

    with pytest.raises(ValueError, match="scheme"):
        quantize(tiny_dense_path, tmp_path / "x", scheme="int3")
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError):
        quantize(tiny_dense_path, tmp_path / "taken")


def test_register_adds_the_quantize_subcommand():
    from rl.quantize import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["quantize", "a", "b", "--scheme", "nvfp4"])
    assert (args.command, args.src, args.dst, args.scheme) == ("quantize", "a", "b", "nvfp4")
    assert callable(args.func)
