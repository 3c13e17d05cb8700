"""Every leaf of the config schema has an effect: flipped on its own to another valid value, in the CPU demo
or in the 8-GPU Qwen3 recipe, it changes a worker spec (trainer, rollout engine, sampling, GPU placement),
or it is read by the driver (or planner) code named for it in DRIVER_READS (the test reads that code's source for the
key's name: the driver's own behaviour has no spec to compare). The trainer's spec carries the `trainer:`
and `lora:` sections whole and the engine's the `rollout:` section, so for their keys being in the spec
proves nothing: the worker's code must read the key (an attribute `trainer.<key>` / `lora.<key>` /
`rollout.<key>`), or it must change another part of a spec (a derived
value, the placement), or the driver must read it. A key that does none of these does nothing, and this
test fails on it."""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import re
import typing
from pathlib import Path

import pytest

from rl.config import _FIELDS, is_section, load_config, validate

# Keys the driver (its setup code, the planner) reads from the config itself rather than through a worker spec:
# key -> the function that reads it. The test checks that the function's source reads the key's leaf.
DRIVER_READS = {
    "run.name": "rl.config.run_dir",
    "run.dir": "rl.config.run_dir",
    "model.rollout_path": "rl.setup.resolve_model_paths",
    "model.make_tiny.arch": "rl.setup.resolve_model_paths",
    "model.make_tiny.sft": "rl.setup.resolve_model_paths",
    "model.make_tiny.seed": "rl.setup.resolve_model_paths",
    "model.make_tiny.quantize": "rl.setup.resolve_model_paths",
    # resolved against the checkpoint: on the test's BF16 models every valid value gives bf16
    "trainer.base_format": "rl.setup.trainer_spec",
    "resources.device": "rl.plan_time.device_kind",
    "resources.intra_node_gbps": "rl.plan_time._links",
    "resources.inter_node_gbps": "rl.plan_time._links",
    "resources.wait_report_s": "rl.setup.waiting_for_resources",
    "resources.wait_timeout_s": "rl.setup.waiting_for_resources",
    "trainer.checkpoint_every": "rl.driver.Run._checkpoint_due",
    "trainer.keep_checkpoints": "rl.driver.Run.__init__",
    "trainer.max_skipped_steps": "rl.driver.Run._count_skips",
    "algorithm.dynamic_sampling.enabled": "rl.driver.Run.collect_batch",
    "algorithm.dynamic_sampling.max_draws": "rl.driver.Run.collect_batch",
    # reaches the trainer spec at rollout.max_staleness > 0 only, which neither base below has
    "algorithm.rollout_correction.mode": "rl.config.rollout_correction_caps",
    "algorithm.overlong.buffer_len": "rl.driver.Run._score",
    "algorithm.overlong.penalty_factor": "rl.driver.Run._score",
    "data.train": "rl.setup.build_components",
    "data.shuffle": "rl.driver.Run.__init__",
    "data.seed": "rl.setup.load_prompts_for",
    "data.prompt_key": "rl.setup.load_prompts_for",
    "data.arith.train_rows": "rl.setup.build_components",
    "data.arith.eval_rows": "rl.setup.build_components",
    "data.arith.num_terms": "rl.setup.load_prompts_for",
    "data.arith.max_operand": "rl.setup.load_prompts_for",
    "data.arith.ops": "rl.setup.load_prompts_for",
    "reward.backend": "rl.reward.RewardSpec.of_config",
    "reward.function": "rl.reward.RewardSpec.of_config",
    "reward.kwargs": "rl.reward.RewardSpec.of_config",
    "reward.batched": "rl.reward.RewardSpec.of_config",
    "reward.by_source": "rl.reward.RewardSpec.of_config",
    "reward.max_error_fraction": "rl.driver.Run._check_reward_errors",
    "reward.timeout_s": "rl.setup.build_reward",
    "reward.num_workers": "rl.setup.build_reward",
    "eval.every": "rl.driver.Run._eval_due",
    "eval.data": "rl.setup.build_components",
    "eval.at_start": "rl.driver.Run.train",
    "monitor.k3_kl_max": "rl.driver.Run.__init__",
    "monitor.k3_kl_trend_max": "rl.driver.Run.__init__",
    "monitor.trend_window": "rl.driver.Run.__init__",
    "monitor.stop_on_violation": "rl.driver.Run._score_and_update",
    "monitor.save_violations": "rl.driver.Run._check_kl",
    "monitor.flat_reward_steps": "rl.driver.Run._check_flat_rewards",
    "logging.console_every": "rl.driver.Run.__init__",
    "logging.tensorboard": "rl.driver.Run.__init__",
    "logging.wandb_project": "rl.driver.Run.__init__",
    "logging.wandb_entity": "rl.driver.Run.__init__",
    "logging.mlflow_tracking_uri": "rl.driver.Run.__init__",
    "logging.mlflow_experiment": "rl.driver.Run.__init__",
    "logging.rollouts_every": "rl.driver.Run._step_metrics",
    "logging.rollouts_per_step": "rl.driver.Run._record_rollouts",
    "logging.rollouts_max_chars": "rl.driver.Run._record_rollouts",
    "resources.ray_address": "rl.setup.init_ray",
    # The machines' shape: the bound on resources.num_gpus and `sparkrl plan`'s rank advice.
    "resources.nodes": "rl.plan._ranks_change",
    "resources.gpus_per_node": "rl.plan._ranks_change",
}


