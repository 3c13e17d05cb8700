"""`sparkrl plan`: every figure of a small model checked against a hand calculation, and the Muse facts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rl import plan as P
from rl.config import load_config

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30

# A small MoE: 4 layers (3 sliding-window of 128 tokens, 1 full), hidden 64, 4 heads / 2 KV heads of 16,
# 8 experts (top-2) of intermediate 32, vocab 100, untied, stored as NVFP4.
SMALL = {
    "model_type": "qwen3_moe",
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 100,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "intermediate_size": 96,
    "tie_word_embeddings": False,
    "max_position_embeddings": 1024,
    "sliding_window": 128,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"format": "nvfp4-pack-quantized"}},
    },
}

RECIPE = """
run: {{name: small}}
model: {{path: {path}, dtype: bfloat16}}
rollout: {{n: 4, max_prompt_len: 256, max_response_len: 256, num_workers: 1, tensor_parallel_size: 2,
          gpu_memory_utilization: 0.5, max_num_seqs: 8, enforce_eager: true}}
trainer: {{num_ranks: 2, micro_batch_tokens: 1024, activation_checkpointing: true}}
lora: {{rank: 8, alpha: 16, target_modules: [q_proj, k_proj, v_proj, o_proj], target_experts: true}}
data: {{train: "synthetic:arith", train_batch_size: 4}}
eval: {{every: 0}}
sync: {{mode: adapter}}
resources: {{num_gpus: 2, gpus_per_node: 2}}
"""


@pytest.fixture
def small_cfg(tmp_path):
    model = tmp_path / "small"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SMALL))
    recipe = tmp_path / "small.yaml"
    recipe.write_text(RECIPE.format(path=model))
    return lambda *overrides: load_config(recipe, list(overrides))


def test_small_model_parameters_by_hand(small_cfg):
    s = P.model_shape(small_cfg())
    assert s.params == {
        "attention": 4 * (2 * 64 * 64 + 2 * 64 * 32),  # q, o: 64 -> 4 x 16; k, v: 64 -> 2 x 16
        "experts": 4 * 8 * 3 * 64 * 32,
        "router": 4 * 64 * 8,
        "embeddings": 100 * 64 * 2,
        "norms": 4 * (2 * 64 + 2 * 16) + 64,
    }
    assert s.total_params == 261_312
    assert (s.window, s.window_layers, s.num_dense_layers, s.quantization) == (128, 3, 0, "nvfp4")
    assert s.largest_layer_params() == (49_152 + 704) / 4 + (196_608 + 2_048) / 4  # 62,128


def test_small_model_rollout_by_hand(small_cfg):
    p = P.make_plan(small_cfg(), gpu_gib=140)
    assert (p.rollout_format, p.context, p.tp) == ("nvfp4", 512, 2)
    # NVFP4 attention + experts at 0.5625 B, router + embeddings + norms in BF16, over TP 2.
    assert p.r_weights == (245_760 * 0.5625 + 15_552 * 2) / 2 == 84_672
    # One slot at rank 8: q (A whole, B half) 4*8*(64+32); k, v one KV head a GPU 4*8*(64+16);
    # o (A half, B whole) 4*8*(32+64); experts gate/up 32*8*(64+16), down 32*8*(16+64). BF16.
    assert p.lora_params_rollout_gpu == 3072 + 2 * 2560 + 3072 + 3 * 20480
    assert p.r_lora == 72_704 * 2
    # KV: 2 x 1 head x 16 x 2 B a token a layer; 3 window layers hold 128 tokens, the full one 512.
    assert p.kv_per_seq == 64 * (3 * 128 + 512) == 57_344
    assert p.shape.kv_ratio(512) == pytest.approx(896 / 2048)
    # vLLM's 16,384-token profile batch over TP 2, plus 8 sequences' fp32 logits.
    assert p.r_activations == 16384 * 2 * (6 * 64 + 192 / 2 + 2 * (64 + 3 * 32 / 2)) + 8 * 100 / 2 * 4
    assert p.r_runtime == GiB  # enforce_eager: no CUDA graphs
    assert p.r_budget == 0.5 * 140 * GiB
    assert p.kv_room == p.r_budget - 84_672 - 145_408 - p.r_activations - GiB
    assert p.seqs_wanted == 8 and p.seqs_fit == int(p.kv_room // 57_344)


def test_small_model_trainer_by_hand(small_cfg):
    p = P.make_plan(small_cfg("trainer.base_format=bf16"), gpu_gib=140)
    assert p.t_weights == 261_312 * 2 / 2
    # Trainer LoRA: q 4*8*128, k, v 4*8*96, o 4*8*128; fused experts 32 x 8 x ((64 + 2*32) + (32 + 64)).
    assert p.lora_params_trainer == 4096 + 2 * 3072 + 4096 + 32 * 8 * (128 + 96) == 71_680
    assert p.t_lora_state == 71_680 * 16 / 2  # fp32 parameter, gradient, AdamW m and v; 2 ranks
    assert p.t_gathered == (2 * 62_128 + 12_800) * 2
    work = 1024 * 2 * (6 * 64 + 2 * 64 + 2 * 32 + 2 * (64 + 3 * 32))
    assert p.t_activations == 4 * 1024 * 64 * 2 + work + 1024 * 100 * (2 + 4 + 4)
    assert p.t_peak == p.t_weights + p.t_lora_state + p.t_gathered + p.t_activations + GiB
    assert p.fits and [name for name, ok, _ in p.verdicts if ok] == [
        "placement",
        "rollout",
        "colocated, rollout phase",
        "colocated, training phase",
    ]


def test_memory_budget_applies_to_compiled_gpu_layers_only(small_cfg):
    work = 1024 * 2 * (6 * 64 + 2 * 64 + 2 * 32 + 2 * (64 + 3 * 32))
    rest = work + 1024 * 100 * (2 + 4 + 4)  # the computing layer and the logits, whatever is kept
    # The graphs' inputs: each layer's input (a layer is one graph); a budget of 0.5 keeps them and half of
    # what no checkpointing would add (3 layers' working sets).
    floor = 1024 * 2 * 4 * 64
    budget = P.make_plan(small_cfg("trainer.activation_memory_budget=0.5"), gpu_gib=140)
    assert budget.t_activations == floor + 0.5 * (3 * work - floor) + rest
    no_ac = P.make_plan(small_cfg("trainer.activation_checkpointing=false"), gpu_gib=140)
    assert no_ac.t_activations == 3 * work + rest
    full = P.make_plan(small_cfg("trainer.activation_memory_budget=1.0"), gpu_gib=140)
    assert full.t_activations == no_ac.t_activations
    whole_layer = 4 * 1024 * 64 * 2 + rest
    assert P.make_plan(small_cfg(), gpu_gib=140).t_activations == whole_layer
    assert whole_layer < budget.t_activations < no_ac.t_activations
    # Uncompiled layers ignore the budget: whole-layer checkpointing as the recipe says.
    for off in (("trainer.compile=false",), ("resources.num_gpus=0", "trainer.num_ranks=1")):
        p = P.make_plan(small_cfg("trainer.activation_memory_budget=0.5", *off), gpu_gib=140)
        assert p.t_activations == whole_layer, off
    tight = P.make_plan(small_cfg("trainer.activation_memory_budget=0.5"), gpu_gib=1.5)
    assert not tight.fits
    proposed = [c.sets for c in tight.changes]  # what the plan tries; none fits 1.5 GiB, none is printed
    assert {"trainer.activation_memory_budget": 0.0, "trainer.activation_checkpointing": True} in proposed
    assert {"trainer.activation_checkpointing": True} not in proposed


def test_small_model_does_not_fit_and_says_what_to_change(small_cfg):
    p = P.make_plan(small_cfg(), gpu_gib=2.0)  # vLLM's 1 GiB cannot hold its runtime and more
    need = (GiB + 84_672 + 145_408 + p.r_activations + 57_344) / (2 * GiB)
    assert need == pytest.approx(0.5109, abs=1e-4)
    assert not p.fits
    assert ("rollout", False) in [(n, ok) for n, ok, _ in p.verdicts]
    assert "rollout.gpu_memory_utilization=0.52 (at least) gives vLLM room for one full-length sequence" in [
        c.text for c in p.changes
    ]
    # On 2 GiB nothing fits whatever changes: the plan prints no change, only what it notes.
    assert not any("=" in s for s in p.suggestions)
    text = P.format_plan(p, "small.yaml")
    assert "verdict: DOES NOT FIT" in text and "OVER rollout" in text


def test_merged_sync_has_no_lora_slot_and_bf16_rollout(small_cfg, tmp_path):
    cfg = small_cfg("sync.mode=merged", "model.rollout_path=" + str(tmp_path / "elsewhere-bf16"))
    p = P.make_plan(cfg)
    assert p.r_lora == 0
    # model.rollout_path has no config.json: the format falls back to the shape's own quantization.
    assert p.rollout_format == "nvfp4"
    dense = dict(SMALL, quantization_config=None)
    (tmp_path / "small" / "config.json").write_text(json.dumps(dense))
    p = P.make_plan(small_cfg())
    assert p.rollout_format == "bfloat16" and p.r_weights == 261_312 * 2 / 2


def test_muse_kv_ratio_at_1m_and_nvfp4_weights():
    s = P.builtin_shape("muse-spark-open")
    assert (s.num_layers, s.window_layers, s.window, s.num_experts, s.latent) == (62, 46, 2048, 256, 4096)
    assert s.num_layers - s.window_layers == 16
    ratio = s.kv_ratio(1_048_576)
    assert ratio == pytest.approx((46 * 2048 + 16 * 1_048_576) / (62 * 1_048_576))
    assert 0.258 < ratio < 0.260
    assert s.total_params == pytest.approx(820e9)
    # The assumed heads reproduce the given attention total within 0.5%.
    assert 62 * (2 * 8192 * 96 * 128 + 2 * 8192 * 8 * 128) == pytest.approx(13.5e9, rel=5e-3)

    cfg = load_config(ROOT / "recipes" / "muse_spark_open_dapo_lora.yaml")
    p = P.make_plan(cfg)
    assert p.rollout_format == "nvfp4"  # from the checkpoint's name: no local config.json
    stored = (799e9 + 13.5e9 + 4.2e9) * (0.5 + 1 / 16) + 3.3e9 * 2
    assert p.r_weights == pytest.approx(stored / 8)
    assert p.base_format == "nvfp4"  # trainer.base_format=auto and an NVFP4 model.path: kept packed
    assert p.t_weights == pytest.approx(stored / 16)
    bf16 = P.make_plan(
        load_config(ROOT / "recipes" / "muse_spark_open_dapo_lora.yaml", ["trainer.base_format=bf16"])
    )
    assert bf16.t_weights == pytest.approx(820e9 * 2 / 16)
    text = P.format_plan(p, "muse")
    assert "at 1,048,576 tokens the KV cache is 0.2595 of all-full attention" in text
    assert "assumed: 96 query heads, 8 KV heads, head_dim 128" in text


def test_muse_long_context_recipe_kv_per_sequence():
    cfg = load_config(ROOT / "recipes" / "muse_spark_open_dapo_lora.yaml", ["rollout.max_model_len=1048576"])
    p = P.make_plan(cfg)
    # 8 KV heads over TP 8: one a GPU; 2 x 128 x 2 B a token a layer.
    assert p.kv_per_seq == 512 * (46 * 2048 + 16 * 1_048_576)
    assert "(0.260 of all-full attention)" in P.format_plan(p)


def test_qwen3_builtin_matches_published_size():
    cfg = load_config(ROOT / "recipes" / "qwen3_30b_a3b_dapo_lora.yaml")
    s = P.model_shape(cfg)
    assert s.total_params == pytest.approx(30.5e9, rel=0.01)
    assert (s.num_dense_layers, s.window_layers, s.tie_embeddings) == (0, 0, False)
    assert P.make_plan(cfg).fits


def test_dense_config_and_vllm_ranks():
    dense = {
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "vocab_size": 10,
        "intermediate_size": 48,
        "tie_word_embeddings": True,
    }
    s = P.shape_from_hf(dense, "d", "test")
    assert (s.num_dense_layers, s.head_dim, s.num_kv_heads) == (2, 16, 2)
    assert s.params["dense_mlp"] == 2 * 3 * 32 * 48 and s.params["embeddings"] == 10 * 32
    assert [P.vllm_lora_rank(r) for r in (1, 2, 8, 9, 32, 33, 300)] == [1, 8, 8, 16, 32, 64, 320]


def test_unknown_model_error_names_the_path(small_cfg):
    with pytest.raises(ValueError, match="model.path 'org/unknown-model'.*config.json"):
        P.make_plan(small_cfg("model.path=org/unknown-model"))


def test_nvfp4_bytes_per_parameter():
    assert P.NVFP4_BYTES == 0.5625
    assert math.isclose(P.NVFP4_BYTES * 16, 9)  # 16 FP4 values (8 bytes) and one FP8 scale


def test_builtin_muse_agrees_with_the_model_config(tmp_path):
    """The built-in facts and rl/models/muse's config defaults are the same model; a Muse config.json is
    read like any other and comes to the design doc's parameter totals."""
    muse = pytest.importorskip("rl.models.muse")
    config = muse.MuseSparkConfig().to_dict()
    built_in = P.builtin_shape("muse-spark-open")
    read = P.shape_from_hf(config, "muse", "test")
    fields = (
        "num_layers",
        "hidden",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "vocab",
        "num_experts",
        "top_k",
        "expert_inter",
        "latent",
        "window",
        "window_layers",
        "max_context",
        "head_gate",
    )
    assert {f: getattr(read, f) for f in fields} == {f: getattr(built_in, f) for f in fields}
    for group, total in built_in.params.items():
        assert read.params[group] == pytest.approx(total, rel=0.01), group
    assert read.params["attention"] == 62 * (2 * 8192 * 12288 + 2 * 8192 * 1024 + 8192 * 96)  # + head gate


