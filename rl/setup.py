"""Build what a run needs from its config: model paths, tokenizer, prompts, Ray, workers, reward pool.

The only place that turns the config tree into the small specs the workers take
(`rollout.spec.EngineSpec`, `trainer.spec.TrainerSpec`); rollout/ and trainer/ never see the config.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl.config import ConfigError, SparkConfig
from rl.data.loader import Prompt, tokenize_prompts
from rl.placement import create_placement, placement_group_name, trainer_group_name


@dataclass
class Components:
    tokenizer: Any
    train_prompts: list[Prompt]
    eval_prompts: list[Prompt]
    rollout: Any  # rollout.pool.RolloutPool
    trainer: Any  # trainer.group.TrainerGroup
    reward: Any  # rl.reward.RewardPool
    trainer_spec: Any  # trainer.spec.TrainerSpec
    owns_ray: bool  # this run started (or joined) Ray and shuts it down at the end
    model_path: str
    rollout_path: str


def resolve_model_paths(cfg: SparkConfig) -> tuple[str, str]:
    """(trainer weights, rollout weights); `model.make_tiny` builds (or takes from cache) a tiny model."""
    tiny = cfg.model.make_tiny
    if tiny.arch:
        from rl.tiny import make_tiny

        path = make_tiny(tiny.arch, seed=tiny.seed, sft=tiny.sft or None)
        if tiny.quantize:
            from rl.quantize import quantized_copy

            path = quantized_copy(path, tiny.quantize)
        return str(path), str(path)
    return _for_workers(cfg.model.path), _for_workers(cfg.model.rollout_path or cfg.model.path)


def _for_workers(path: str) -> str:
    """A local checkpoint directory made absolute (workers on other nodes run in their raylet's working
    directory, not the driver's); a hub id as it is."""
    return str(Path(path).absolute()) if path and Path(path).exists() else path


def load_prompts_for(cfg: SparkConfig, spec: str, tokenizer, split: str, rows: int) -> list[Prompt]:
    """Tokenized prompts of a source spec; `synthetic:arith` takes its knobs from `data.arith` unless the
    spec's own query sets them."""
    from rl.data.sources import load_source, parse_spec

    location, query = parse_spec(spec)
    options: dict[str, Any] = {}
    if location == "synthetic:arith":
        a = cfg.data.arith
        defaults = {
            "n": rows,
            "seed": cfg.data.seed,
            "split": split,
            "num_terms": a.num_terms,
            "max_operand": a.max_operand,
            "ops": a.ops,
        }
        options = {k: v for k, v in defaults.items() if k not in query}
    source = load_source(
        spec, text_answers=reward_spec(cfg).needs_text, prompt_key=cfg.data.prompt_key, **options
    )
    prompts, dropped = tokenize_prompts(
        source.dataset,
        tokenizer,
        cfg.rollout.max_prompt_len,
        dict(cfg.data.chat_template_kwargs),
        env_tools(cfg),
    )
    note = f", {source.num_duplicates} duplicates dropped" if source.num_duplicates else ""
    note += f", {dropped} over rollout.max_prompt_len dropped" if dropped else ""
    print(f"data: {len(prompts)} prompts from {spec}{note}")
    return prompts


def env_tools(cfg: SparkConfig) -> list[dict] | None:
    """The tool schemas of `rollout.env`'s class (its `tools` attribute), which the chat template renders
    into every prompt; None without an environment or without tools."""
    if not cfg.rollout.env:
        return None
    from rl.core import user_code
    from rl.data.loader import tool_schemas

    env_cls = user_code.resolve("rollout.env", cfg.rollout.env)
    return tool_schemas(getattr(env_cls, "tools", None), f"rollout.env {cfg.rollout.env}")


def init_ray(cfg: SparkConfig, log_dir: Path | None = None) -> bool:
    """Join the cluster `resources.ray_address` (else `$RAY_ADDRESS`) names, or start a local instance of
    this run's own, never a cluster that happens to run on the machine; True when this call started or
    joined Ray, so the run should shut it down. A joined cluster is checked for the CPU slots, GPUs and
    nodes the run needs (rl.preflight).

    log_dir: where the workers write their own output (rl/core/worker_logs.py); the terminal then shows only the
    driver's progress. None keeps Ray's default of streaming every worker's lines to the driver."""
    import ray

    from rl.core.worker_logs import LOG_DIR_ENV
    from rl.preflight import check_cluster, cluster_info

    if ray.is_initialized():
        return False
    logs = {}
    if log_dir is not None:
        logs = {
            "log_to_driver": False,
            "logging_level": logging.WARNING,  # Ray's own start-up lines; its warnings still show
            "runtime_env": {"env_vars": {LOG_DIR_ENV: str(log_dir.resolve())}},
        }
    address = cfg.resources.ray_address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, **logs)
        info = cluster_info(ray)
        print(
            f"ray: joined the cluster at {info.address} ({address}): {info.cpus:g} CPU slots, "
            f"{info.gpus:g} GPUs, {info.nodes} node(s)",
            flush=True,
        )
        try:
            check_cluster(cfg, info)
        except ValueError:
            ray.shutdown()
            raise
        return True
    # A local instance: enough CPU slots for every worker even on a 2-core machine (they mostly wait on
    # each other); the dashboard stays off. address="local" starts a new one even where another cluster
    # runs (or left a stale /tmp/ray/ray_current_cluster), which a bare ray.init() would try to join.
    need = cfg.trainer.num_ranks + cfg.rollout.num_workers + 1
    num_cpus = max(os.cpu_count() or 1, need)
    ray.init(
        address="local",
        num_cpus=num_cpus,
        num_gpus=cfg.resources.num_gpus or None,
        include_dashboard=False,
        **({"log_to_driver": True} | logs),
    )
    print(
        f"ray: started a local instance for this run ({num_cpus} CPU slots, "
        f"{cfg.resources.num_gpus} GPUs); set resources.ray_address or RAY_ADDRESS to join a cluster",
        flush=True,
    )
    return True


