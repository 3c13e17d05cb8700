"""The typed configuration: one dataclass per section, loaded from a YAML recipe plus `key=value` overrides.

    cfg = load_config("recipes/demo_cpu.yaml", ["trainer.lr=3e-4", "run.name=try1"])
    cfg.trainer.lr, cfg.rollout.n, run_dir(cfg)
    save_config(cfg, run_dir(cfg) / "config.yaml")     # fully resolved; load_config() gives it back

Each field carries a doc line, and where it applies its choices or bounds, in its metadata: validate()
checks them and `rl.config_docs` turns them into docs/config.md. A mistake in a recipe or an override
raises `ConfigError`, whose message names where it came from (file or override), the full key path,
what was expected and, for an unknown key, the nearest valid one. `${...}` interpolations (OmegaConf)
are allowed and resolved on load.
"""

import dataclasses
import difflib
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from rl.core import user_code
from rl.core.options import Registered
from rl.core.options import option as _f
from rollout.config import RolloutConfig
from trainer.config import LoraConfig, TrainerConfig

# ----------------------------------------------------------------------------------------------------
# The schema
# ----------------------------------------------------------------------------------------------------


@dataclass
class RunConfig:
    """Naming and seeding of a run."""

    name: str = _f(MISSING, "Run name; the run directory is `runs/<name>` unless `run.dir` is set.")
    dir: str = _f("", "Run directory ('' = `runs/<run.name>`, relative to the working directory).")
    seed: int = _f(0, "Base seed; `rollout.seed` and `data.seed` follow it unless set.")


@dataclass
class MakeTinyConfig:
    """Build the policy with `sparkrl make-tiny` (cached) instead of loading `model.path`: the CPU demo."""

    arch: str = _f(
        "", "Tiny architecture to build ('' = off).", Registered("rl.models.registry", "TINY_CHOICES")
    )
    sft: str = _f(
        "",
        "Supervised warm-up giving the tiny model a starting policy ('' = none; arith: the CPU demo's; "
        "arith_tool: arith, then calculator tool-call transcripts, the tool-use demo's).",
        ("", "arith", "arith_tool"),
    )
    seed: int = _f(0, "Seed of the tiny model's initialisation and warm-up.")
    quantize: str = _f(
        "",
        "Train and serve its weight-only NVFP4 copy ('' = the BF16 model; nvfp4: the GPU demo: vLLM on CPU "
        "has no NVFP4 kernel).",
        ("", "nvfp4"),
    )


@dataclass
class ModelConfig:
    """The policy's base weights, for the trainer and for the rollout engine."""

    path: str = _f(
        "",
        "Trainer weights: a Hugging Face id or directory, or an NVFP4 compressed-tensors "
        "directory (dequantized to `model.dtype` on load). Required unless `model.make_tiny.arch` "
        "is set.",
    )
    rollout_path: str = _f("", "Rollout weights, e.g. the NVFP4 checkpoint ('' = same as `model.path`).")
    dtype: str = _f("bfloat16", "Dtype of the frozen base weights on both sides.", ("bfloat16", "float32"))
    head_dtype: str = _f(
        "float32",
        "The LM head's logits on both sides: float32 (the head's matmul accumulated and kept in fp32, the "
        "trainer's and vLLM's `head_dtype`) or model (rounded to `model.dtype` first, then fp32 for the "
        "softmax). Rounding the logits to bf16 moves a log-prob by up to a bf16 step of the largest logit, "
        "which a trainer and an engine whose arithmetic differs slightly round differently.",
        ("float32", "model"),
    )
    trust_remote_code: bool = _f(False, "Allow model code shipped with the checkpoint (transformers, vLLM).")
    make_tiny: MakeTinyConfig = _f(MakeTinyConfig, "Tiny model built on the fly (CPU demo and tests).")


class RolloutCaps(typing.NamedTuple):
    """The correction a run applies: the TIS cap and the MIS bounds, each 0 = off."""

    tis_cap: float
    mis_low: float
    mis_high: float


# Mode auto's correction when the batch lags the update (rollout.max_staleness > 0): each token weighed by
# min(current / rollout probability, 2), the tokens whose probability has since halved or doubled dropped.
AUTO_CORRECTION = RolloutCaps(tis_cap=2.0, mis_low=0.5, mis_high=2.0)


@dataclass
class RolloutCorrectionConfig:
    """Importance weights pi_trainer / pi_rollout that correct for rollout-trainer mismatch and, with
    `rollout.max_staleness` > 0, for the lag of the adapter that generated the batch."""

    mode: str = _f(
        "auto",
        "auto: the caps below as given; with none of them set and `rollout.max_staleness` > 0, "
        f"tis_cap={AUTO_CORRECTION.tis_cap:g}, mis_low={AUTO_CORRECTION.mis_low:g}, "
        f"mis_high={AUTO_CORRECTION.mis_high:g} (the asynchronous CPU demo collapsed "
        "without a correction). none: no correction at any staleness (the caps must stay 0).",
        ("auto", "none"),
    )
    tis_cap: float = _f(
        0.0,
        "Truncated importance sampling: weight each token by min(ratio, cap) (0 = off; else at least 1).",
        ge=0,
    )
    mis_low: float = _f(
        0.0, "Masked importance sampling: drop tokens whose ratio is below this (0 = off).", ge=0, lt=1
    )
    mis_high: float = _f(
        0.0,
        "Masked importance sampling: drop tokens whose ratio is above this (0 = off; else above 1).",
        ge=0,
    )