def test_make_tiny_recipe_plans_without_gpus():
    cfg = load_config(ROOT / "recipes" / "demo_cpu.yaml")
    p = P.make_plan(cfg)
    assert p.shape.name == "make-tiny qwen3_moe"
    assert (p.shape.num_layers, p.shape.hidden, p.shape.num_experts, p.shape.top_k) == (4, 128, 8, 2)
    assert p.r_lora == 0 and p.rollout_format == "float32"  # merged sync; float32 weights on CPU
    assert p.verdicts == [] and "verdict: CPU run" in P.format_plan(p)


def test_small_model_nvfp4_base_by_hand(small_cfg):
    """trainer.base_format=auto reads model.path's quantization_config (NVFP4): the Linear layers stay packed
    at 0.5625 B a weight; two layers gather packed and the computing one is dequantized to BF16."""
    p = P.make_plan(small_cfg(), gpu_gib=140)
    assert (p.base_format, p.base_label) == ("nvfp4", "nvfp4, packed")
    assert "quantization_config in" in p.base_format_why
    # attention + experts packed; router, embeddings, norms in BF16; over 2 ranks
    assert p.t_weights == (245_760 * 0.5625 + 15_552 * 2) / 2
    # the largest layer: 62,128 parameters, of which 61,440 packed (attention 12,288 + experts 49,152)
    assert p.shape.largest_layer_quantized_params() == 12_288 + 49_152
    # the largest weight: the experts' fused gate_up bank (2 / 3 of 49,152); dequantizing it makes its BF16
    # block scales and FP32 effective scales (6 bytes a 16 weights) beside the layer's BF16 weights
    assert p.shape.largest_quantized_weight() == 32_768
    dequantized = 61_440 * 2 + 32_768 * 6 / 16
    assert p.t_gathered == 2 * (61_440 * 0.5625 + 688 * 2) + dequantized + 12_800 * 2
    one_rank = P.make_plan(small_cfg("trainer.num_ranks=1"), gpu_gib=140)
    # nothing to gather, but FSDP2's one-rank path copies the layer's packed bytes (its gather inputs), the
    # largest weight's input alive through the copy
    assert one_rank.t_gathered == (61_440 * 0.5625 + 688 * 2) + 32_768 * 0.5625 + dequantized
    # with expert parallelism the bank holds num_experts / EP experts
    assert p.shape.largest_quantized_weight(ep=2) == 16_384
    bf16 = P.make_plan(small_cfg("trainer.base_format=bf16"), gpu_gib=140)
    assert p.t_weights < 0.35 * bf16.t_weights and p.t_gathered < bf16.t_gathered


