"""One GPU at real sizes: the shipped one-GPU recipes fit (`sparkrl plan`), and the planner's advice on a
recipe that does not fit only names changes that, applied and re-planned, fit and that the config and the
placement accept."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl import plan as P
from rl.config import load_config

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30
ONE_GPU = [
    "resources.num_gpus=1",
    "resources.gpus_per_node=1",
    "trainer.num_ranks=1",
    "rollout.num_workers=1",
    "rollout.tensor_parallel_size=1",
]


def test_qwen3_30b_a3b_fits_one_80gib_gpu_with_its_nvfp4_base():
    cfg = load_config(ROOT / "recipes" / "qwen3_30b_a3b_1gpu.yaml")
    p = P.make_plan(cfg)
    assert p.fits, P.format_plan(p)
    assert p.gpu_bytes == 80 * GiB and p.num_gpus == 1 and p.placement == "colocated"
    assert (p.rollout_format, p.base_format) == ("nvfp4", "nvfp4")
    assert p.shape.name == "Qwen3-30B-A3B" and p.shape.num_experts == 128 and p.shape.num_layers == 48
    lo, ro = cfg.lora, cfg.rollout
    assert lo.rank == 32 and lo.target_experts and {"q_proj", "o_proj"} <= set(lo.target_modules)
    assert (cfg.data.train_batch_size, ro.n, ro.max_response_len) == (32, 8, 1024)
    assert (cfg.sync.mode, cfg.r3.enabled) == ("adapter", True)
    assert p.margin / GiB == pytest.approx(7.0, abs=0.05)  # the margin the recipe's comment states


def test_the_written_random_checkpoint_plans_as_the_builtin(tmp_path):
    """`sparkrl make-random qwen3_30b_a3b`'s config.json gives the planner the model of the built-in facts."""
    import json

    from rl.quantize import preset_config

    config = preset_config("qwen3_30b_a3b").to_dict()
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    recipe = ROOT / "recipes" / "qwen3_30b_a3b_1gpu.yaml"
    written = P.make_plan(load_config(recipe, [f"model.path={tmp_path}"]))
    builtin = P.make_plan(load_config(recipe))
    assert written.shape.params == builtin.shape.params
    assert (written.t_peak, written.r_weights, written.fits) == (builtin.t_peak, builtin.r_weights, True)


def _suggested(p: P.Plan, change: P.Change) -> bool:
    return any(s.startswith(change.text) for s in p.suggestions)


@pytest.mark.parametrize("gpu_gib", [80, 140])
def test_one_gpu_advice_is_replanned_and_fits(gpu_gib):
    """The 8-GPU Qwen3 recipe squeezed onto one GPU does not fit; every change printed fits when applied,
    every change not printed does not, and nothing asks for more GPUs or a layout the placement refuses."""
    cfg = load_config(
        ROOT / "recipes" / "qwen3_30b_a3b_dapo_lora.yaml", [*ONE_GPU, f"resources.gpu_memory_gib={gpu_gib}"]
    )
    p = P.make_plan(cfg)
    assert not p.fits and p.suggestions
    for change in p.changes:
        q = P.replan(cfg, [change], gpu_gib)
        fits = q is not None and q.fits
        assert _suggested(p, change) == fits, change.text
    text = "\n".join(p.suggestions)
    assert "resources.num_gpus" not in text and "trainer.num_ranks" not in text
    assert "rollout.placement=split" not in text and "tensor_parallel_size" not in text
    # the NVFP4 base comes first: model.path is BF16, so the way there is `sparkrl quantize`
    assert "sparkrl quantize Qwen/Qwen3-30B-A3B DIR" in p.suggestions[0]