def waiting_for_resources(cfg: SparkConfig, what: str, placement_group_name: str | None = None, out=None):
    """The block that creates workers, reporting what is pending (rl.core.resource_wait) every
    `resources.wait_report_s` and giving up after `resources.wait_timeout_s`."""
    from functools import partial

    from rl.core.resource_wait import pending_summary, report_pending

    r = cfg.resources
    summary = partial(pending_summary, placement_group_name)
    return report_pending(r.wait_report_s, r.wait_timeout_s, out=out, what=what, summary=summary)


def prompt_requests(prompts: list[Prompt], offset: int = 0, rows: bool = False) -> list:
    """One rollout request per prompt; its index (plus `offset`) is the group id of its samples. `rows`: each
    request carries its dataset row (`PromptRequest.row`, what a multi-turn environment is built from)."""
    from rollout.spec import PromptRequest

    return [
        PromptRequest(
            p.prompt_ids, offset + i, p.data_source, p.ground_truth_text, env_row(p) if rows else None
        )
        for i, p in enumerate(prompts)
    ]


def env_row(p: Prompt) -> dict:
    """The row a multi-turn environment (`rollout.env`) is built from."""
    return {
        "data_source": p.data_source,
        "ground_truth": p.ground_truth,
        "extra_info": p.extra_info,
        "index": p.index,
    }


def reward_spec(cfg: SparkConfig):
    """The run's scoring (`rl.reward.RewardSpec`) from the `reward:` section."""
    from rl.reward import RewardSpec

    return RewardSpec.of_config(cfg.reward)


def build_reward(cfg: SparkConfig, log_dir: Path):
    """The reward pool (`rl.reward.RewardPool`); the first traceback of each checker goes to
    `<log_dir>/reward.log`."""
    from rl.reward import RewardPool

    return RewardPool(
        cfg.reward.num_workers, cfg.reward.timeout_s, reward_spec(cfg), log_path=log_dir / "reward.log"
    )


def sampling_spec(cfg: SparkConfig, seed: int, eval: bool = False):
    """The training (`rollout.*`) or evaluation (`eval.*`) sampling settings, seeded with `seed`."""
    from rollout.spec import SamplingSpec

    if eval:
        return SamplingSpec(
            n=cfg.eval.k,
            temperature=max(cfg.eval.temperature, 1e-5),
            top_p=cfg.eval.top_p,
            max_tokens=cfg.eval.max_response_len,
            seed=seed,
            seed_scope=cfg.rollout.seed_scope,
        )
    return SamplingSpec(
        n=cfg.rollout.n,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_tokens=cfg.rollout.max_response_len,
        seed=seed,
        seed_scope=cfg.rollout.seed_scope,
    )


def base_format(setting: str, model_path: str) -> str:
    """trainer.base_format resolved against the checkpoint at model_path ("auto": nvfp4 for an NVFP4
    compressed-tensors checkpoint, else bf16); nvfp4 on any other checkpoint is an error."""
    from trainer.nvfp4 import FORMAT, is_nvfp4_checkpoint

    packed = os.path.isdir(model_path) and is_nvfp4_checkpoint(model_path)
    if setting == "auto":
        return "nvfp4" if packed else "bf16"
    if setting == "nvfp4" and not packed:
        raise ConfigError(
            [
                f"trainer.base_format=nvfp4: model.path {model_path!r} is not a compressed-tensors "
                f"{FORMAT!r} checkpoint directory (set trainer.base_format=bf16 or auto)"
            ]
        )
    return setting


