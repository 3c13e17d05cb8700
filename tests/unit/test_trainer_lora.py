"""trainer.lora on the tiny Qwen3-MoE (single process, real PEFT): targets, the exported adapter loading
back with PEFT, the merge against PEFT's merge, and errors for adapters that do not fit."""

import copy

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict

from rl.core.adapter_files import read_peft_dir
from rl.core.compat import hf_checkpoint_state_dict
from rl.tiny import make_tiny
from trainer.checkpoint_io import write_adapter
from trainer.config import LoraConfig
from trainer.lora import apply_lora, check_adapter, lora_config, lora_layout, merge_lora, peft_config_dict
from trainer.testing import random_samples, reference_logprobs


def base():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(make_tiny("qwen3_moe"), dtype=torch.float32)


@pytest.fixture(scope="module")
def model():
    m = apply_lora(base(), LoraConfig(rank=4, alpha=8.0), seed=0, init_lora_weights=False)
    return m.eval()


def test_targets_attention_and_fused_experts_but_not_router_or_norms(model):
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 4 * (4 + 2) * 2  # layers x (q, k, v, o, gate_up, down) x (A, B)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if p.requires_grad)
    assert not any(".gate." in n or "norm" in n for n in trainable)
    cfg = lora_config(base(), LoraConfig(rank=8, alpha=16.0, target_modules=[]))
    assert cfg.target_modules in (None, set()) and set(cfg.target_parameters) == {
        "mlp.experts.gate_up_proj",
        "mlp.experts.down_proj",
    }


def _adapted(model) -> set[str]:
    """Full names of the modules (and fused expert parameters' modules) that carry a LoRA."""
    return {n.split(".lora_A.")[0] for n, p in model.named_parameters() if ".lora_A." in n}


def test_targets_are_exactly_the_named_projections_in_the_adapter_config_too(tmp_path):
    model = apply_lora(
        base(), LoraConfig(rank=4, alpha=16.0, target_modules=["q_proj"], target_experts=False), seed=0
    )
    adapted = _adapted(model)
    assert len(adapted) == 4 and all(n.endswith("self_attn.q_proj") for n in adapted)
    config = peft_config_dict(model, "base")
    assert config["target_modules"] == ["q_proj"] and not config.get("target_parameters")
    # The file the rollout side reads: vLLM's layout of it names q_proj alone too.
    from rollout.adapter_layout import peft_to_vllm

    _, vllm_config = peft_to_vllm(get_peft_model_state_dict(model), config)
    assert vllm_config["target_modules"] == ["q_proj"]
    two = apply_lora(
        base(),
        LoraConfig(rank=4, alpha=16.0, target_modules=["k_proj", "o_proj"], target_experts=False),
        seed=0,
    )
    assert {n.rsplit(".", 1)[-1] for n in _adapted(two)} == {"k_proj", "o_proj"}


def test_extra_is_a_regex_matched_in_full_against_full_module_names():
    spec = LoraConfig(
        rank=4,
        alpha=16.0,
        target_modules=[],
        target_experts=False,
        extra=r"model\.layers\.[02]\.self_attn\.(q|v)_proj",
    )
    model = apply_lora(base(), spec, seed=0)
    assert {n.removeprefix("base_model.model.") for n in _adapted(model)} == {
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.2.self_attn.q_proj",
        "model.layers.2.self_attn.v_proj",
    }
    # In full: a pattern that only matches part of a name matches nothing.
    with pytest.raises(ValueError, match=r"lora.extra: 'q_proj' matches no module name"):
        lora_config(base(), LoraConfig(rank=8, alpha=16.0, extra="q_proj"))


def test_bad_targets_are_named():
    with pytest.raises(
        ValueError, match=r"matches the router 'model.layers.0.mlp.gate'; routers stay frozen"
    ):
        lora_config(base(), LoraConfig(rank=8, alpha=16.0, extra=r"model\.layers\.0\.mlp\.gate"))
    with pytest.raises(ValueError, match="lora.target_modules: 'gate' is a router"):
        lora_config(base(), LoraConfig(rank=8, alpha=16.0, target_modules=["q_proj", "gate"]))
    with pytest.raises(ValueError, match="lora.target_modules: the model has no module named 'w_in'"):
        lora_config(base(), LoraConfig(rank=8, alpha=16.0, target_modules=["w_in"]))
    with pytest.raises(ValueError, match="dropout must be 0 with expert targets"):
        lora_config(base(), LoraConfig(rank=8, alpha=16.0, dropout=0.1))
    with pytest.raises(ValueError, match="no target modules or parameters"):
        lora_config(base(), LoraConfig(rank=8, alpha=16.0, target_modules=[], target_experts=False))


def test_exported_adapter_loads_with_peft_and_gives_the_same_log_probs(model, tmp_path):
    write_adapter(
        tmp_path / "a", get_peft_model_state_dict(model), peft_config_dict(model, str(make_tiny("qwen3_moe")))
    )
    loaded = PeftModel.from_pretrained(base(), tmp_path / "a").eval()
    s = random_samples(1, seed=2)[0]
    with torch.no_grad():
        assert torch.equal(reference_logprobs(loaded, s, None), reference_logprobs(model, s, None))


def test_merge_equals_peft_merge_in_checkpoint_names(model):
    full = model.state_dict()
    merged = hf_checkpoint_state_dict(model.base_model.model, merge_lora(full, lora_layout(model)))
    ref = copy.deepcopy(model).merge_and_unload()
    want = hf_checkpoint_state_dict(ref, ref.state_dict())
    assert set(merged) == set(want) and "model.layers.3.mlp.experts.7.up_proj.weight" in merged
    for k, v in want.items():
        torch.testing.assert_close(merged[k], v, rtol=1e-5, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}")
    # the merge changed the expert weights (B is random here)
    assert not torch.equal(
        merged["model.layers.0.mlp.experts.0.down_proj.weight"],
        base().state_dict()["model.layers.0.mlp.experts.down_proj"][0],
    )


def test_mismatched_adapter_is_named(model, tmp_path):
    expected = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items()}
    good = {k: torch.zeros(s) for k, s in expected.items()}
    check_adapter(expected, good, "x")  # a matching adapter passes
    bad = dict(good)
    bad.pop("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    bad["base_model.model.model.layers.0.mlp.gate.lora_A.weight"] = torch.zeros(4, 128)
    bad["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"] = torch.zeros(64, 8)
    with pytest.raises(ValueError) as e:
        check_adapter(expected, bad, "adapter /x")
    msg = str(e.value)
    assert msg.startswith("adapter /x: the adapter does not match the model")
    assert "missing 1 keys, e.g. ['base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight']" in msg
    assert "1 unexpected keys, e.g. ['base_model.model.model.layers.0.mlp.gate.lora_A.weight']" in msg
    assert "layers.1.self_attn.v_proj.lora_B.weight: shape (64, 8), the model has (64, 4)" in msg
    with pytest.raises(
        FileNotFoundError, match="is not a PEFT adapter directory: no adapter_model.safetensors"
    ):
        read_peft_dir(tmp_path)