def test_combined_advice_fits_when_no_single_change_does():
    cfg = load_config(
        ROOT / "recipes" / "qwen3_30b_a3b_dapo_lora.yaml", [*ONE_GPU, "resources.gpu_memory_gib=80"]
    )
    p = P.make_plan(cfg)
    assert [s for s in p.suggestions if s.startswith("together: ")] == p.suggestions[:1]
    # the combination, applied: quantize (rollout and trainer NVFP4) and a shorter micro-batch
    together = p.suggestions[0]
    assert "sparkrl quantize" in together and "trainer.micro_batch_tokens=" in together
    # the combination's trainer settings (`key=value` after the quantize step), each applied
    settings = [t.rstrip(";") for t in together.split("(re-planned")[0].split() if t.startswith("trainer.")]
    assert any(t.startswith("trainer.micro_batch_tokens=") for t in settings)
    q = P.make_plan(cfg, quantized=True, advise=False)
    assert not q.fits
    fixed = load_config(
        ROOT / "recipes" / "qwen3_30b_a3b_dapo_lora.yaml",
        [*ONE_GPU, "resources.gpu_memory_gib=80", *settings],
    )
    assert P.make_plan(fixed, quantized=True, advise=False).fits


def test_refused_changes_are_never_printed(tmp_path):
    """A change the config refuses (validate) or the placement refuses re-plans to None or to a plan
    that does not fit, so it is not printed."""
    cfg = load_config(
        ROOT / "recipes" / "qwen3_30b_a3b_dapo_lora.yaml", [*ONE_GPU, "resources.gpu_memory_gib=80"]
    )
    split = P.Change("rollout.placement=split", {"rollout.placement": "split"})
    q = P.replan(cfg, [split], 80)
    assert q is None or not q.placement_ok
    wider = P.Change("tp 2", {"rollout.tensor_parallel_size": 2})
    assert P.replan(cfg, [wider], 80) is None  # 1 engine x TP 2 > 1 GPU: the config refuses it


def test_multi_gpu_rank_advice_fits_when_printed():
    cfg = load_config(
        ROOT / "recipes" / "muse_spark_open_dapo_lora.yaml",
        ["trainer.base_format=bf16", "trainer.logits_chunk_tokens=0"],
    )
    p = P.make_plan(cfg)
    ranks = [c for c in p.changes if "trainer.num_ranks" in c.sets]
    assert ranks
    for c in ranks:
        q = P.replan(cfg, [c], 140)
        assert _suggested(p, c) == (q is not None and q.fits)


def test_kv_advice_names_a_utilization_that_fits():
    cfg = load_config(ROOT / "recipes" / "qwen3_30b_a3b_1gpu.yaml")
    p = P.make_plan(cfg)
    (note,) = [s for s in p.suggestions if s.startswith("the KV room holds")]
    u = float(note.split("rollout.gpu_memory_utilization=")[1].split()[0])
    assert u > cfg.rollout.gpu_memory_utilization
    assert P.make_plan(
        load_config(ROOT / "recipes" / "qwen3_30b_a3b_1gpu.yaml", [f"rollout.gpu_memory_utilization={u}"])
    ).fits
    over = round(u + 0.01, 2)
    assert not P.make_plan(
        load_config(ROOT / "recipes" / "qwen3_30b_a3b_1gpu.yaml", [f"rollout.gpu_memory_utilization={over}"])
    ).fits


def test_gpu_demo_recipe_plans_and_passes_preflight():
    from rl.preflight import preflight
    from rl.setup import base_format, resolve_model_paths

    recipe = ROOT / "recipes" / "gpu_demo.yaml"
    cfg = load_config(recipe)
    p = P.make_plan(cfg)
    assert p.fits and p.shape.name == "make-tiny qwen3_moe"
    assert (p.rollout_format, p.base_format, cfg.sync.mode, cfg.r3.enabled) == (
        "nvfp4",
        "nvfp4",
        "adapter",
        True,
    )
    assert cfg.monitor.k3_kl_max == 2e-5
    preflight(cfg)
    # What the run trains and serves (here without the warm-up, which only changes the weights): the NVFP4
    # copy for both, which the trainer keeps packed
    trainer_path, rollout_path = resolve_model_paths(load_config(recipe, ["model.make_tiny.sft="]))
    assert trainer_path == rollout_path and base_format(cfg.trainer.base_format, trainer_path) == "nvfp4"
    built = P.make_plan(load_config(recipe, [f"model.path={trainer_path}", "model.make_tiny.arch="]))
    assert (built.rollout_format, built.base_format) == ("nvfp4", "nvfp4") and built.fits
    # Without make_tiny.quantize the trainer would hold the BF16 model, and the plan says so
    bf16 = P.make_plan(load_config(recipe, ["model.make_tiny.quantize=", "trainer.base_format=auto"]))
    assert (bf16.rollout_format, bf16.base_format) == ("bfloat16", "bf16")


