"""rollout.adapter_layout against PEFT's own semantics on the tiny Qwen3-MoE (hidden 128, 8 experts, I=64)."""

from __future__ import annotations

import math

import pytest
import torch

from rl.tiny import make_tiny
from rollout.adapter_layout import (
    AdapterLayoutError,
    _scaled,
    lora_delta,
    merged_to_checkpoint,
    peft_to_vllm,
    sibling_prefix,
    split_fused_lora,
)
from rollout.safetensors_io import write_safetensors

E, H, INTER, LAYERS = 8, 128, 64, 4


def _peft_moe(target_parameters, rank=4, alpha=8.0, use_rslora=False, seed=0, rank_pattern=None):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_tiny("qwen3_moe"), dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        use_rslora=use_rslora,
        target_modules=["q_proj", "v_proj"],
        target_parameters=target_parameters,
        rank_pattern=rank_pattern or {},
    )
    peft_model = get_peft_model(model, config)
    torch.manual_seed(seed)
    # PEFT initialises B to zero; random B (and A) make every delta non-zero and distinct.
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.1)
    return peft_model, config


def _saved(peft_model, config):
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model), config.to_dict()


def _wrappers(peft_model, layer):
    """{parameter name: ParamWrapper} of one layer's experts (nested wrappers)."""
    out, mod = {}, peft_model.base_model.model.model.layers[layer].mlp.experts
    while hasattr(mod, "parameter_name"):
        out[mod.parameter_name] = mod
        mod = mod.base_layer
    return out