def rollout_correction_caps(cfg: "SparkConfig") -> RolloutCaps:
    """The correction that `algorithm.rollout_correction` asks for at `rollout.max_staleness`: the caps as
    given; under mode auto with none given and staleness > 0, AUTO_CORRECTION; under mode none, nothing.
    Synchronous runs (staleness 0) get exactly the caps given."""
    rc = cfg.algorithm.rollout_correction
    if rc.mode == "none":
        return RolloutCaps(0.0, 0.0, 0.0)
    given = RolloutCaps(float(rc.tis_cap), float(rc.mis_low), float(rc.mis_high))
    if cfg.rollout.max_staleness > 0 and not any(given):
        return AUTO_CORRECTION
    return given


MAX_DRAWS = 64  # prompt batches one step may draw: the driver gives each (step, draw) its own seed stream


@dataclass
class DynamicSamplingConfig:
    """DAPO dynamic sampling: drop groups whose rewards are all equal and draw more prompts."""

    enabled: bool = _f(False, "Turn dynamic sampling on.")
    max_draws: int = _f(
        10,
        "Most prompt batches drawn for one step; then train on the groups kept so far.",
        ge=1,
        le=MAX_DRAWS,
    )


@dataclass
class OverlongConfig:
    """DAPO overlong reward shaping: a penalty growing over the last tokens before the length limit, on the
    training rewards (evaluations score the task's reward alone, as `sparkrl eval` does)."""

    buffer_len: int = _f(
        0, "Tokens before `rollout.max_response_len` over which the penalty ramps (0 = off).", ge=0
    )
    penalty_factor: float = _f(1.0, "Penalty at the length limit.", ge=0)


@dataclass
class AlgorithmConfig:
    """Advantages and the policy loss."""

    adv_estimator: str = _f(
        "grpo",
        "Advantage estimator: grpo (group-centred rewards over the group's standard deviation), drgrpo "
        "(group-centred, not divided), rloo (leave-one-out baseline), or your own by import path "
        "(`file.py:name`, `module:name`; a file relative to the recipe's directory) with verl's "
        "`compute_*_advantage` signature `(token_level_rewards, response_mask, index, config) -> "
        "(advantages, returns)`, called in the driver (docs/your_task.md).",
        Registered("rl.core.algo", "ADV_ESTIMATORS", import_paths=True),
    )
    policy_loss: str = _f(
        "vanilla",
        "Token-level clipped PPO (vanilla, also named ppo), sequence-level ratio (gspo), or your own by "
        "import path (`file.py:name`, `module:name`) with verl's PolicyLossFn signature `(old_log_prob, "
        "log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights) -> (loss, "
        "metrics)`, resolved in every trainer rank; its metrics are reported as token-weighted means.",
        Registered("rl.core.algo", "POLICY_LOSSES", import_paths=True),
    )
    clip_ratio_low: float = _f(0.2, "Lower clip: ratio >= 1 - clip_ratio_low.", ge=0, le=1)
    clip_ratio_high: float = _f(0.28, "Upper clip: ratio <= 1 + clip_ratio_high (DAPO clip-higher).", ge=0)
    clip_ratio_c: float = _f(3.0, "Dual-clip bound for negative advantages.", gt=1)
    loss_agg_mode: str = _f(
        "token-mean",
        "How token losses are averaged.",
        Registered("rl.core.algo", "LOSS_AGG_MODES"),
    )
    entropy_coeff: float = _f(
        0.0,
        "Entropy bonus: the loss minus this times the token entropy, aggregated like the policy loss "
        "(verl's actor.entropy_coeff; 0 = off).",
        ge=0,
    )
    kl_coef: float = _f(
        0.0,
        "KL loss to the reference, the base model (the adapter switched off, the same routing replayed): "
        "this times the k3 estimate, aggregated like the policy loss; `actor/kl_loss` (0 = off).",
        ge=0,
    )
    rollout_correction: RolloutCorrectionConfig = _f(RolloutCorrectionConfig, "Mismatch correction.")
    dynamic_sampling: DynamicSamplingConfig = _f(DynamicSamplingConfig, "DAPO dynamic sampling.")
    overlong: OverlongConfig = _f(OverlongConfig, "DAPO overlong reward shaping.")


@dataclass
class ArithConfig:
    """Defaults of `synthetic:arith` sources (rl/data/arith.py); options in a spec's query take precedence."""

    train_rows: int = _f(4096, "Problems in the training set.", ge=1)
    eval_rows: int = _f(64, "Problems in the eval set (split `test`, disjoint from training).", ge=1)
    num_terms: int = _f(2, "Operands per expression.", ge=2)
    max_operand: int = _f(9, "Operands are drawn from [0, max_operand].", ge=1)
    ops: str = _f("+-", "Operators to use: a non-empty string over '+', '-', '*'.")


@dataclass
class DataConfig:
    """Training prompts. A prompt source is a spec `SOURCE[?key=value&...]` (rl/data/sources.py): a Hugging
    Face dataset id (`owner/name`), a local .parquet/.jsonl file or directory, or `synthetic:arith`, with
    options such as `split`, `limit` and `dedup` in the query (e.g. `org/name?split=test&limit=100`)."""

    train: str = _f(MISSING, "Training prompt source (e.g. `BytedTsinghua-SIA/DAPO-Math-17k`).")
    train_batch_size: int = _f(32, "Prompts per step.", ge=1)
    shuffle: bool = _f(True, "Shuffle the training prompts each epoch.")
    seed: int = _f("${run.seed}", "Shuffling seed.")
    prompt_key: str = _f(
        "prompt",
        "Column of a file's or hub dataset's chat messages (verl's schema: `prompt`; a synthetic task makes "
        "its own).",
    )
    chat_template_kwargs: dict[str, Any] = _f(
        {}, "Extra arguments to the tokenizer's chat template (e.g. `{enable_thinking: false}` for Qwen3)."
    )
    arith: ArithConfig = _f(ArithConfig, "Knobs of `synthetic:arith`.")