def test_chunked_head_holds_one_chunk_of_logits(small_cfg):
    whole = P.make_plan(small_cfg("trainer.logits_chunk_tokens=0"), gpu_gib=140)
    chunked = P.make_plan(small_cfg("trainer.logits_chunk_tokens=256"), gpu_gib=140)
    assert (whole.logits_tokens, chunked.logits_tokens) == (1024, 256)
    assert whole.t_logits == 1024 * 100 * (2 + 4 + 4) and chunked.t_logits == 256 * 100 * (2 + 4 + 4)
    # a top-p nucleus: the trainer sorts each chunk's vocabulary (trainer/logprobs.py)
    nucleus = P.make_plan(small_cfg("trainer.logits_chunk_tokens=256", "rollout.top_p=0.9"), gpu_gib=140)
    assert nucleus.t_logits == 256 * 100 * (2 + 4 + 4 + 12)
    assert nucleus.t_activations - chunked.t_activations == nucleus.t_logits - chunked.t_logits
    assert whole.t_activations - chunked.t_activations == whole.t_logits - chunked.t_logits
    # a chunk longer than the micro-batch is the micro-batch
    assert P.make_plan(small_cfg("trainer.logits_chunk_tokens=8192"), gpu_gib=140).logits_tokens == 1024


def test_plan_refuses_what_placement_refuses(small_cfg):
    """Engines never span nodes: 2 engines of TP 3 on nodes of 4 GPUs (6 colocated GPUs packed 4 + 2) have
    room for one; the plan's placement verdict is plan_placement's error, so the plan does not fit."""
    cfg = small_cfg(
        "resources.num_gpus=8",
        "resources.nodes=2",
        "resources.gpus_per_node=4",
        "trainer.num_ranks=2",
        "rollout.num_workers=2",
        "rollout.tensor_parallel_size=3",
    )
    p = P.make_plan(cfg, gpu_gib=140)
    assert not p.fits
    (ok, why) = next((ok, why) for name, ok, why in p.verdicts if name == "placement")
    assert not ok and "room for 1 engine(s)" in why and "sit 4, 2 a node" in why
    assert "OVER placement: rollout.num_workers" in P.format_plan(p)
    fits = P.make_plan(small_cfg("rollout.tensor_parallel_size=2"), gpu_gib=140)
    assert ("placement", True) in [(n, ok) for n, ok, _ in fits.verdicts]


