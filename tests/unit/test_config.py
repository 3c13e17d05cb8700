"""The typed config: errors that name the file, key path and fix; round trips; recipes; generated docs."""

import dataclasses
import itertools
import logging
import os
import pickle
import sys
from pathlib import Path

import pytest
import yaml

from rl import config_docs
from rl.config import (
    ConfigError,
    SparkConfig,
    load_config,
    nearest_key,
    parse_override,
    run_dir,
    save_config,
    schema_fields,
    validate,
)

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))

MINIMAL = """\
run: {name: t}
model: {path: some/model}
data: {train: "synthetic:arith"}
"""


def recipe(tmp_path: Path, text: str = MINIMAL, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error(recipe_path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(recipe_path, list(overrides))
    return str(info.value)


# ---- loading and overrides ------------------------------------------------------------------------


def test_minimal_recipe_gets_schema_defaults(tmp_path):
    cfg = load_config(recipe(tmp_path))
    assert isinstance(cfg, SparkConfig)
    assert cfg.run.name == "t" and cfg.model.path == "some/model" and cfg.data.train == "synthetic:arith"
    assert (cfg.rollout.n, cfg.lora.rank, cfg.lora.alpha, cfg.sync.mode) == (8, 32, 64.0, "adapter")
    assert cfg.algorithm.clip_ratio_high == 0.28 and cfg.trainer.max_skipped_steps == 3
    assert cfg.trainer.betas == [0.9, 0.999]


def test_overrides_are_typed_and_applied_in_order(tmp_path):
    cfg = load_config(
        recipe(tmp_path),
        [
            "trainer.lr=3e-4",
            "rollout.n=4",
            "rollout.n=16",
            "r3.enabled=false",
            "lora.target_modules=[q_proj,v_proj]",
            "run.dir=",
            "trainer.betas=[0.8,0.9]",
        ],
    )
    assert cfg.trainer.lr == pytest.approx(3e-4) and isinstance(cfg.trainer.lr, float)
    assert cfg.rollout.n == 16
    assert cfg.r3.enabled is False
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.run.dir == ""
    assert cfg.trainer.betas == [0.8, 0.9]


def test_seeds_and_eval_length_follow_their_interpolated_defaults(tmp_path):
    cfg = load_config(recipe(tmp_path), ["run.seed=7", "rollout.max_response_len=100"])
    assert (cfg.rollout.seed, cfg.data.seed) == (7, 7)
    assert cfg.eval.max_response_len == 100
    cfg = load_config(recipe(tmp_path), ["run.seed=7", "data.seed=3"])
    assert (cfg.rollout.seed, cfg.data.seed) == (7, 3)


def test_dict_field_takes_nested_keys(tmp_path):
    cfg = load_config(recipe(tmp_path), ["data.chat_template_kwargs.enable_thinking=false"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}


def test_empty_section_is_ignored_and_dates_stay_strings(tmp_path):
    cfg = load_config(recipe(tmp_path, MINIMAL + "lora:\n"), ["run.name=2024-01-01"])
    assert cfg.lora.rank == 32
    assert cfg.run.name == "2024-01-01"


def test_run_dir_defaults_to_runs_name(tmp_path):
    assert run_dir(load_config(recipe(tmp_path))) == Path("runs/t")
    assert run_dir(load_config(recipe(tmp_path), ["run.dir=/scratch/x"])) == Path("/scratch/x")


def test_load_accepts_a_run_directory_and_a_shipped_recipe_name(tmp_path):
    cfg = load_config(recipe(tmp_path))
    save_config(cfg, tmp_path / "run" / "config.yaml")
    assert load_config(tmp_path / "run") == cfg
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert load_config("demo_cpu").run.name == "demo_cpu"
    finally:
        os.chdir(cwd)


# ---- errors ---------------------------------------------------------------------------------------


def test_config_error_is_a_value_error_that_pickles():
    assert issubclass(ConfigError, ValueError)
    err = pickle.loads(pickle.dumps(ConfigError(["a: x", "b: y"])))
    assert err.problems == ["a: x", "b: y"]
    assert str(err) == "2 config problems:\n  a: x\n  b: y"


def test_misspelt_key_names_file_path_and_nearest_key(tmp_path):
    path = recipe(tmp_path, MINIMAL + "trainer:\n  totl_steps: 5\n")
    msg = error(path)
    assert msg == f"{path}: unknown key 'trainer.totl_steps' (did you mean 'trainer.total_steps'?)"


def test_misspelt_section_and_nested_key(tmp_path):
    text = MINIMAL + "trainr: {lr: 1}\nalgorithm:\n  rollout_correction: {tis_capp: 2}\n"
    msg = error(recipe(tmp_path, text))
    assert "2 config problems" in msg
    assert "unknown key 'trainr' (did you mean 'trainer'?)" in msg
    assert (
        "unknown key 'algorithm.rollout_correction.tis_capp' "
        "(did you mean 'algorithm.rollout_correction.tis_cap'?)"
    ) in msg


def test_key_in_the_wrong_section_points_to_the_right_one():
    assert nearest_key("trainer.temperature") == "rollout.temperature"
    assert nearest_key("rollout.target_experts") == "lora.target_experts"
    assert nearest_key("algorithm.tis_cap") == "algorithm.rollout_correction.tis_cap"
    assert nearest_key("model.arch") == "model.make_tiny.arch"
    assert nearest_key("eval.every_n") == "eval.every"
    assert nearest_key("zzzzzz") is None


def test_misspelt_override_names_the_override(tmp_path):
    msg = error(recipe(tmp_path), ["rollout.nn=4"])
    assert msg == "override 'rollout.nn=4': unknown key 'rollout.nn' (did you mean 'rollout.n'?)"


def test_wrong_type_in_recipe(tmp_path):
    path = recipe(tmp_path, MINIMAL + "trainer:\n  lr: fast\n")
    assert error(path) == f"{path}: trainer.lr: expected a number, got 'fast' (str)"


def test_wrong_type_in_override(tmp_path):
    assert error(recipe(tmp_path), ["rollout.n=8.5"]) == (
        "override 'rollout.n=8.5': rollout.n: expected an integer, got 8.5 (float)"
    )
    assert error(recipe(tmp_path), ["r3.enabled=maybe"]) == (
        "override 'r3.enabled=maybe': r3.enabled: expected true or false, got 'maybe' (str)"
    )


def test_wrong_type_list_and_section(tmp_path):
    assert "lora.target_modules: expected a list of strings, got 'q_proj' (str)" in error(
        recipe(tmp_path), ["lora.target_modules=q_proj"]
    )
    assert "trainer.betas[1]: expected a list of numbers, got 'x' (str)" in error(
        recipe(tmp_path), ["trainer.betas=[0.9,x]"]
    )
    assert "trainer: expected a mapping (the section TrainerConfig), got 5 (int)" in error(
        recipe(tmp_path), ["trainer=5"]
    )
    assert "trainer.lr: expected a number, got a mapping" in error(recipe(tmp_path), ["trainer.lr={a: 1}"])
    assert "run.name: expected a string, got null" in error(recipe(tmp_path), ["run.name=null"])


def test_missing_required_values(tmp_path):
    path = recipe(tmp_path, "model: {path: m}\ndata: {train: x}\n")
    assert error(path) == (
        f"{path}: run.name: required value is missing (set it in the recipe or with run.name=...)"
    )
    path = recipe(tmp_path, "run: {name: a}\nmodel: {path: m}\n")
    assert "data.train: required value is missing" in error(path)
    path = recipe(tmp_path, "run: {name: a}\ndata: {train: x}\n")
    assert error(path) == (
        f"{path}: model.path: required value is missing (a Hugging Face id or checkpoint "
        "directory), unless model.make_tiny.arch is set"
    )
    # make_tiny stands in for model.path
    assert load_config(path, ["model.make_tiny.arch=qwen3_moe"]).model.path == ""


def test_bad_override_format(tmp_path):
    assert error(recipe(tmp_path), ["trainer.lr"]) == (
        "override 'trainer.lr': expected key=value with a dotted key, e.g. trainer.lr=1e-5"
    )
    assert "expected key=value" in error(recipe(tmp_path), ["trainer..lr=1"])
    assert "expected key=value" in error(recipe(tmp_path), ["=1"])


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = recipe(tmp_path, "run:\n  name: a\n   seed: 1\n")
    assert error(path) == f"{path}:3:8: YAML syntax error: mapping values are not allowed here"


def test_duplicate_yaml_key_is_an_error(tmp_path):
    path = recipe(tmp_path, MINIMAL + "run: {seed: 1}\n")
    assert error(path) == f"{path}:4:1: YAML syntax error: duplicate key 'run' (first at line 1)"


def test_recipe_that_is_not_a_mapping(tmp_path):
    path = recipe(tmp_path, "- a\n- b\n")
    assert error(path) == (
        f"{path}: <top level>: expected a mapping (the section SparkConfig), got ['a', 'b'] (list)"
    )


def test_a_directory_that_is_not_a_run_is_named_so(tmp_path):
    assert "a directory without config.yaml: not a run directory" in error(tmp_path)


def test_missing_recipe_file(tmp_path):
    assert "no such recipe file" in error(tmp_path / "nope.yaml")


def test_choice_error_suggests_the_nearest_choice(tmp_path):
    assert error(recipe(tmp_path), ["sync.mode=mergd"]) == (
        "override 'sync.mode=mergd': sync.mode: expected one of 'adapter', 'merged', got 'mergd' "
        "(did you mean 'merged'?)"
    )


def test_range_and_cross_section_errors_name_the_key_and_its_origin(tmp_path):
    path = recipe(tmp_path, MINIMAL + "trainer: {mini_batch_size: 5}\n")
    msg = error(path, ["rollout.n=1", "lora.dropout=1.5"])
    assert "3 config problems" in msg
    assert f"{path}: trainer.mini_batch_size: must divide data.train_batch_size (32), got 5" in msg
    assert (
        "override 'rollout.n=1': rollout.n: grpo compares samples within a group: need at least 2, got 1"
    ) in msg
    assert "override 'lora.dropout=1.5': lora.dropout: must be in [0, 1), got 1.5" in msg


def test_bounds_declared_on_fields(tmp_path):
    assert "rollout.top_p: must be in (0, 1], got 1.5" in error(recipe(tmp_path), ["rollout.top_p=1.5"])
    assert "trainer.lr: must be greater than 0, got 0.0" in error(recipe(tmp_path), ["trainer.lr=0"])
    assert "eval.k: must be at least 1, got 0" in error(recipe(tmp_path), ["eval.k=0"])
    assert "trainer.activation_memory_budget: must be in [0, 1], got 1.5" in error(
        recipe(tmp_path), ["trainer.activation_memory_budget=1.5"]
    )
    assert "data.arith.num_terms: must be at least 2, got 1" in error(
        recipe(tmp_path), ["data.arith.num_terms=1"]
    )
    assert "trainer.betas: must be two numbers in [0, 1), got [0.9]" in error(
        recipe(tmp_path), ["trainer.betas=[0.9]"]
    )


def test_live_routing_kl_needs_routing_replay(tmp_path):
    msg = error(recipe(tmp_path), ["r3.enabled=false", "r3.measure_live_kl=true"])
    assert "r3.measure_live_kl: compares replayed with live routing: needs r3.enabled=true" in msg
    assert validate(load_config(recipe(tmp_path), ["r3.measure_live_kl=true"])) == []


def test_warmup_counts_optimizer_steps_and_dropout_needs_no_expert_targets(tmp_path):
    # 4 steps of 32 prompts in mini-batches of 8, 2 epochs: 32 optimizer steps, the schedule's length
    steps = ["trainer.total_steps=4", "trainer.mini_batch_size=8", "trainer.ppo_epochs=2"]
    assert validate(load_config(recipe(tmp_path), [*steps, "trainer.warmup_steps=20"])) == []
    assert (
        "trainer.warmup_steps: counts optimizer steps: must be less than the run's 32 (trainer.total_steps 4 "
        "x 8 a batch), got 32"
    ) in error(recipe(tmp_path), [*steps, "trainer.warmup_steps=32"])
    assert (
        "lora.dropout: must be 0 with lora.target_experts=true (PEFT applies no dropout to expert "
        "parameters), got 0.1; set lora.target_experts=false to use dropout"
    ) in error(recipe(tmp_path), ["lora.dropout=0.1"])
    assert validate(load_config(recipe(tmp_path), ["lora.dropout=0.1", "lora.target_experts=false"])) == []


def test_a_model_path_beside_a_tiny_model_is_refused_not_ignored():
    # the demo recipe builds its tiny model; a model.path given on top of it would be silently unused
    msg = error("demo_cpu", ["model.path=Qwen/Qwen3-30B-A3B"])
    assert (
        "model.path: model.make_tiny.arch=qwen3_moe builds the policy, so model.path would be ignored; set "
        "model.make_tiny.arch= (empty) to train model.path, or drop model.path"
    ) in msg
    assert load_config("demo_cpu", ["model.path=Qwen/Qwen3-30B-A3B", "model.make_tiny.arch="]).model.path


def test_interpolation_error_names_the_key(tmp_path):
    assert error(recipe(tmp_path), ["rollout.seed=${run.nope}"]) == (
        "override 'rollout.seed=${run.nope}': rollout.seed: Interpolation key 'run.nope' not found"
    )


def test_resources_must_hold_the_workers(tmp_path):
    msg = error(
        recipe(tmp_path),
        [
            "resources.num_gpus=8",
            "trainer.num_ranks=8",
            "rollout.num_workers=2",
            "rollout.tensor_parallel_size=4",
            "rollout.placement=split",
        ],
    )
    assert msg == (
        "override 'rollout.placement=split': rollout.placement: split placement needs 8 rollout "
        "+ 8 trainer GPUs, more than resources.num_gpus (8)"
    )


def test_an_async_rollout_needs_gpus_of_its_own(tmp_path):
    gpus = ["resources.num_gpus=8", "trainer.num_ranks=4", "rollout.num_workers=4"]
    msg = error(recipe(tmp_path), [*gpus, "rollout.max_staleness=1"])
    assert msg.startswith(
        "override 'rollout.max_staleness=1': rollout.max_staleness: 1 needs rollout.placement=split: "
        "colocated engines sleep while the trainer updates"
    )
    cfg = load_config(recipe(tmp_path), [*gpus, "rollout.max_staleness=1", "rollout.placement=split"])
    assert cfg.rollout.max_staleness == 1
    assert load_config(recipe(tmp_path), ["rollout.max_staleness=2"]).rollout.max_staleness == 2  # CPU


def test_engine_args_reach_vllm_over_the_settings_sparkrl_makes(tmp_path):
    from rl.setup import engine_spec
    from rollout.worker import ModelInfo, engine_kwargs

    cfg = load_config(
        recipe(tmp_path),
        ["rollout.engine_args={compilation_config: {cudagraph_mode: FULL_DECODE_ONLY}, max_num_seqs: 7}"],
    )
    spec = engine_spec(cfg, "/m")
    assert spec.rollout.engine_args == {
        "compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"},
        "max_num_seqs": 7,
    }
    kw = engine_kwargs(spec, ModelInfo(num_layers=2, num_experts=0, top_k=0, quantization=None))
    assert kw["compilation_config"] == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    assert kw["max_num_seqs"] == 7  # over rollout.max_num_seqs
    assert engine_spec(load_config(recipe(tmp_path)), "/m").rollout.engine_args == {}


def test_head_dtype_reaches_the_engine_and_the_trainer(tmp_path, caplog):
    """model.head_dtype is one setting for both sides: vLLM's head_dtype override (merged with a user's own
    hf_overrides, whose head_dtype wins) and the trainer's spec."""
    from rl.setup import engine_spec, trainer_spec
    from rollout.worker import ModelInfo, engine_kwargs

    info = ModelInfo(num_layers=2, num_experts=0, top_k=0, quantization=None)
    cfg = load_config(recipe(tmp_path))
    assert cfg.model.head_dtype == "float32"
    assert engine_kwargs(engine_spec(cfg, "/m"), info)["hf_overrides"] == {"head_dtype": "float32"}
    assert trainer_spec(cfg, "/m").head_dtype == "float32"

    rounded = load_config(recipe(tmp_path), ["model.head_dtype=model"])
    assert engine_kwargs(engine_spec(rounded, "/m"), info)["hf_overrides"] == {"head_dtype": "model"}
    assert trainer_spec(rounded, "/m").head_dtype == "model"

    mixed = load_config(recipe(tmp_path), ["rollout.engine_args={hf_overrides: {head_dtype: model}}"])
    with caplog.at_level(logging.WARNING, logger="rl.setup"):
        assert engine_kwargs(engine_spec(mixed, "/m"), info)["hf_overrides"] == {"head_dtype": "model"}
    assert "hf_overrides.head_dtype model over model.head_dtype float32" in caplog.text
    own = load_config(recipe(tmp_path), ["rollout.engine_args={hf_overrides: {rope_theta: 5.0}}"])
    assert engine_kwargs(engine_spec(own, "/m"), info)["hf_overrides"] == {
        "head_dtype": "float32",
        "rope_theta": 5.0,
    }
    with pytest.raises(Exception, match="head_dtype"):
        load_config(recipe(tmp_path), ["model.head_dtype=float16"])


class _Platform:
    """vLLM's current_platform as the rollout worker reads the GPU's memory from it: a CUDA one whose NVML
    says `total` bytes, or (total None) a CPU one. The machine running the tests may have either, or none."""

    def __init__(self, total: int | None):
        self.total = total

    def is_cuda_alike(self) -> bool:
        return self.total is not None

    def get_device_total_memory(self, device_id: int = 0) -> int:
        return self.total


def test_a_colocated_engine_sizes_its_kv_cache_beside_what_the_plan_counts(tmp_path, monkeypatch):
    """Under sleep mode vLLM's own profile misjudges the KV cache (it took 54 GiB of a 44 GiB budget on an
    H100); a colocated engine is given gpu_memory_utilization x the GPU less the plan's weights, LoRA slot,
    activations and runtime instead, the GPU's memory as NVML says it, and rollout.engine_args still win."""
    import vllm.platforms

    from rl.plan import make_plan
    from rl.setup import engine_spec
    from rollout.worker import ModelInfo, engine_kwargs

    gib = 2**30
    info = ModelInfo(num_layers=2, num_experts=0, top_k=0, quantization=None)
    cfg = load_config("recipes/gpu_demo.yaml")  # resources.gpu_memory_gib 80
    spec = engine_spec(cfg, "/m")
    assert spec.enable_sleep_mode and spec.gpu_bytes == 80 * gib
    plan = make_plan(cfg, advise=False)
    monkeypatch.setattr(vllm.platforms, "current_platform", _Platform(None))  # NVML cannot tell: the config's
    kv = engine_kwargs(spec, info)["kv_cache_memory_bytes"]
    assert abs(kv - plan.kv_room) < 2 and kv > gib  # the plan's KV room, to the byte's rounding
    monkeypatch.setattr(vllm.platforms, "current_platform", _Platform(141 * gib))  # an H200 under the plan
    share = cfg.rollout.gpu_memory_utilization
    assert engine_kwargs(spec, info)["kv_cache_memory_bytes"] == pytest.approx(kv + share * 61 * gib, abs=2)
    # a smaller share of the GPU leaves a smaller cache; none at all is refused with what to raise
    monkeypatch.setattr(vllm.platforms, "current_platform", _Platform(80 * gib))
    small = engine_spec(load_config("recipes/gpu_demo.yaml", ["rollout.gpu_memory_utilization=0.2"]), "/m")
    assert 0 < engine_kwargs(small, info)["kv_cache_memory_bytes"] < kv
    none = engine_spec(load_config("recipes/gpu_demo.yaml", ["rollout.gpu_memory_utilization=0.01"]), "/m")
    with pytest.raises(ValueError, match="leaves no KV cache.*raise rollout.gpu_memory_utilization"):
        engine_kwargs(none, info)
    monkeypatch.setattr(vllm.platforms, "current_platform", _Platform(8 * gib))  # not the GPU planned for
    with pytest.raises(ValueError, match=r"of a 8.0 GiB GPU \(the plan took a 80 GiB GPU: set resources."):
        engine_kwargs(
            engine_spec(load_config("recipes/gpu_demo.yaml", ["rollout.gpu_memory_utilization=0.1"]), "/m"),
            info,
        )
    mine = load_config(
        "recipes/gpu_demo.yaml",
        ["rollout.gpu_memory_utilization=0.01", "rollout.engine_args={kv_cache_memory_bytes: 1073741824}"],
    )
    assert engine_kwargs(engine_spec(mine, "/m"), info)["kv_cache_memory_bytes"] == gib  # one's own size
    theirs = load_config("recipes/gpu_demo.yaml", ["rollout.engine_args={gpu_memory_utilization: 0.2}"])
    assert (
        engine_kwargs(engine_spec(theirs, "/m"), info)["kv_cache_memory_bytes"]
        == engine_kwargs(small, info)["kv_cache_memory_bytes"]
    )  # engine_args' share, as vLLM gets it
    cpu = engine_spec(load_config(recipe(tmp_path)), "/m")  # no sleep mode: vLLM sizes it
    assert cpu.non_kv_bytes == 0 and "kv_cache_memory_bytes" not in engine_kwargs(cpu, info)


def test_choices_are_the_registries_names(tmp_path):
    from rl.core import algo

    assert set(algo.ADV_ESTIMATORS) == {"grpo", "drgrpo", "rloo"}
    for name in algo.POLICY_LOSSES:
        assert load_config(recipe(tmp_path), [f"algorithm.policy_loss={name}"]).algorithm.policy_loss == name
    msg = error(recipe(tmp_path), ["algorithm.adv_estimator=grpp"])
    assert (
        "expected one of 'grpo', 'drgrpo', 'rloo', or an import path (`file.py:name`, `module:name`), "
        "got 'grpp' (did you mean 'grpo'?)"
    ) in msg


def test_expert_layout_reaches_the_engine(tmp_path):
    from rl.setup import engine_spec

    path = recipe(tmp_path)
    assert engine_spec(load_config(path), "/m").lora_experts_stacked is True  # the default
    per_expert = load_config(path, ["sync.expert_layout=per_expert"])
    assert engine_spec(per_expert, "/m").lora_experts_stacked is False
    assert "sync.expert_layout: expected one of 'stacked', 'per_expert'" in error(
        path, ["sync.expert_layout=3d"]
    )


def test_validate_is_clean_on_defaults_with_required_values():
    cfg = SparkConfig()
    cfg.run.name, cfg.model.path, cfg.data.train = "x", "m", "d"
    cfg.rollout.seed = cfg.data.seed = 0
    cfg.eval.max_response_len = cfg.rollout.max_response_len
    assert validate(cfg) == []


def test_parse_override_reads_values_as_yaml():
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_override("a.b=") == ("a.b", "")
    assert parse_override("a.b=x=y") == ("a.b", "x=y")
    spec = "org/name?split=test&limit=5"
    assert parse_override(f"data.train={spec}") == ("data.train", spec)


# ---- save / resume --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_save_then_load_gives_the_same_config(tmp_path, path):
    cfg = load_config(path, ["run.seed=11"])
    out = save_config(cfg, tmp_path / "deep" / "config.yaml")
    assert sorted(p.name for p in out.parent.iterdir()) == ["config.yaml"]  # no temporary file left
    text = out.read_text()
    assert "${" not in text  # fully resolved
    assert yaml.safe_load(text)["rollout"]["seed"] == 11
    assert load_config(out) == cfg


def test_save_replaces_an_existing_file(tmp_path):
    out = tmp_path / "config.yaml"
    out.write_text("old")
    save_config(load_config(recipe(tmp_path)), out)
    assert load_config(out).run.name == "t"


# ---- recipes --------------------------------------------------------------------------------------


def test_there_are_the_three_recipes():
    assert {p.name for p in RECIPES} >= {
        "demo_cpu.yaml",
        "muse_spark_open_dapo_lora.yaml",
        "qwen3_30b_a3b_dapo_lora.yaml",
    }


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads(path):
    cfg = load_config(path)
    assert cfg.run.name == path.stem


def test_reference_recipe_matches_the_issue():
    cfg = load_config(REPO / "recipes" / "muse_spark_open_dapo_lora.yaml")
    assert cfg.model.rollout_path and "nvfp4" in cfg.model.rollout_path.lower()
    assert cfg.model.dtype == "bfloat16"
    assert (cfg.lora.rank, cfg.lora.alpha) == (32, 64)
    assert cfg.lora.target_experts and cfg.lora.target_latent
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(cfg.lora.target_modules)
    assert cfg.algorithm.adv_estimator == "grpo"
    assert cfg.data.train == "BytedTsinghua-SIA/DAPO-Math-17k"
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.rollout.max_response_len) == (32, 8, 4096)
    assert cfg.trainer.total_steps == 150
    assert (cfg.eval.data, cfg.eval.k) == ("BytedTsinghua-SIA/AIME-2024", 8)
    assert cfg.r3.enabled
    assert cfg.resources.num_gpus == 16 and cfg.trainer.num_ranks == 16


def test_qwen3_recipe_runs_on_8_gpus():
    cfg = load_config(REPO / "recipes" / "qwen3_30b_a3b_dapo_lora.yaml")
    assert cfg.model.path == "Qwen/Qwen3-30B-A3B"
    assert cfg.resources.num_gpus == 8 and cfg.resources.nodes == 1
    assert cfg.lora.target_experts and "q_proj" in cfg.lora.target_modules


def test_demo_recipe_is_the_cpu_demo():
    cfg = load_config(REPO / "recipes" / "demo_cpu.yaml")
    assert (cfg.model.make_tiny.arch, cfg.model.make_tiny.sft) == ("qwen3_moe", "arith")
    assert cfg.model.dtype == "float32" and cfg.resources.num_gpus == 0
    assert cfg.data.train == "synthetic:arith" and cfg.eval.data == "synthetic:arith"
    assert (cfg.trainer.num_ranks, cfg.rollout.num_workers) == (2, 1)
    assert (cfg.sync.mode, cfg.r3.enabled) == ("merged", True)
    assert (cfg.data.train_batch_size, cfg.rollout.n, cfg.rollout.max_response_len) == (64, 8, 32)
    assert (cfg.trainer.total_steps, cfg.eval.every, cfg.eval.k) == (25, 5, 8)
    assert cfg.rollout.cpu_kvcache_gb == 1


def _expand_sweep(path: Path) -> list[tuple[Path, list[str]]]:
    """The format documented atop recipes/sweeps/*.yaml, expanded just enough to check the example."""
    spec = yaml.safe_load(path.read_text())
    assert set(spec) <= {"base", "name", "overrides", "grid", "list"}
    base = (path.parent / spec["base"]).resolve()
    common = [f"{k}={v}" for k, v in (spec.get("overrides") or {}).items()]
    grid = spec.get("grid") or {}
    points = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    runs = []
    for entry in spec.get("list") or [{}]:
        for point in points:
            sets = {**entry, **point}
            assert "run.name" not in sets
            name = f"run.name={spec['name']}-{len(runs)}"
            runs.append((base, common + [f"{k}={v}" for k, v in sets.items()] + [name]))
    return runs


@pytest.mark.parametrize("path", sorted((REPO / "recipes" / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_sweep_example_expands_to_valid_configs(path):
    runs = _expand_sweep(path)
    assert len(runs) == 8
    configs = [load_config(base, overrides) for base, overrides in runs]
    assert len({c.run.name for c in configs}) == 8
    assert {(c.trainer.lr, c.algorithm.clip_ratio_high, c.lora.rank) for c in configs} == {
        (lr, clip, rank) for lr in (1e-4, 3e-4) for clip in (0.2, 0.28) for rank in (8, 16)
    }
    assert all(c.trainer.total_steps == 20 for c in configs)


# ---- generated docs -------------------------------------------------------------------------------


def test_docs_are_up_to_date():
    """docs/config.md is generated: run `python -m rl.config_docs` after changing rl/config.py."""
    assert config_docs.DOCS_PATH.read_text() == config_docs.render()


def test_docs_list_every_key_with_its_doc():
    text = config_docs.render()
    for path, f, _tp in schema_fields():
        assert f"`{path}`" in text
        assert f.metadata.get("doc"), f"{path} has no doc line"


def test_docs_check_mode(tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text("old")
    assert config_docs.main(["--check", "--out", str(stale)]) == 1
    assert config_docs.main(["--out", str(stale)]) == 0
    assert config_docs.main(["--check", "--out", str(stale)]) == 0


def test_every_field_default_is_a_plain_value():
    """Mutable defaults come from factories, so two configs never share a list."""
    a, b = SparkConfig(), SparkConfig()
    a.lora.target_modules.append("x")
    assert "x" not in b.lora.target_modules
    assert dataclasses.is_dataclass(a.algorithm.rollout_correction)
    assert sys.modules["rl.config"].SparkConfig is SparkConfig


def test_trainer_spec_carries_the_memory_budget():
    from rl.setup import trainer_spec

    cfg = load_config(REPO / "recipes" / "demo_cpu.yaml", ["trainer.activation_memory_budget=0.25"])
    assert trainer_spec(cfg, "model").trainer.activation_memory_budget == 0.25