@dataclass
class RewardConfig:
    """Scoring of responses: a built-in math checker or a function of your own, per data source if need be
    (docs/your_task.md). A response that cannot be scored (an exception, a timeout) scores -1 and is
    counted in `reward/errors`."""

    backend: str = _f(
        "math_dapo",
        "Built-in checker, used where `reward.function` is empty: DAPO's 'Answer:' line match, or "
        "math-verify. Both need `reward_model.ground_truth` to be a non-empty string.",
        Registered("rl.reward", "BACKENDS"),
    )
    function: str = _f(
        "",
        "Your reward function by import path, `path/to/file.py:name` (relative to the recipe's directory; "
        "on the command line to the working directory) or `package.module:name`, with verl's signature "
        "`name(data_source, solution_str, ground_truth, extra_info, **kwargs) -> float | dict` (a dict has "
        "`score`, optionally `acc` and `pred`; its other numeric keys become `reward/<key>` metrics). "
        "Called in the reward processes and by `sparkrl eval`; '' = `reward.backend`.",
    )
    kwargs: dict[str, Any] = _f(
        {}, "Fixed keyword arguments passed to every function of your own (`reward.function`, `by_source`)."
    )
    batched: bool = _f(
        False,
        "Call your functions once a batch, verl's BatchRewardManager form: `name(data_sources, "
        "solution_strs, ground_truths, extra_infos, **kwargs) -> list` (for a checker that calls a model "
        "or a server); a call of m responses is allowed m x `reward.timeout_s`.",
    )
    by_source: dict[str, str] = _f(
        {},
        "Checker of each data source (the rows' `data_source`): `math_dapo`, `math_verify` or an import "
        "path; sources not named use `reward.function`, else `reward.backend`. Metrics are split by "
        "source: `reward/<source>/mean`, `acc/<source>/mean`.",
    )
    max_error_fraction: float = _f(
        0.1,
        "Stop the run when more than this fraction of a step's (or an evaluation's) responses fail to "
        "score; the first traceback of each function goes to `logs/reward.log` with its row (1 = never).",
        ge=0,
        le=1,
    )
    timeout_s: float = _f(
        10.0,
        "Seconds allowed to score one response (then its process is replaced, and it scores -1 and counts as "
        "an error); enforced by the scoring processes: not with `reward.num_workers` 0.",
        gt=0,
    )
    num_workers: int = _f(
        4,
        "Scoring processes (0 = in the driver, without `reward.timeout_s`: a checker that hangs stops the run; "
        "for debugging, or a demo on few cores).",
        ge=0,
    )


def reward_checkers(reward: RewardConfig) -> dict[str, str]:
    """Config key -> checker (a built-in name or an import path) of every checker the run uses."""
    out = {"reward.function": reward.function} if reward.function else {"reward.backend": reward.backend}
    out.update({f"reward.by_source.{source}": c for source, c in reward.by_source.items()})
    return out


@dataclass
class EvalConfig:
    """Periodic evaluation on the rollout workers: mean@k, maj@k and best@k per data source."""

    every: int = _f(10, "Evaluate every N steps (0 = never).", ge=0)
    k: int = _f(8, "Samples per problem.", ge=1)
    temperature: float = _f(1.0, "Sampling temperature.", ge=0)
    top_p: float = _f(1.0, "Nucleus sampling threshold.", gt=0, le=1)
    max_response_len: int = _f("${rollout.max_response_len}", "Most tokens generated for one response.", ge=1)
    data: str = _f(
        "",
        "Eval prompt source, a `data.train`-style source (e.g. `BytedTsinghua-SIA/AIME-2024`, the flagship "
        "recipe's); '' = no evaluation.",
    )
    at_start: bool = _f(True, "Also evaluate before the first step.")


@dataclass
class SyncConfig:
    """How the updated policy reaches the rollout workers after each step."""

    mode: str = _f(
        "adapter",
        "Ship the LoRA adapter (adapter), or merge it into the base weights and push "
        "them (merged: for backends with no MoE-LoRA kernel, such as vLLM on CPU).",
        ("adapter", "merged"),
    )
    expert_layout: str = _f(
        "stacked",
        "How adapter sync ships routed-expert LoRA: stacked (PEFT's 3D tensors, 4 a MoE layer, split per "
        "expert inside vLLM) or per_expert (split by "
        "sparkrl, 6 tensors an expert). Same adapter either way; stacked synced in half the time on the "
        "H200 (docs/benchmarks.md).",
        ("stacked", "per_expert"),
    )


@dataclass
class R3Config:
    """Rollout routing replay: the trainer routes each token to the experts the rollout engine chose."""

    enabled: bool = _f(
        True,
        "Capture routing in rollout and replay it in the trainer (a dense model has no routing: nothing to "
        "replay, `r3/replayed_fraction` 0).",
    )
    measure_live_kl: bool = _f(
        False,
        "With R3 on, also score every batch with the trainer's own (live) routing and report "
        "`r3/live_k3_kl`: the k3 KL against the rollout had routing not been replayed, on the same samples "
        "as `rollout_corr/k3_kl`, so the two compare pairwise. Costs one more no-grad forward a step.",
    )