# Config sections a worker spec carries whole (trainer.spec.TrainerSpec, rollout.spec.EngineSpec): section ->
# the package reading it.
WHOLE_SECTIONS = {"trainer": "trainer", "lora": "trainer", "rollout": "rollout"}
ROOT = Path(__file__).resolve().parents[2]


def _leaves() -> list[str]:
    return [path for path, (_, tp) in _FIELDS.items() if not is_section(tp)]


def _get(cfg, path: str):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _set(cfg, path: str, value) -> None:
    *parents, leaf = path.split(".")
    for part in parents:
        cfg = getattr(cfg, part)
    setattr(cfg, leaf, value)


def _candidates(path: str, value):
    f, tp = _FIELDS[path]
    if f.metadata.get("choices"):
        return [c for c in f.metadata["choices"] if c != value]
    if tp is bool:
        return [not value]
    if tp is int:
        return [value + 1, value * 2, value - 1, 1, 2, 4, 8, 16, 32, 0, 8192, 65536]
    if tp is float:
        return [value * 2, value / 2, value + 0.1, 0.5, 0.1, 1.0, 2.0, 0.0]
    if tp is str:
        return [
            "synthetic:arith?limit=16",
            r"model\.layers\.0\.self_attn\.q_proj",
            "*",
            "other",
            "x",
            "pkg.mod:fn",
        ]
    if typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        return [[0.8, 0.99]] if item is float else [["q_proj"], ["q_proj", "v_proj"]]
    if typing.get_origin(tp) is dict:
        return [{"enable_thinking": False}, {"synthetic/arith": "math_verify"}]
    raise AssertionError(f"{path}: no candidate values for type {tp}")


def _flipped(base, path: str):
    """A copy of base with `path` set to another value that passes validation (None if none does)."""
    for value in _candidates(path, _get(base, path)):
        cfg = copy.deepcopy(base)
        _set(cfg, path, value)
        if value != _get(base, path) and not validate(cfg):
            return cfg
    return None


def _effects(cfg) -> dict:
    from rl.placement import plan_placement
    from rl.setup import engine_spec, sampling_spec, trainer_spec

    try:
        bundles, place = plan_placement(cfg)
        placement = (bundles, {k: v for k, v in vars(place).items() if k != "placement_group"})
    except ValueError as e:  # a layout the placement refuses: the refusal is the behaviour
        placement = str(e)
    # The sections a worker takes whole count by what its code reads (_worker_reads), not by being copied
    # into its spec.
    return {
        "trainer": _without_sections(trainer_spec(cfg, "/m")),
        "engine": _without_sections(engine_spec(cfg, "/r")),
        "sampling": sampling_spec(cfg, 0),
        "eval_sampling": sampling_spec(cfg, 0, eval=True),
        "placement": placement,
    }


def _without_sections(spec) -> dict:
    return {k: v for k, v in vars(spec).items() if k not in WHOLE_SECTIONS}


def _worker_reads(section: str, leaf: str) -> bool:
    """Whether the package that takes `section` whole reads its key `leaf`: an attribute `<section>.<leaf>`
    in its code (`spec.trainer.lr`, or `trainer.lr` where a function takes the section as `trainer`),
    comments and docstrings aside; the section's own definition left out."""
    package = ROOT / WHOLE_SECTIONS[section]
    for path in package.rglob("*.py"):
        if path.name == "config.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == leaf:
                owner = node.value
                name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
                if name == section:
                    return True
    return False


def _reads(function: str, leaf: str) -> bool:
    parts = function.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return re.search(rf"\.{leaf}\b", inspect.getsource(obj)) is not None
    raise AssertionError(f"{function}: not importable")


@pytest.fixture(scope="module")
def bases():
    return [
        load_config("demo_cpu", ["run.name=t", "trainer.mini_batch_size=16", "trainer.ppo_epochs=2"]),
        # a reward function of one's own: reward.kwargs and reward.batched apply only then
        load_config("demo_cpu", ["run.name=t", "reward.function=pkg.mod:fn"]),
        load_config(
            "qwen3_30b_a3b_dapo_lora",
            [
                "algorithm.rollout_correction.mis_high=2.0",
                "rollout.tensor_parallel_size=1",
                "trainer.num_ranks=4",
                "resources.nodes=2",
                "resources.gpus_per_node=4",
            ],
        ),
    ]


@pytest.mark.parametrize("path", _leaves())
def test_every_key_changes_a_worker_spec_or_is_read_by_the_driver(bases, path):
    section, _, leaf = path.partition(".")
    if section in WHOLE_SECTIONS and path not in DRIVER_READS and _worker_reads(section, leaf):
        return  # the worker that takes the section reads the key
    pairs = [(b, _flipped(b, path)) for b in bases]
    pairs = [(b, f) for b, f in pairs if f is not None]
    assert pairs, f"{path}: no other valid value found to flip it to"
    if any(_effects(f) != _effects(b) for b, f in pairs):
        assert path not in DRIVER_READS, f"{path} reaches a worker spec: drop it from DRIVER_READS"
        return
    assert path in DRIVER_READS, (
        f"{path}: flipping it changes no worker spec and the driver reads it nowhere named (a key that does "
        "nothing?)"
    )
    assert _reads(DRIVER_READS[path], path.rpartition(".")[2]), f"{DRIVER_READS[path]} does not read {path}"


def test_driver_reads_names_only_schema_keys():
    assert set(DRIVER_READS) <= set(_leaves())
