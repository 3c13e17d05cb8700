"""`sparkrl eval RECIPE|RUN_DIR [key=value ...] [--adapter DIR]`: mean@k / maj@k / best@k on the rollout workers.

What is evaluated: the recipe's model, plus an adapter when one is given; for a run directory, its config
and the adapter of its newest checkpoint (unless `--adapter` names another). Engines with a MoE-LoRA
kernel load the adapter as such; in merged sync mode (vLLM on CPU) it is merged into the base weights
with PEFT here and the merged weights are pushed instead. Per-sample records go to
`<run dir>/eval/eval_<tag>.jsonl` and the metrics are printed and returned. The rollout workers' own output
(vLLM's engine lines) goes to `<run dir>/logs/`, as in `sparkrl train`, when this call starts Ray.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rl.checkpoint import latest_checkpoint
from rl.config import SparkConfig, run_dir
from rl.core.adapter_files import read_peft_dir


def resolve_target(recipe: str, overrides: list[str], adapter: str | None) -> tuple[SparkConfig, Path | None]:
    """The config and the adapter to evaluate. A run directory is the run wherever it now lies: its records
    go to its own `eval/`, and its newest good checkpoint gives the adapter."""
    from rl.target import absolute_run_dir, load_target

    cfg = load_target(recipe, overrides)
    absolute_run_dir(cfg)
    if adapter is None and Path(recipe).is_dir() and (Path(recipe) / "config.yaml").exists():
        ckpt = latest_checkpoint(Path(recipe))
        if ckpt is None:
            raise FileNotFoundError(f"eval: run directory {recipe} has no checkpoint yet; pass --adapter DIR")
        return cfg, ckpt / "trainer"
    if adapter is not None and not (Path(adapter) / "adapter_config.json").exists():
        raise FileNotFoundError(
            f"eval: --adapter {adapter} has no adapter_config.json (a PEFT adapter directory)"
        )
    return cfg, Path(adapter) if adapter else None


def merged_weights(model_path: str, adapter: Path, dtype: str) -> dict:
    """Base + adapter merged by PEFT, under checkpoint names (what RolloutWorker.load_merged_weights takes)."""
    import torch
    from peft import PeftModel

    from rollout.adapter_layout import merged_to_checkpoint
    from trainer.checkpoint_io import load_base_model

    model = PeftModel.from_pretrained(load_base_model(model_path, getattr(torch, dtype)), str(adapter))
    return merged_to_checkpoint(model.merge_and_unload().state_dict())


def run_eval(cfg: SparkConfig, adapter: Path | None, tag: str = "manual") -> dict:
    import ray
    from transformers import AutoTokenizer

    from rl.evaluation import eval_metrics, records_from_samples, write_records
    from rl.reward import RewardRow, score_episodes
    from rl.setup import (
        build_reward,
        engine_spec,
        init_ray,
        load_prompts_for,
        prompt_requests,
        resolve_model_paths,
        sampling_spec,
        waiting_for_resources,
    )
    from rollout.pool import RolloutPool

    if not cfg.eval.data:
        raise ValueError("eval.data: empty; name an eval prompt source (e.g. BytedTsinghua-SIA/AIME-2024)")
    model_path, rollout_path = resolve_model_paths(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    prompts = load_prompts_for(cfg, cfg.eval.data, tokenizer, "test", cfg.data.arith.eval_rows)
    # The run directory the records go to holds the workers' logs too: the terminal keeps only the results.
    owns_ray = init_ray(cfg, run_dir(cfg) / "logs")
    with waiting_for_resources(cfg, "the rollout engines"):
        pool = RolloutPool(
            engine_spec(cfg, rollout_path),
            cfg.rollout.num_workers,
            stage=f"{cfg.run.name}-eval",
        )
    try:
        if adapter is not None:
            if cfg.sync.mode == "adapter":
                # read here and sent as tensors: a rollout worker on another node may not see this path
                tensors, config = read_peft_dir(adapter)
                pool.load_adapter(tensors, config, 1)
            else:
                pool.load_merged_weights(merged_weights(model_path, adapter, cfg.model.dtype), 1)
        samples = pool.generate(
            prompt_requests(prompts, rows=bool(cfg.rollout.env)),
            sampling_spec(cfg, cfg.rollout.seed, eval=True),
        )
        responses = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        rows = [RewardRow.of_prompt(prompts[s.group]) for s in samples]
        with build_reward(cfg, run_dir(cfg) / "logs") as reward:
            scored = score_episodes(reward, samples, responses, rows)
        if scored.errors:
            print(
                f"eval: {scored.errors} of {len(samples)} responses failed to score (first: "
                f"{scored.messages[0]}); the traceback and row are in {run_dir(cfg) / 'logs' / 'reward.log'}"
            )
        if scored.errors > cfg.reward.max_error_fraction * len(samples):
            raise ValueError(
                f"eval: more than reward.max_error_fraction={cfg.reward.max_error_fraction:g} of the responses "
                "failed to score; no metrics written"
            )
        records = records_from_samples(samples, responses)
        path = write_records(unused_path(run_dir(cfg) / "eval" / f"eval_{tag}.jsonl"), records)
        metrics = eval_metrics(records, k=cfg.eval.k)
    finally:
        pool.shutdown()
        if owns_ray:
            ray.shutdown()
    return {"metrics": metrics, "records": str(path)}


def unused_path(path: Path) -> Path:
    """`path`, or where it exists `NAME.2.jsonl`, `NAME.3.jsonl`, ...: an earlier evaluation's records (of
    other eval.* settings, say) are never replaced."""
    n = 1
    candidate = path
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}.{n}{path.suffix}")
    return candidate


def register(sub) -> None:
    p = sub.add_parser(
        "eval", help="mean@k, maj@k and best@k of a model (and adapter) on the rollout workers"
    )
    p.add_argument(
        "recipe", help="recipe YAML, shipped recipe name, or a run directory (its newest checkpoint)"
    )
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. eval.k=16")
    p.add_argument("--adapter", default=None, help="PEFT adapter directory to evaluate on top of the model")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from rl.preflight import preflight

    cfg, adapter = resolve_target(args.recipe, args.overrides, args.adapter)
    preflight(cfg, adapter, train=False, evaluate=True)
    tag = (
        adapter.parent.name
        if adapter is not None and adapter.name == "trainer"
        else "base"
        if adapter is None
        else adapter.name
    )
    out = run_eval(cfg, adapter, tag)
    for key, value in out["metrics"].items():
        print(f"{key} {value:.4f}")
    print(f"eval: records at {out['records']}  (workers' logs in {run_dir(cfg) / 'logs'})")
    return 0