@dataclass
class MonitorConfig:
    """Health checks on `rollout_corr/k3_kl` (trainer vs rollout log-probs before any update)."""

    k3_kl_max: float = _f(0.01, "Largest allowed k3 KL of a step (0 = no check).", ge=0)
    k3_kl_trend_max: float = _f(
        5.0,
        "Largest allowed ratio of the mean k3 KL over the last "
        "`monitor.trend_window` steps to that over the first ones (0 = no check).",
        ge=0,
    )
    trend_window: int = _f(10, "Steps averaged at each end for the trend check.", ge=1)
    stop_on_violation: bool = _f(False, "Stop the run on a violation (otherwise warn and record it).")
    save_violations: int = _f(
        20,
        "Write the evidence of the first N steps over the KL budget (`monitor.k3_kl_max`, the trend) to "
        "`kl_violations/` in the run "
        "directory: every sampled token's trainer and rollout log-probs (`step_N.npz`) and the tokens and "
        "samples with the largest gaps (`step_N.json`) (0 = none).",
        ge=0,
    )
    flat_reward_steps: int = _f(
        3,
        "Warn, naming the likely causes, after this many steps in a row whose every group had equal "
        "rewards (no gradient); each such step is warned of on its own as well (0 = no warnings).",
        ge=0,
    )


@dataclass
class LoggingConfig:
    """Where metrics go besides `metrics.jsonl` in the run directory."""

    console_every: int = _f(1, "Print a metrics line every N steps.", ge=1)
    tensorboard: bool = _f(True, "Write TensorBoard events under the run directory.")
    wandb_project: str = _f("", "Weights & Biases project ('' = off).")
    wandb_entity: str = _f("", "Weights & Biases entity ('' = your default).")
    mlflow_tracking_uri: str = _f(
        "",
        "MLflow tracking URI ('' = off), e.g. `http://host:5000` or `sqlite:///mlflow.db`: params (the "
        "config), step metrics and rollout tables; `--resume` continues the same MLflow run "
        "(`pip install mlflow`).",
    )
    mlflow_experiment: str = _f("sparkrl", "MLflow experiment the run is logged under.")
    rollouts_every: int = _f(
        1,
        "Write the trained samples of every Nth step to `rollouts/step_<N>.jsonl` (prompt, response, reward, "
        "acc, pred, length, k3, adapter version) and a table of them to the trackers (0 = off).",
        ge=0,
    )
    rollouts_per_step: int = _f(
        64, "Samples written a step at most: whole groups, in group order (0 = every sample).", ge=0
    )
    rollouts_max_chars: int = _f(
        4000,
        "Longest prompt or response text written; a longer one keeps its start and end around a marker "
        "of what was cut (0 = no limit).",
        ge=0,
    )


@dataclass
class ResourcesConfig:
    """The machines the run uses."""

    num_gpus: int = _f(0, "GPUs the run uses in all (0 = CPU only).", ge=0)
    gpus_per_node: int = _f(8, "GPUs per node.", ge=1)
    nodes: int = _f(1, "Nodes.", ge=1)
    gpu_memory_gib: float = _f(
        140.0, "Memory of one GPU in GiB, what `sparkrl plan` fits the recipe into (140: an H200).", gt=0
    )
    device: str = _f(
        "auto",
        "Device kind whose rates (rl/rates.yaml) `sparkrl plan` times the step with ('auto' = cpu-2core-dev "
        "without GPUs, h100-80gb for `resources.gpu_memory_gib` <= 96, else h200).",
        ("auto", "cpu-2core-dev", "h100-80gb", "h200"),
    )
    intra_node_gbps: float = _f(
        0.0,
        "GB/s a GPU sends to another in its node (NVLink), for `sparkrl plan`'s time (0 = the device's figure "
        "in rl/rates.yaml: 450, NVLink 4 per direction).",
        ge=0,
    )
    inter_node_gbps: float = _f(
        0.0,
        "GB/s a GPU sends to one on another node (InfiniBand), for `sparkrl plan`'s time (0 = the device's "
        "figure in rl/rates.yaml: 50, one NDR 400 Gb/s NIC a GPU).",
        ge=0,
    )
    ray_address: str = _f(
        "",
        "Ray cluster to join ('' = `$RAY_ADDRESS`, else start a local instance of this run's own; "
        "'auto' = the running one).",
    )
    wait_report_s: float = _f(
        30.0, "While workers wait for CPU slots or GPUs, print what is pending every N seconds.", gt=0
    )
    wait_timeout_s: float = _f(
        600.0, "Give up when workers have waited this long for resources (0 = wait forever).", ge=0
    )


@dataclass
class SparkConfig:
    """A whole run."""

    run: RunConfig = _f(RunConfig, "Naming and seeding.")
    model: ModelConfig = _f(ModelConfig, "Base weights.")
    rollout: RolloutConfig = _f(RolloutConfig, "Rollout workers.")
    trainer: TrainerConfig = _f(TrainerConfig, "Trainer workers and optimizer.")
    lora: LoraConfig = _f(LoraConfig, "The adapter.")
    algorithm: AlgorithmConfig = _f(AlgorithmConfig, "Advantages and loss.")
    data: DataConfig = _f(DataConfig, "Training prompts.")
    reward: RewardConfig = _f(RewardConfig, "Reward scoring.")
    eval: EvalConfig = _f(EvalConfig, "Evaluation.")
    sync: SyncConfig = _f(SyncConfig, "Policy sync.")
    r3: R3Config = _f(R3Config, "Routing replay.")
    monitor: MonitorConfig = _f(MonitorConfig, "Health checks.")
    logging: LoggingConfig = _f(LoggingConfig, "Logging.")
    resources: ResourcesConfig = _f(ResourcesConfig, "Resources.")


def run_dir(cfg: SparkConfig) -> Path:
    """`run.dir`, or `runs/<run.name>` when it is empty."""
    return Path(cfg.run.dir) if cfg.run.dir else Path("runs") / cfg.run.name


# ----------------------------------------------------------------------------------------------------
# Walking the schema (shared with rl.config_docs)
# ----------------------------------------------------------------------------------------------------


