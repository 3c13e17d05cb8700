"""`sparkrl quantize --scheme nvfp4` on every make-tiny architecture: what is quantized, and the error bound."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from rl.tiny import ARCHES


@pytest.fixture(scope="module", params=ARCHES)
def quantized(request, tmp_path_factory):
    from rl.quantize import quantize
    from rl.tiny import make_tiny
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


def test_quantize_takes_a_hub_id_from_the_hugging_face_cache(tmp_path, tiny_dense_path, monkeypatch):
    """`sparkrl quantize owner/name DST`: the hub id resolves to its snapshot in the local cache (here offline, a
    cache laid out as huggingface_hub lays it out); one the cache lacks is one line naming it."""
    import shutil

    from rl.quantize import quantize

    repo = tmp_path / "hub" / "models--org--tiny"
    shutil.copytree(tiny_dense_path, repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = quantize("org/tiny", tmp_path / "q")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert config["hidden_size"] == json.loads((tiny_dense_path / "config.json").read_text())["hidden_size"]
    with pytest.raises(
        FileNotFoundError,
        match="org/missing is neither a local model directory nor a model found "
        "in the local Hugging Face cache",
    ):
        quantize("org/missing", tmp_path / "q2")
    assert not (tmp_path / "q2").exists()
    bare = tmp_path / "hub" / "models--org--bare" / "snapshots" / ("b" * 40)  # config.json alone
    bare.mkdir(parents=True)
    shutil.copy(tiny_dense_path / "config.json", bare)
    (bare.parents[1] / "refs").mkdir()
    (bare.parents[1] / "refs" / "main").write_text("b" * 40)
    with pytest.raises(
        FileNotFoundError, match=r"org/bare: no \*.safetensors weights in the local Hugging Face"
    ):
        quantize("org/bare", tmp_path / "q3")


def test_register_adds_the_quantize_subcommand():
    from rl.quantize import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["quantize", "a", "b", "--scheme", "nvfp4"])
    assert (args.command, args.src, args.dst, args.scheme) == ("quantize", "a", "b", "nvfp4")
    assert callable(args.func)


def test_fused_projections_share_one_global_scale(quantized):
    """vLLM keeps one global scale per fused weight (qkv_proj, gate_up_proj, experts' w13): the members of
    each group must have been quantized with the same one, taken from the group's overall range."""
    from trainer.nvfp4 import FUSED_GROUPS

    arch, src, q, _ = quantized
    t, original = _tensors(q), _tensors(src)
    groups = 0
    for name in t:
        if not name.endswith(".q_proj.weight_global_scale") and not name.endswith(
            ".gate_proj.weight_global_scale"
        ):
            continue
        parent = name.rsplit(".", 2)[0]
        members = next(g for g in FUSED_GROUPS if name.rsplit(".", 2)[1] in g)
        scales = [t[f"{parent}.{m}.weight_global_scale"] for m in members]
        assert all(torch.equal(s, scales[0]) for s in scales), (arch, parent)
        # The shared scale comes from the largest magnitude in the group (FP8 max * FP4 max / amax).
        amax = max(original[f"{parent}.{m}.weight"].float().abs().max() for m in members)
        torch.testing.assert_close(scales[0], torch.tensor([448.0 * 6.0]) / amax, rtol=1e-5, atol=0)
        groups += 1
    assert groups > 0, f"{arch}: no fused q/k/v or gate/up group found"


@pytest.mark.parametrize("entry", ["sparkrl quantize", "quantize_nvfp4"])
def test_a_fused_group_split_across_shards_still_shares_its_scale(entry, tmp_path, tiny_moe_path):
    """Sharded checkpoints (every real one) can put q_proj and k_proj in different files: compressed-tensors
    loads the group together through the converter's dependencies, whichever entry point built it."""
    from safetensors.torch import save_file

    from rl.quantize import quantize
    from trainer.nvfp4 import quantize_nvfp4

    src = tmp_path / "sharded"
    src.mkdir()
    for f in tiny_moe_path.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            (src / f.name).write_bytes(f.read_bytes())
    tensors = _tensors(tiny_moe_path)
    names = sorted(tensors)
    # q/k/v and gate/up of one layer land in different shards: alternate by name.
    shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, src / shard)
        weight_map.update(dict.fromkeys(keys, shard))
    assert (
        weight_map["model.layers.0.self_attn.q_proj.weight"]
        != weight_map["model.layers.0.self_attn.k_proj.weight"]
    )
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    convert = quantize if entry == "sparkrl quantize" else quantize_nvfp4
    q = _tensors(convert(src, tmp_path / "nvfp4"))
    prefix = "model.layers.0.self_attn"
    for m in ("q_proj", "k_proj", "v_proj"):
        assert f"{prefix}.{m}.weight_packed" in q and f"{prefix}.{m}.weight" not in q
    assert torch.equal(q[f"{prefix}.q_proj.weight_global_scale"], q[f"{prefix}.k_proj.weight_global_scale"])
    assert torch.equal(q[f"{prefix}.q_proj.weight_global_scale"], q[f"{prefix}.v_proj.weight_global_scale"])
    e = "model.layers.1.mlp.experts.3"
    assert torch.equal(q[f"{e}.gate_proj.weight_global_scale"], q[f"{e}.up_proj.weight_global_scale"])