def trainer_spec(cfg: SparkConfig, model_path: str):
    """The trainer workers' spec: the `trainer:` and `lora:` sections as they are, the loss's knobs resolved
    from `algorithm:` once, and what this run resolved (the weights, the base format, the sequence bound,
    the schedule's optimizer steps)."""
    from rl.config import rollout_correction_caps
    from rl.core.algo import AlgoConfig
    from trainer.minibatch import steps_per_batch
    from trainer.spec import TrainerSpec

    a, t = cfg.algorithm, cfg.trainer
    rc = rollout_correction_caps(cfg)  # algorithm.rollout_correction at rollout.max_staleness
    algo_cfg = AlgoConfig(
        adv_estimator=a.adv_estimator,
        loss_mode=a.policy_loss,  # an import path (its file absolute since load_config): each rank resolves it
        clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
        loss_agg_mode=a.loss_agg_mode,
        loss_scale_factor=float(cfg.rollout.max_response_len),
        kl_coef=a.kl_coef,
        entropy_coeff=a.entropy_coeff,
        tis_cap=rc.tis_cap or None,
        # Either bound alone masks on its side only (0 = off: the other end stays open).
        mis_token_bounds=(rc.mis_low, rc.mis_high or math.inf) if rc.mis_low or rc.mis_high else None,
    )
    return TrainerSpec(
        model_path=model_path,
        trainer=copy.deepcopy(t),
        lora=copy.deepcopy(cfg.lora),
        algo=algo_cfg,
        dtype=cfg.model.dtype,
        head_dtype=cfg.model.head_dtype,
        base_format=base_format(t.base_format, model_path),
        max_seq_len=cfg.rollout.max_prompt_len + cfg.rollout.max_response_len,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        trust_remote_code=cfg.model.trust_remote_code,
        # A batch of data.train_batch_size prompts makes this many optimizer steps (dynamic sampling may
        # keep more or fewer groups; the schedule assumes the full batch).
        optimizer_steps=t.total_steps
        * steps_per_batch(cfg.data.train_batch_size, t.mini_batch_size, t.ppo_epochs),
        r3=cfg.r3.enabled,
        r3_live_kl=cfg.r3.measure_live_kl,
        keep_versions=cfg.rollout.max_staleness,
        seed=cfg.run.seed,
    )


def engine_spec(cfg: SparkConfig, model_path: str):
    """The rollout engines' spec (`rollout.spec.EngineSpec`): the `rollout:` section as it is, and what the run
    resolves around it; `model_path` is the resolved rollout weights.

    Sleep mode follows placement (colocated shares GPUs with the trainer) and only applies with GPUs; with
    it the KV cache is what is left of gpu_memory_utilization x the GPU beside what `sparkrl plan` counts
    (weights, LoRA slot, activations, runtime), since vLLM's own profile misjudges it under sleep mode
    (EngineSpec.non_kv_bytes).
    LoRA is on in adapter sync mode, off in merged mode (the merged weights carry the update).
    """
    from rollout.spec import EngineSpec

    ro = cfg.rollout
    max_len = ro.max_model_len or ro.max_prompt_len + max(ro.max_response_len, cfg.eval.max_response_len)
    on_gpu = cfg.resources.num_gpus > 0
    sleep = on_gpu and ro.placement == "colocated"
    non_kv_bytes = 0
    if sleep:
        from rl.plan import colocated_engine_plan

        p = colocated_engine_plan(cfg)
        if p is not None:
            non_kv_bytes = int(p.r_beside_kv)
        elif "kv_cache_memory_bytes" not in ro.engine_args:
            logging.getLogger(__name__).warning(
                "rollout: the planner cannot size this engine's memory (`sparkrl plan` says why), so vLLM's "
                "profile sizes the KV cache, which misjudges it in sleep mode; "
                "rollout.engine_args.kv_cache_memory_bytes sets it"
            )
    own_head = (ro.engine_args.get("hf_overrides") or {}).get("head_dtype")
    if own_head is not None and str(own_head) != cfg.model.head_dtype:
        logging.getLogger(__name__).warning(
            "rollout.engine_args.hf_overrides.head_dtype %s over model.head_dtype %s: the engine's logits and "
            "the trainer's are computed differently, which raises the k3 between them",
            own_head,
            cfg.model.head_dtype,
        )
    return EngineSpec(
        model_path=model_path,
        rollout=copy.deepcopy(ro),
        dtype=cfg.model.dtype,
        head_dtype=cfg.model.head_dtype,
        max_model_len=max_len,
        seed=ro.seed,
        enable_lora=cfg.sync.mode == "adapter",
        max_lora_rank=cfg.lora.rank,
        lora_experts_stacked=cfg.sync.expert_layout == "stacked",
        return_routed_experts=cfg.r3.enabled,
        routing_by_reference=cfg.r3.enabled,
        enable_sleep_mode=sleep,
        non_kv_bytes=non_kv_bytes,
        gpu_bytes=int(cfg.resources.gpu_memory_gib * 2**30) if sleep else 0,
        trust_remote_code=cfg.model.trust_remote_code,
        chat_template_kwargs=dict(cfg.data.chat_template_kwargs),
    )