def is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def schema_fields(cls: type = SparkConfig, prefix: str = ""):
    """Yield (full key path, dataclasses.Field, type) for every field, each section before its contents."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        yield path, f, hints[f.name]
        if is_section(hints[f.name]):
            yield from schema_fields(hints[f.name], path + ".")


_FIELDS = {path: (f, tp) for path, f, tp in schema_fields()}


def describe_type(tp: Any) -> str:
    """'an integer', 'a list of strings', ...: what an error message says was expected."""
    if typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        names = {int: "a list of integers", float: "a list of numbers", str: "a list of strings"}
        return names.get(item, "a list")
    if typing.get_origin(tp) is dict or tp is dict:
        return "a mapping"
    if is_section(tp):
        return f"a mapping (the section {tp.__name__})"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def describe_bounds(bounds: dict) -> str:
    """'at least 1', 'in (0, 1]', ... from a field's bounds; '' when it has none."""
    ge, gt, le, lt = bounds["ge"], bounds["gt"], bounds["le"], bounds["lt"]
    lo = ("[", ge) if ge is not None else ("(", gt) if gt is not None else None
    hi = ("]", le) if le is not None else (")", lt) if lt is not None else None
    if lo and hi:
        return f"in {lo[0]}{lo[1]:g}, {hi[1]:g}{hi[0]}"
    if lo:
        return f"at least {lo[1]:g}" if lo[0] == "[" else f"greater than {lo[1]:g}"
    if hi:
        return f"at most {hi[1]:g}" if hi[0] == "]" else f"less than {hi[1]:g}"
    return ""


def _in_bounds(value: float, b: dict) -> bool:
    return (
        (b["ge"] is None or value >= b["ge"])
        and (b["gt"] is None or value > b["gt"])
        and (b["le"] is None or value <= b["le"])
        and (b["lt"] is None or value < b["lt"])
    )


# ----------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A bad recipe or override. `problems` holds one line per mistake, each starting with where it was."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        if len(self.problems) == 1:
            super().__init__(self.problems[0])
        else:
            lines = "\n".join(f"  {p}" for p in self.problems)
            super().__init__(f"{len(self.problems)} config problems:\n{lines}")

    def __reduce__(self):  # survive pickling (Ray) with the problems intact
        return type(self), (self.problems,)


def nearest_key(path: str) -> str | None:
    """The valid key path closest to a wrong one: the same name deeper in the same section, a close
    sibling, the same name in another section, then the closest full path."""
    parent, _, leaf = path.rpartition(".")
    same_leaf = [p for p in _FIELDS if p.rpartition(".")[2] == leaf]
    inside = [p for p in same_leaf if parent and p.startswith(parent + ".")]
    if inside:
        return inside[0]
    siblings = [p.rpartition(".")[2] for p in _FIELDS if p.rpartition(".")[0] == parent]
    match = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if match:
        return f"{parent}.{match[0]}" if parent else match[0]
    if same_leaf:
        return same_leaf[0]
    match = difflib.get_close_matches(path, list(_FIELDS), n=1, cutoff=0.6)
    return match[0] if match else None


def _show(value: Any) -> str:
    return "null" if value is None else f"{value!r} ({type(value).__name__})"


# verl's spellings of what sparkrl names otherwise: an unknown key under them says where it went.
VERL_KEYS = {
    "custom_reward_function": "verl's custom_reward_function.{path,name} is reward.function: "
    '"path/to/file.py:name", and its reward_kwargs reward.kwargs',
    "reward_model.reward_manager": "verl's batch reward manager is reward.batched: true",
    "actor_rollout_ref.actor.policy_loss": "verl's policy_loss.loss_mode is algorithm.policy_loss",
}


def _check_keys(tree: Any, prefix: str, cls: type, where: str, problems: list[str]) -> Any:
    """Report unknown keys and sections given a non-mapping, recursively, before OmegaConf sees the tree.
    Returns the tree without empty sections (`lora:` with every line commented out)."""
    if not isinstance(tree, dict):
        key = prefix.rstrip(".") or "<top level>"
        problems.append(f"{where}: {key}: expected {describe_type(cls)}, got {_show(tree)}")
        return tree
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if path not in _FIELDS:
            verl = next((hint for prefix, hint in VERL_KEYS.items() if path.startswith(prefix)), None)
            near = nearest_key(path)
            if verl:
                problems.append(f"{where}: unknown key '{path}' ({verl})")
            else:
                problems.append(
                    f"{where}: unknown key '{path}'" + (f" (did you mean '{near}'?)" if near else "")
                )
            continue
        tp = _FIELDS[path][1]
        if is_section(tp):
            if value is not None:
                out[key] = _check_keys(value, path + ".", tp, where, problems)
            continue
        if isinstance(value, dict) and typing.get_origin(tp) is not dict:
            problems.append(f"{where}: {path}: expected {describe_type(tp)}, got a mapping")
        out[key] = value
    return out


# ----------------------------------------------------------------------------------------------------
# Reading YAML and overrides
# ----------------------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and leaves dates as strings."""


_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _construct_mapping(loader: _Loader, node: yaml.MappingNode) -> dict:
    first_line = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in first_line:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key '{key}' (first at line {first_line[key]})", key_node.start_mark
            )
        first_line[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _read_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (_Loader is a SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        pos = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise ConfigError([f"{where}{pos}: YAML syntax error: {e.problem or e.context}"]) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"{where}: YAML error: {e}"]) from None