def test_margin_is_the_tightest_check(small_cfg):
    p = P.make_plan(small_cfg(), gpu_gib=140)
    assert set(p.headroom) == {"rollout", "colocated, rollout phase", "colocated, training phase"}
    assert p.margin == min(p.headroom.values())
    assert p.headroom["colocated, rollout phase"] == 140 * GiB - p.t_resident - p.r_budget
    assert f"margin: {p.margin / GiB:.1f} GiB" in P.format_plan(p)


def test_gpu_memory_comes_from_the_config(small_cfg):
    p = P.make_plan(small_cfg("resources.gpu_memory_gib=80"))
    assert p.gpu_bytes == 80 * GiB and p.r_budget == 0.5 * 80 * GiB


def test_over_budget_bf16_base_hints_at_nvfp4_and_chunking():
    cfg = load_config(
        ROOT / "recipes" / "muse_spark_open_dapo_lora.yaml",
        ["trainer.base_format=bf16", "trainer.logits_chunk_tokens=0", "trainer.expert_parallel_size=1"],
    )
    p = P.make_plan(cfg)
    assert not p.fits
    # the figures the planner gave before the NVFP4 base and the chunked head: 214 GiB of which 30.7 logits
    assert p.t_peak / GiB == pytest.approx(214.27, abs=0.01) and p.t_logits / GiB == pytest.approx(
        30.68, abs=0.01
    )
    assert any(
        s.startswith("trainer.base_format=nvfp4 keeps model.path's NVFP4 weights packed") and "fits" in s
        for s in p.suggestions
    )
    # proposed, and not printed: with the BF16 base the chunked head alone does not fit
    assert any(c.text.startswith("trainer.logits_chunk_tokens=4096 cuts") for c in p.changes)
    assert not any(s.startswith("trainer.logits_chunk_tokens") for s in p.suggestions)