def build_rollout(cfg: SparkConfig, place, rollout_path: str, wait: bool = True):
    """The rollout pool (`rollout.pool.RolloutPool`) of the config, on `place` (rl.placement); `wait=False`
    returns once its workers are asked for (`RolloutPool.wait_ready` waits for them)."""
    from rollout.pool import RolloutPool

    return RolloutPool(
        engine_spec(cfg, rollout_path),
        cfg.rollout.num_workers,
        stage=cfg.run.name,  # each worker's directory of that name on its own node (rollout.staging)
        placement_group=place.placement_group,
        bundle_indices=place.rollout_bundles,
        actor_options=place.rollout_options,
        gpus_per_rank=place.rollout_gpus_per_rank,
        wait=wait,
    )


def build_trainer(cfg: SparkConfig, place, spec, wait: bool = True):
    """The trainer group (`trainer.group.TrainerGroup`) of `spec` (`trainer_spec`), on `place` (rl.placement);
    `wait=False` as in `build_rollout`."""
    from trainer.group import TrainerGroup

    return TrainerGroup(
        spec,
        cfg.trainer.num_ranks,
        use_gpu=cfg.resources.num_gpus > 0,
        placement_group=place.placement_group,
        bundle_offset=place.trainer_bundle_offset,
        num_gpus_per_rank=place.trainer_gpus_per_rank,
        wait=wait,
        placement_group_name=trainer_group_name(cfg),  # the group it reserves when `place` has none
    )


def workers_start_together(cfg: SparkConfig) -> bool:
    """Whether the rollout engines and the trainer ranks start at once, their imports and model loads
    overlapping: with no GPU they share (CPU, or split placement). Colocated on GPUs the engines start
    first: vLLM sizes its KV cache from the memory it sees free while it profiles, which trainer ranks
    loading onto the same GPUs would change under it."""
    return cfg.resources.num_gpus == 0 or cfg.rollout.placement == "split"


def build_components(cfg: SparkConfig, run_dir: Path) -> Components:
    from transformers import AutoTokenizer

    owns_ray = init_ray(cfg, run_dir / "logs")
    with waiting_for_resources(cfg, "the placement group", placement_group_name(cfg)):
        place = create_placement(cfg)  # a bad GPU layout fails here, before any data is read
    model_path, rollout_path = resolve_model_paths(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    train_prompts = load_prompts_for(cfg, cfg.data.train, tokenizer, "train", cfg.data.arith.train_rows)
    eval_prompts = (  # eval.every = 0: no evaluation at all, so no eval data either
        load_prompts_for(cfg, cfg.eval.data, tokenizer, "test", cfg.data.arith.eval_rows)
        if cfg.eval.data and cfg.eval.every > 0
        else []
    )
    spec = trainer_spec(cfg, model_path)
    if workers_start_together(cfg):
        with waiting_for_resources(cfg, "the rollout engines and the trainer ranks", trainer_group_name(cfg)):
            rollout = build_rollout(cfg, place, rollout_path, wait=False)
            trainer = build_trainer(cfg, place, spec, wait=False)
            rollout.wait_ready()
            trainer.wait_ready()
    else:
        with waiting_for_resources(cfg, "the rollout engines"):
            rollout = build_rollout(cfg, place, rollout_path)
        with waiting_for_resources(cfg, "the trainer ranks", trainer_group_name(cfg)):
            trainer = build_trainer(cfg, place, spec)
    reward = build_reward(cfg, run_dir / "logs")
    return Components(
        tokenizer,
        train_prompts,
        eval_prompts,
        rollout,
        trainer,
        reward,
        spec,
        owns_ray,
        model_path,
        rollout_path,
    )