_KEY_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def parse_override(text: str) -> tuple[str, Any]:
    """'trainer.lr=3e-4' -> ('trainer.lr', '3e-4'); the value is read as YAML ('' stays an empty string)."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not _KEY_RE.match(key):
        raise ConfigError([f"override {text!r}: expected key=value with a dotted key, e.g. trainer.lr=1e-5"])
    return key, ("" if value.strip() == "" else _read_yaml(value, f"override {text!r}"))


def _nest(key: str, value: Any) -> dict:
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{'trainer': {'lr': 1}} -> {'trainer.lr': 1}, stopping at the schema's leaves (a dict-typed field)."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and (path not in _FIELDS or is_section(_FIELDS[path][1])):
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def find_recipe(recipe: str | Path) -> Path:
    """A recipe file, a run directory (its config.yaml), or the name of a shipped recipe ('demo_cpu')."""
    path = Path(recipe)
    if path.is_dir():
        if not (path / "config.yaml").is_file():
            raise ConfigError(
                [
                    f"{recipe}: a directory without config.yaml: not a run directory (expected a recipe file, a run "
                    "directory or a shipped recipe name)"
                ]
            )
        path = path / "config.yaml"
    if path.is_file():
        return path
    if path.parent == Path(".") and path.suffix in ("", ".yaml"):
        from rl.core.paths import shipped_dir

        try:
            shipped = shipped_dir("recipes") / f"{path.stem}.yaml"
        except FileNotFoundError:
            shipped = None
        if shipped is not None and shipped.is_file():
            return shipped
    raise ConfigError(
        [f"{recipe}: no such recipe file (nor a run directory with config.yaml, nor a shipped recipe)"]
    )


# ----------------------------------------------------------------------------------------------------
# Loading and saving
# ----------------------------------------------------------------------------------------------------


def load_config(recipe: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> SparkConfig:
    """The recipe over the schema's defaults, then each `key=value` override in order; resolved, validated."""
    path = find_recipe(recipe)
    where = str(path)
    tree = _read_yaml(path.read_text(), where)
    sources = [(where, {} if tree is None else tree)]
    sources += [(f"override {o!r}", _nest(*parse_override(o))) for o in overrides]

    problems: list[str] = []
    sources = [(src, _check_keys(t, "", SparkConfig, src, problems)) for src, t in sources]
    if problems:
        raise ConfigError(problems)

    origin = {}  # key path -> where its value was last set
    cfg = OmegaConf.structured(SparkConfig)
    for src, t in sources:
        try:
            cfg = OmegaConf.merge(cfg, t)
        except OmegaConfBaseException as e:
            raise ConfigError([f"{src}: {_type_problem(e, flatten(t))}"]) from None
        origin.update(dict.fromkeys(flatten(t), src))

    try:
        obj = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as e:
        raise ConfigError(
            [
                f"{where}: {e.full_key}: required value is missing (set it in the recipe or with "
                f"{e.full_key}=...)"
            ]
        ) from None
    except OmegaConfBaseException as e:  # a bad ${...} interpolation
        first_line = str(e.msg).splitlines()[0]
        raise ConfigError([f"{origin.get(e.full_key, where)}: {e.full_key}: {first_line}"]) from None

    problems = [f"{origin.get(key, where)}: {key}: {msg}" for key, msg in validate(obj)]
    if problems:
        raise ConfigError(problems)
    _absolute_code_paths(obj, origin, path)
    return obj


# Keys that may name code by import path: a relative file in them is relative to the recipe that sets it.
CODE_KEYS = (
    "reward.function",
    "reward.by_source",
    "algorithm.adv_estimator",
    "algorithm.policy_loss",
    "rollout.env",
)


def _absolute_code_paths(cfg: SparkConfig, origin: dict[str, str], recipe: Path) -> None:
    """Every `file.py:name` of CODE_KEYS made absolute: against the recipe's directory where the recipe set
    it, the working directory where an override did (rl.core.user_code)."""

    def base(key: str) -> Path:
        return recipe.parent if origin.get(key, str(recipe)) == str(recipe) else Path.cwd()

    def fix(key: str, value):
        if user_code.is_import_path(value) and user_code.problem(value) is None:
            return user_code.absolute_file(value, base(key))
        return value

    for key in CODE_KEYS:
        section, leaf = key.split(".")
        owner = getattr(cfg, section)
        value = getattr(owner, leaf)
        if isinstance(value, dict):  # reward.by_source: one a data source
            setattr(owner, leaf, {k: fix(key, v) for k, v in value.items()})
        else:
            setattr(owner, leaf, fix(key, value))


def code_values(cfg: SparkConfig) -> list[tuple[str, str]]:
    """(override key, value) of every CODE_KEYS setting; reward.by_source gives one a data source
    (`reward.by_source.<source>`)."""
    out = []
    for key in CODE_KEYS:
        section, leaf = key.split(".")
        value = getattr(getattr(cfg, section), leaf)
        items = value.items() if isinstance(value, dict) else [(None, value)]
        out += [(key if sub is None else f"{key}.{sub}", v) for sub, v in items]
    return out


def _type_problem(e: OmegaConfBaseException, given: dict[str, Any]) -> str:
    """OmegaConf's complaint about a value, restated with the schema's type: 'x.y: expected a number'."""
    key = e.full_key or ""
    base = re.sub(r"\[\d+\]$", "", key)  # an item of a list field
    if base not in _FIELDS:
        return f"{key or '<top level>'}: {str(e.msg).splitlines()[0]}"
    value = getattr(e, "value", None) if base != key else given.get(base, getattr(e, "value", None))
    return f"{key}: expected {describe_type(_FIELDS[base][1])}, got {_show(value)}"