def test_muse_slice_recipe_fits_two_full_width_layers_on_80gib(tmp_path):
    """bench/muse_slice_1gpu.yaml on the config `sparkrl make-random muse_full_width --config-only`
    writes (no tensors): two full-width layers fit one 80 GiB GPU with the reference run's LoRA and
    micro-batch; a third leaves less than a GiB."""
    from rl.quantize import make_random

    margins = {}
    for layers in (2, 3):
        path = make_random("muse_full_width", tmp_path / f"m{layers}", layers=layers, config_only=True)
        assert not list(path.glob("*.safetensors")) and (path / "config.json").is_file()
        cfg = load_config(ROOT / "bench" / "muse_slice_1gpu.yaml", [f"model.path={path}"])
        p = P.make_plan(cfg)
        assert (p.rollout_format, p.base_format, p.shape.num_layers, p.shape.hidden) == (
            "nvfp4",
            "nvfp4",
            layers,
            8192,
        )
        assert p.shape.num_experts == 256 and cfg.trainer.micro_batch_tokens == 16384
        margins[layers] = p.margin / GiB
    assert margins[2] == pytest.approx(3.1, abs=0.05)  # the margin the config's comment states
    assert margins[3] < 0


def test_bench_models_config_fits_both_bench_models_through_their_link(tmp_path):
    """bench/bench_models_1gpu.yaml on the bench models' full-size configs (bench.models.hf_config, the NVFP4
    copy with the quantization_config `make-random --config-only` writes; no tensors), reached through the
    link bench.models keeps at <root>/<name>: one 80 GiB GPU fits each, the engine on NVFP4 and the trainer on
    the BF16 twin. The link follows the last build reused (here the tiny one after the full one)."""
    import json

    from bench import models as B
    from rl.quantize import make_random

    nvfp4 = make_random("qwen3_30b_a3b", tmp_path / "q", config_only=True) / "config.json"
    quantization = json.loads(nvfp4.read_text())["quantization_config"]
    root = tmp_path / "models"
    for name in ("qwen3_moe", "muse"):
        spec = B.FULL[name]
        d = B.model_dir(root, spec)
        config = B.hf_config(spec, 1024, 1, 2)
        for sub in ("dq", "nvfp4"):
            config.save_pretrained(d / sub)
        written = json.loads((d / "nvfp4" / "config.json").read_text())
        (d / "nvfp4" / "config.json").write_text(json.dumps({**written, "quantization_config": quantization}))
        (d / "build.json").write_text(json.dumps({"dir": str(d)}))
        assert B.build(spec, root, log=lambda *a: None) == {"dir": str(d)}  # reused, not rebuilt
        assert (root / name).resolve() == d.resolve()

        overrides = [f"model.path={root / name / 'dq'}", f"model.rollout_path={root / name / 'nvfp4'}"]
        cfg = load_config(
            ROOT / "bench" / "bench_models_1gpu.yaml", overrides + [f"lora.target_latent={name == 'muse'}"]
        )
        p = P.make_plan(cfg)
        assert (p.rollout_format, p.base_format, p.shape.hidden, p.shape.num_experts) == (
            "nvfp4",
            "bf16",
            2048,
            64,
        )
        assert p.fits and p.gpu_bytes == 80 * GiB

    tiny = B.model_dir(root, B.TINY["muse"])
    tiny.mkdir(parents=True)
    (tiny / "build.json").write_text("{}")
    B.build(B.TINY["muse"], root, log=lambda *a: None)
    assert (root / "muse").resolve() == tiny.resolve()