@pytest.fixture(scope="module")
def moe_both():
    peft_model, config = _peft_moe(["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    tensors, cfg = _saved(peft_model, config)
    return peft_model, tensors, cfg, peft_to_vllm(tensors, cfg)


def test_per_expert_keys_and_shapes(moe_both):
    _, _, _, (out, cfg) = moe_both
    pre = "base_model.model.model.layers.2.mlp.experts"
    for e in range(E):
        assert out[f"{pre}.{e}.gate_proj.lora_A.weight"].shape == (4, H)
        assert out[f"{pre}.{e}.gate_proj.lora_B.weight"].shape == (INTER, 4)
        assert out[f"{pre}.{e}.up_proj.lora_A.weight"].shape == (4, H)
        assert out[f"{pre}.{e}.up_proj.lora_B.weight"].shape == (INTER, 4)
        assert out[f"{pre}.{e}.down_proj.lora_A.weight"].shape == (4, INTER)
        assert out[f"{pre}.{e}.down_proj.lora_B.weight"].shape == (H, 4)
    # No fused (3D-layout) key survives; attention keys keep their PEFT names.
    assert not [k for k in out if "base_layer" in k or k.endswith("experts.lora_A.weight")]
    assert out["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, H)
    # 4 layers x (8 experts x 3 projections + q + v) x (A, B)
    assert len(out) == LAYERS * (E * 3 + 2) * 2
    assert cfg["target_modules"] == ["down_proj", "gate_proj", "q_proj", "up_proj", "v_proj"]
    assert cfg["r"] == cfg["lora_alpha"] == 4 and cfg["use_rslora"] is False
    assert "target_parameters" not in cfg


def test_per_expert_delta_equals_peft_fused_delta(moe_both):
    peft_model, _, _, (out, _) = moe_both
    for layer in range(LAYERS):
        pre = f"base_model.model.model.layers.{layer}.mlp.experts"
        wrappers = _wrappers(peft_model, layer)
        gate_up = wrappers["gate_up_proj"].get_delta_weight("default")  # [E, 2I, H] (storage order)
        down = wrappers["down_proj"].get_delta_weight("default")  # [E, H, I]
        assert gate_up.shape == (E, 2 * INTER, H) and down.shape == (E, H, INTER)
        for e in range(E):
            for proj, want in (
                ("gate_proj", gate_up[e, :INTER]),
                ("up_proj", gate_up[e, INTER:]),
                ("down_proj", down[e]),
            ):
                torch.testing.assert_close(lora_delta(out, f"{pre}.{e}", proj), want, rtol=1e-5, atol=1e-6)


def test_attention_delta_has_scaling_folded_in(moe_both):
    peft_model, _, _, (out, _) = moe_both
    q = peft_model.base_model.model.model.layers[1].self_attn.q_proj
    pre = "base_model.model.model.layers.1.self_attn.q_proj"
    got = out[f"{pre}.lora_B.weight"] @ out[f"{pre}.lora_A.weight"]
    torch.testing.assert_close(got, q.get_delta_weight("default"), rtol=1e-5, atol=1e-6)


def test_rslora_and_single_fused_parameter():
    peft_model, config = _peft_moe(["mlp.experts.down_proj"], rank=2, alpha=3.0, use_rslora=True, seed=1)
    out, cfg = peft_to_vllm(*_saved(peft_model, config))
    down = _wrappers(peft_model, 3)["down_proj"].get_delta_weight("default")
    pre = "base_model.model.model.layers.3.mlp.experts"
    for e in range(E):
        got = out[f"{pre}.{e}.down_proj.lora_B.weight"] @ out[f"{pre}.{e}.down_proj.lora_A.weight"]
        torch.testing.assert_close(got, down[e], rtol=1e-5, atol=1e-6)
    assert not [k for k in out if "gate_proj" in k or "up_proj" in k]
    assert cfg["target_modules"] == ["down_proj", "q_proj", "v_proj"]


def test_split_fused_lora_indexing():
    # A rows are expert-major, B columns rank-major (PEFT ParamWrapper); a mix-up would pair wrong factors.
    rank, experts = 2, 3
    a = torch.arange(rank * experts, dtype=torch.float32)[:, None].repeat(1, 5)  # row id in every column
    b = torch.arange(rank * experts, dtype=torch.float32)[None, :].repeat(7, 1)  # column id in every row
    a3, b3 = split_fused_lora(a, b, rank)
    assert a3.shape == (3, 2, 5) and b3.shape == (3, 7, 2) and a3.is_contiguous() and b3.is_contiguous()
    assert [a3[e][:, 0].tolist() for e in range(experts)] == [[0, 1], [2, 3], [4, 5]]
    assert [b3[e][0].tolist() for e in range(experts)] == [[0, 3], [1, 4], [2, 5]]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.itemsize])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scaling_in_one_pass_is_bitwise_the_float32_route(dtype):
    """`_scaled` (one multiply in the input dtype) equals the former `(b.float() * scale).to(dtype)`."""
    rank, experts, out = 6, 8, 63  # 63 rows: the vectorised kernels also run their scalar tail
    b = (torch.randn(out, rank * experts, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    b[0, :4] = torch.tensor([0.0, -0.0, 1e-7, 6e4])  # signed zeros, an fp16 subnormal, fp16 overflow at x2
    for scale in (2.0, 0.5, 1.0, 1 / 3, 16 / math.sqrt(6), 7.3):
        want = (b.float() * scale).to(dtype)
        assert torch.equal(_bits(_scaled(b, scale)), _bits(want))
        _, b3 = split_fused_lora(torch.zeros(rank * experts, 5, dtype=dtype), b, rank, scale)
        assert torch.equal(_bits(b3), _bits(want.reshape(out, rank, experts).permute(2, 0, 1)))


def _reference_vllm_layout(tensors: dict, cfg: dict) -> dict:
    """The conversion as it was before the per-expert views (an independent copy per key, B scaled in
    float32), written from PEFT's ParamWrapper layout (expert e: A rows e*r.., B columns e, e+E, ..) rather
    than from split_fused_lora. The inner wrapper (`experts.base_layer`) is gate_up_proj here."""
    out = {}
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        b = tensors[key.replace(".lora_A.", ".lora_B.")]
        module = key.split(".lora_A.")[0]
        rank = a.shape[0] // E if ".experts" in module else a.shape[0]
        b = (b.float() * (cfg["lora_alpha"] / rank)).to(b.dtype)
        if ".experts" not in module:
            out[f"{module}.lora_A.weight"], out[f"{module}.lora_B.weight"] = a.clone(), b
            continue
        projections = ("gate_proj", "up_proj") if module.endswith(".base_layer") else ("down_proj",)
        module = module.removesuffix(".base_layer")
        width = b.shape[0] // len(projections)
        for e in range(E):
            for i, proj in enumerate(projections):
                out[f"{module}.{e}.{proj}.lora_A.weight"] = a[e * rank : (e + 1) * rank].clone()
                out[f"{module}.{e}.{proj}.lora_B.weight"] = b[i * width : (i + 1) * width, e::E].clone()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# PEFT warns that a rank_pattern key naming a parameter matched no module, and applies it all the same.
@pytest.mark.filterwarnings("ignore:The following rank_pattern keys did not match")
def test_staged_file_is_bitwise_the_per_expert_copies(dtype, tmp_path):
    """peft_to_vllm's views written by write_safetensors read back (safetensors' own reader) as exactly the
    independent per-expert tensors the conversion produced before, rank pattern included."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    peft_model, config = _peft_moe(
        ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        seed=2,
        rank_pattern={"mlp.experts.down_proj": 2, "v_proj": 8},
    )
    tensors, cfg = _saved(peft_model, config)
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    out, vllm_cfg = peft_to_vllm(tensors, cfg)
    path = tmp_path / "adapter_model.safetensors"
    assert write_safetensors(path, out) == path.stat().st_size
    got, want = load_file(str(path)), _reference_vllm_layout(tensors, cfg)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == dtype and got[key].shape == value.shape, key
        assert torch.equal(_bits(got[key]), _bits(value)), key
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"} and set(f.keys()) == set(want)
    # The comparison is sensitive to a swap: gate and up (and two experts) hold different values.
    pre = "base_model.model.model.layers.1.mlp.experts"
    assert not torch.equal(want[f"{pre}.3.gate_proj.lora_B.weight"], want[f"{pre}.3.up_proj.lora_B.weight"])
    assert not torch.equal(want[f"{pre}.3.down_proj.lora_A.weight"], want[f"{pre}.4.down_proj.lora_A.weight"])
    assert got[f"{pre}.0.down_proj.lora_A.weight"].shape == (2, INTER) and vllm_cfg["r"] == 8
    if dtype == torch.float32:  # and the file's deltas are PEFT's own, rank pattern included
        down = _wrappers(peft_model, 1)["down_proj"].get_delta_weight("default")
        torch.testing.assert_close(lora_delta(got, f"{pre}.5", "down_proj"), down[5], rtol=1e-5, atol=1e-6)


def test_in_memory_adapter_names_and_numpy_are_accepted(moe_both):
    _, tensors, cfg, (out, _) = moe_both
    renamed = {
        k.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight"
        ): v.numpy()
        for k, v in tensors.items()
    }
    out2, _ = peft_to_vllm(renamed, cfg)
    assert out2.keys() == out.keys()
    assert all(torch.equal(out[k], out2[k]) for k in out)


def test_errors_name_the_problem(moe_both):
    _, tensors, cfg, _ = moe_both
    with pytest.raises(AdapterLayoutError, match="lm_head.weight"):
        peft_to_vllm({**tensors, "base_model.model.lm_head.weight": torch.zeros(1)}, cfg)
    with pytest.raises(AdapterLayoutError, match="wrapper depth"):
        peft_to_vllm(tensors, {**cfg, "target_parameters": ["mlp.experts.down_proj"]})
    with pytest.raises(AdapterLayoutError, match="alpha_pattern"):
        peft_to_vllm(tensors, {**cfg, "alpha_pattern": {"q_proj": 4}})
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    with pytest.raises(AdapterLayoutError, match="q_proj.*lora_A only"):
        peft_to_vllm({k: v for k, v in tensors.items() if k != key}, cfg)


def test_merged_weights_match_checkpoint_names_and_values(moe_both):
    """merge_and_unload's state dict, converted, has exactly the checkpoint's names, base + delta values."""
    import copy

    from safetensors.torch import load_file

    peft_model = copy.deepcopy(moe_both[0])
    wrappers = _wrappers(peft_model, 0)
    delta_gate_up = wrappers["gate_up_proj"].get_delta_weight("default")
    merged = merged_to_checkpoint(peft_model.merge_and_unload().state_dict())
    base = load_file(str(make_tiny("qwen3_moe") / "model.safetensors"))
    assert merged.keys() == base.keys()
    name = "model.layers.0.mlp.experts.5.up_proj.weight"
    torch.testing.assert_close(merged[name], base[name] + delta_gate_up[5, INTER:], rtol=1e-5, atol=1e-6)
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    with pytest.raises(AdapterLayoutError, match="merge the adapter first"):
        merged_to_checkpoint({"model.layers.0.self_attn.q_proj.base_layer.weight": torch.zeros(2, 2)})


def test_sibling_prefix():
    assert sibling_prefix("model.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn."
    assert sibling_prefix("model.layers.12.mlp.experts.7.up_proj.weight") == "model.layers.12.mlp."
    assert sibling_prefix("lm_head.weight") == "lm_head.weight"


def test_stacked_experts_split_by_vllm_equal_the_per_expert_layout(moe_both, tmp_path):
    """The stacked layout (EngineSpec.lora_experts_stacked), written by write_safetensors, read by vLLM's own
    adapter reader (`LoRAModel.from_local_checkpoint`) and split by vLLM's own
    `LoRAModelManager._convert_3d_to_2d_moe_lora`, is per expert exactly the per-expert layout, scaling
    included. Fake: vLLM-CPU cannot build an MoE-LoRA engine (its MoE-LoRA path needs Triton), so the split
    runs with stand-ins for the manager and the experts layer that hold only the attributes it reads."""
    import json
    import types

    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.peft_helper import PEFTHelper

    _, tensors, cfg, (per_expert, per_expert_cfg) = moe_both
    stacked, stacked_cfg = peft_to_vllm(tensors, cfg, stacked_experts=True)
    assert len(stacked) == LAYERS * (2 + 2) * 2  # per layer: q, v, experts (gate_up), experts (down); A and B
    assert stacked_cfg["target_modules"] == ["experts", "q_proj", "v_proj"]
    assert stacked_cfg["r"] == stacked_cfg["lora_alpha"] == per_expert_cfg["r"]
    write_safetensors(tmp_path / "adapter_model.safetensors", stacked)
    (tmp_path / "adapter_config.json").write_text(json.dumps(stacked_cfg))

    helper = PEFTHelper.from_local_dir(str(tmp_path), max_position_embeddings=None)
    lora = LoRAModel.from_local_checkpoint(
        str(tmp_path), {"q_proj", "v_proj", "experts"}, helper, lora_model_id=1, device="cpu"
    )
    manager = types.SimpleNamespace(
        model=types.SimpleNamespace(config=types.SimpleNamespace(architectures=["Qwen3MoeForCausalLM"])),
        is_pooling_model=False,
    )
    manager._get_lora_layer_weights = types.MethodType(LoRAModelManager._get_lora_layer_weights, manager)
    experts_layer = types.SimpleNamespace(local_num_experts=E, global_num_experts=E, ep_rank=0)
    for layer in range(LAYERS):
        name = f"model.layers.{layer}.mlp.experts"
        LoRAModelManager._convert_3d_to_2d_moe_lora(manager, lora, experts_layer, name)
        split = lora.get_lora(name)
        assert split.scaling == 1.0
        pre = f"base_model.model.{name}"
        for i, proj in enumerate(("gate_proj", "down_proj", "up_proj")):  # vLLM's order: w1, w2, w3
            for e in range(E):
                for ab, got in (("A", split.lora_a[i][e]), ("B", split.lora_b[i][e])):
                    want = per_expert[f"{pre}.{e}.{proj}.lora_{ab}.weight"]
                    assert torch.equal(got, want), (name, proj, e, ab)
    q = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"
    assert torch.equal(lora.get_lora("model.layers.1.self_attn.q_proj").lora_b, per_expert[q])


def test_stacked_experts_need_both_fused_parameters():
    peft_model, config = _peft_moe(["mlp.experts.down_proj"])
    tensors, cfg = _saved(peft_model, config)
    assert any("experts" in k for k in peft_to_vllm(tensors, cfg)[0])  # per expert: fine
    with pytest.raises(AdapterLayoutError, match=r"layers\.0\.mlp\.experts: the stacked expert layout needs"):
        peft_to_vllm(tensors, cfg, stacked_experts=True)