def save_config(cfg: SparkConfig, path: str | Path) -> Path:
    """Write the fully resolved config as YAML, atomically (a temporary file renamed over `path`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "# Resolved sparkrl config: load_config() of this file gives the same config back.\n"
    text += OmegaConf.to_yaml(OmegaConf.structured(cfg), resolve=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# ----------------------------------------------------------------------------------------------------
# Validation beyond types
# ----------------------------------------------------------------------------------------------------


def _field_problems(obj: Any, prefix: str = ""):
    """Choices and bounds declared on the fields, recursively."""
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _field_problems(value, key + ".")
        elif getattr(f.metadata.get("choices"), "import_paths", False) and user_code.is_import_path(value):
            wrong = user_code.problem(value)
            if wrong:
                yield key, wrong
        elif f.metadata.get("choices") and value not in (choices := tuple(f.metadata["choices"])):
            names = ", ".join(repr(c) for c in choices)
            if getattr(f.metadata["choices"], "import_paths", False):
                names += ", or an import path (`file.py:name`, `module:name`)"
            near = difflib.get_close_matches(str(value), [c for c in choices if c], n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            yield key, f"expected one of {names}, got {value!r}{hint}"
        elif isinstance(value, int | float) and not _in_bounds(value, f.metadata["bounds"]):
            yield key, f"must be {describe_bounds(f.metadata['bounds'])}, got {value}"


def _reward_problems(rw: RewardConfig) -> list[tuple[str, str]]:
    """The form of `reward.function` and `reward.by_source` (the functions themselves are the preflight's),
    and the keys that only mean something with a function of your own."""
    from rl.reward import BACKENDS

    out = []
    if rw.function:
        if not user_code.is_import_path(rw.function):
            hint = (
                f" (a built-in checker goes in reward.backend={rw.function})"
                if rw.function in BACKENDS
                else ""
            )
            out.append(
                (
                    "reward.function",
                    f"expected `path/to/file.py:name` or `module:name`, got {rw.function!r}{hint}",
                )
            )
        elif wrong := user_code.problem(rw.function):
            out.append(("reward.function", wrong))
    if user_code.is_import_path(rw.backend):
        out.append(("reward.backend", f"a function of your own goes in reward.function={rw.backend}"))
    for source, checker in rw.by_source.items():
        key = f"reward.by_source.{source}"
        if not isinstance(checker, str) or not (checker in BACKENDS or user_code.is_import_path(checker)):
            names = ", ".join(repr(b) for b in BACKENDS)
            out.append((key, f"expected one of {names} or an import path (`file.py:name`), got {checker!r}"))
        elif user_code.is_import_path(checker) and (wrong := user_code.problem(checker)):
            out.append((key, wrong))
    own = [c for c in reward_checkers(rw).values() if user_code.is_import_path(c)]
    if not own and rw.kwargs:
        out.append(
            (
                "reward.kwargs",
                "passed to functions of your own, but reward.function and reward.by_source name none",
            )
        )
    if not own and rw.batched:
        out.append(
            (
                "reward.batched",
                "applies to functions of your own, but reward.function and reward.by_source name none",
            )
        )
    return out


def validate(cfg: SparkConfig) -> list[tuple[str, str]]:
    """What types cannot express: choices, bounds and agreement between keys.
    Returns (key path, problem) pairs; empty when the config is fine."""
    out = list(_field_problems(cfg))

    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            out.append((key, msg))

    ro, tr, lo, al = cfg.rollout, cfg.trainer, cfg.lora, cfg.algorithm
    da, ev, res = cfg.data, cfg.eval, cfg.resources
    rc = al.rollout_correction
    need(bool(cfg.run.name.strip()), "run.name", "must not be empty")
    out += _reward_problems(cfg.reward)
    need(
        cfg.r3.enabled or not cfg.r3.measure_live_kl,
        "r3.measure_live_kl",
        "compares replayed with live routing: needs r3.enabled=true",
    )
    need(
        bool(cfg.model.path) or bool(cfg.model.make_tiny.arch),
        "model.path",
        "required value is missing "
        "(a Hugging Face id or checkpoint directory), unless model.make_tiny.arch is set",
    )
    tiny = cfg.model.make_tiny.arch
    for key in ("path", "rollout_path"):
        need(
            not (tiny and getattr(cfg.model, key)),
            f"model.{key}",
            f"model.make_tiny.arch={tiny} builds the policy, so model.{key} would be ignored; set "
            f"model.make_tiny.arch= (empty) to train model.{key}, or drop model.{key}",
        )
    need(
        ro.n != 1, "rollout.n", f"{al.adv_estimator} compares samples within a group: need at least 2, got 1"
    )
    need(
        len(tr.betas) == 2 and all(0 <= b < 1 for b in tr.betas),
        "trainer.betas",
        f"must be two numbers in [0, 1), got {tr.betas}",
    )
    # the schedule counts optimizer steps: trainer.total_steps batches of steps_per_batch each
    from trainer.minibatch import steps_per_batch

    per_batch = steps_per_batch(da.train_batch_size, tr.mini_batch_size, tr.ppo_epochs)
    optimizer_steps = tr.total_steps * per_batch
    need(
        tr.warmup_steps == 0 or tr.warmup_steps < optimizer_steps,
        "trainer.warmup_steps",
        f"counts optimizer steps: must be less than the run's {optimizer_steps} (trainer.total_steps "
        f"{tr.total_steps} x {per_batch} a batch), got {tr.warmup_steps}",
    )
    need(
        not 0 < lo.dropout < 1 or not lo.target_experts,  # out of [0, 1): the bound says so
        "lora.dropout",
        f"must be 0 with lora.target_experts=true (PEFT applies no dropout to expert parameters), got "
        f"{lo.dropout}; set lora.target_experts=false to use dropout",
    )
    need(
        tr.mini_batch_size == 0 or da.train_batch_size % tr.mini_batch_size == 0,
        "trainer.mini_batch_size",
        f"must divide data.train_batch_size ({da.train_batch_size}), got {tr.mini_batch_size}",
    )
    need(
        tr.micro_batch_tokens > 0 or tr.micro_batch_size > 0,
        "trainer.micro_batch_tokens",
        "trainer.micro_batch_tokens or trainer.micro_batch_size must be positive",
    )
    longest = ro.max_prompt_len + ro.max_response_len
    need(
        tr.micro_batch_tokens == 0 or tr.micro_batch_tokens >= longest,
        "trainer.micro_batch_tokens",
        f"must hold one whole sequence (rollout.max_prompt_len + rollout.max_response_len = {longest}), "
        f"got {tr.micro_batch_tokens}",
    )
    context = ro.max_prompt_len + max(ro.max_response_len, ev.max_response_len)
    need(
        ro.max_model_len == 0 or ro.max_model_len >= context,
        "rollout.max_model_len",
        f"must be 0 or at least rollout.max_prompt_len + the longer of rollout.max_response_len and "
        f"eval.max_response_len = {context}, got {ro.max_model_len}",
    )
    need(
        ro.max_total_tokens <= longest,
        "rollout.max_total_tokens",
        f"must be at most rollout.max_prompt_len + rollout.max_response_len = {longest} (the trainer's "
        f"sequence bound), got {ro.max_total_tokens}",
    )
    need(
        not ro.env or (user_code.is_import_path(ro.env) and user_code.problem(ro.env) is None),
        "rollout.env",
        f"expected `path/to/file.py:Name` or `module:Name`, got {ro.env!r}"
        + (f": {user_code.problem(ro.env)}" if user_code.is_import_path(ro.env) else ""),
    )
    need(
        al.overlong.buffer_len == 0 or al.overlong.buffer_len < ro.max_response_len,
        "algorithm.overlong.buffer_len",
        f"must be less than rollout.max_response_len ({ro.max_response_len}), got {al.overlong.buffer_len}",
    )
    need(
        rc.tis_cap == 0 or rc.tis_cap >= 1,
        "algorithm.rollout_correction.tis_cap",
        f"must be 0 (off) or at least 1, got {rc.tis_cap}",
    )
    need(
        rc.mis_high == 0 or rc.mis_high > max(rc.mis_low, 1.0),
        "algorithm.rollout_correction.mis_high",
        f"must be 0 (off) or above 1, got {rc.mis_high}",
    )
    caps_set = [
        f"algorithm.rollout_correction.{k}={getattr(rc, k):g}" for k in RolloutCaps._fields if getattr(rc, k)
    ]
    need(
        rc.mode != "none" or not caps_set,
        "algorithm.rollout_correction.mode",
        f"none applies no correction, yet a cap asks for one: {', '.join(caps_set)} (set the caps to 0, "
        "or mode=auto)",
    )
    has_target = bool(lo.target_modules) or lo.target_experts or lo.target_latent or bool(lo.extra)
    need(
        has_target,
        "lora.target_modules",
        "the adapter has no targets: set lora.target_modules, target_experts, target_latent or extra",
    )
    if lo.extra:
        try:
            re.compile(lo.extra)
        except re.error as e:
            out.append(("lora.extra", f"not a valid regular expression: {e}"))
    need(
        bool(da.arith.ops) and not set(da.arith.ops) - set("+-*"),
        "data.arith.ops",
        f"must be a non-empty string over '+', '-', '*', got {da.arith.ops!r}",
    )
    ep = tr.expert_parallel_size
    need(
        tr.num_ranks % ep == 0,
        "trainer.expert_parallel_size",
        f"must divide trainer.num_ranks ({tr.num_ranks}), got {ep}",
    )
    # Trainer rank r sits on node r // gpus_per_node (rl/placement.py packs the bundles node by node), and an
    # EP group is `ep` consecutive ranks: its all-to-all stays within a node only if gpus_per_node splits
    # into whole groups.
    need(
        res.num_gpus == 0 or tr.num_ranks <= res.gpus_per_node or res.gpus_per_node % ep == 0,
        "trainer.expert_parallel_size",
        f"{ep} consecutive trainer ranks would span nodes of resources.gpus_per_node={res.gpus_per_node} "
        f"(trainer.num_ranks={tr.num_ranks}); an expert-parallel group must lie within one node: use a "
        "divisor of resources.gpus_per_node",
    )
    need(
        res.num_gpus <= res.nodes * res.gpus_per_node,
        "resources.num_gpus",
        f"must be at most resources.nodes x resources.gpus_per_node = {res.nodes * res.gpus_per_node}, "
        f"got {res.num_gpus}",
    )
    if res.num_gpus > 0:
        rollout_gpus = ro.num_workers * ro.tensor_parallel_size
        need(
            tr.num_ranks <= res.num_gpus,
            "trainer.num_ranks",
            f"must be at most resources.num_gpus ({res.num_gpus}), got {tr.num_ranks}",
        )
        need(
            rollout_gpus <= res.num_gpus,
            "rollout.num_workers",
            f"rollout.num_workers x rollout.tensor_parallel_size = {rollout_gpus} GPUs, more than "
            f"resources.num_gpus ({res.num_gpus})",
        )
        need(
            ro.placement == "split" or ro.max_staleness == 0,
            "rollout.max_staleness",
            f"{ro.max_staleness} needs rollout.placement=split: colocated engines sleep while the trainer "
            "updates on the same GPUs, so the next batch cannot be generated meanwhile",
        )
        need(
            ro.placement != "split" or rollout_gpus + tr.num_ranks <= res.num_gpus,
            "rollout.placement",
            f"split placement needs {rollout_gpus} rollout + {tr.num_ranks} trainer GPUs, more than "
            f"resources.num_gpus ({res.num_gpus})",
        )
    return out
