"""GPU (vLLM 0.26, H200): the tiny Muse as an NVFP4 checkpoint, with a LoRA adapter on all three target groups
(attention, pooler/unpooler, experts) and routed-experts capture (R3). Also runs as a script:
`python tests/integration/test_muse_gpu.py` (the GPU machine may lack pytest)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

RANK = 8
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj", "g_proj"]
LATENT = ["pooler", "unpooler"]
EXPERTS = ["gate_proj", "up_proj", "down_proj"]


def write_adapter(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """A PEFT adapter in vLLM 0.26's layout (experts per expert, 2D), B non-zero so it changes outputs."""
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    h, nh, nkv, d = (
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    )
    lat, inter = cfg["moe_latent_size"], cfg["moe_intermediate_size"]
    gate_out = nh if cfg.get("head_gate", "headwise") == "headwise" else nh * d
    shapes = {
        "self_attn.q_proj": (h, nh * d),
        "self_attn.k_proj": (h, nkv * d),
        "self_attn.v_proj": (h, nkv * d),
        "self_attn.o_proj": (nh * d, h),
        "self_attn.g_proj": (h, gate_out),
        "mlp.pooler": (h, lat),
        "mlp.unpooler": (lat, h),
    }
    for e in range(cfg["num_experts"]):
        shapes |= {
            f"mlp.experts.{e}.gate_proj": (lat, inter),
            f"mlp.experts.{e}.up_proj": (lat, inter),
            f"mlp.experts.{e}.down_proj": (inter, lat),
        }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, fan_in, generator=g) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, RANK, generator=g) * 0.05
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}, out / "adapter_model.safetensors"
    )
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": RANK,
                "lora_alpha": 2 * RANK,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": ATTENTION + LATENT + EXPERTS,
                "task_type": "CAUSAL_LM",
                "base_model_name_or_path": None,
            }
        )
    )
    return out


def test_nvfp4_muse_with_lora_on_all_groups_and_routed_experts(tmp_path):
    from importlib.metadata import entry_points

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from rl.models import register_vllm_models
    from rl.quantize import quantize
    from rl.tiny import make_tiny

    if not any(ep.name == "sparkrl_models" for ep in entry_points(group="vllm.general_plugins")):
        register_vllm_models()  # without the entry point only this process knows the model: keep the engine in it
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    src = make_tiny("muse")
    q = quantize(src, tmp_path / "muse-nvfp4")
    adapter = write_adapter(q, tmp_path / "adapter")
    cfg = json.loads((q / "config.json").read_text())
    llm = LLM(
        model=str(q),
        enable_lora=True,
        max_lora_rank=RANK,
        max_loras=1,
        enable_return_routed_experts=True,
        max_model_len=256,
        dtype="bfloat16",
        seed=0,
        gpu_memory_utilization=0.3,
    )
    g = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(5, cfg["vocab_size"], (40,), generator=g).tolist()}
        for _ in range(4)
    ]
    params = SamplingParams(
        max_tokens=16, temperature=1.0, seed=0, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    base = llm.generate(prompts, params)
    lora = llm.generate(prompts, params, lora_request=LoRARequest("a1", 1, str(adapter)))
    report = {}
    for name, outs in (("base", base), ("lora", lora)):
        for out in outs:
            c = out.outputs[0]
            routed = np.asarray(c.routed_experts)
            assert routed.shape == (40 + 16 - 1, cfg["num_hidden_layers"], cfg["num_experts_per_tok"])
            assert routed.max() < cfg["num_experts"] and routed.any()
            assert (routed[:, :, 0] != routed[:, :, 1]).all()
        report[name] = [
            [lp[t].logprob for t, lp in zip(p["prompt_token_ids"][1:], o.prompt_logprobs[1:])]
            for p, o in zip(prompts, outs)
        ]
    diff = np.abs(np.array(report["lora"]) - np.array(report["base"])).mean()
    assert diff > 1e-3, "the adapter did not change the prompt log-probs"
    return {"mean_abs_logp_change_with_lora": float(diff)}


if __name__ == "__main__":
    import sys

    with tempfile.TemporaryDirectory() as d:
        result = test_nvfp4_muse_with_lora_on_all_groups_and_routed_experts(Path(d))
    print("MUSE-GPU OK", json.dumps(result))
    out = os.environ.get("OUT")
    if out:
        Path(out, "muse_gpu.json").write_text(json.dumps(result))
    sys.exit(0)
