"""Checks that run before Ray starts: the mistakes a run would otherwise report minutes later, from a worker.

    preflight(cfg)                          # local paths, the model's config.json vs. LoRA and R3, data files
    check_cluster(cfg, cluster_info(ray))   # after joining a cluster: CPU slots, GPUs and nodes

Each problem is one line that names the config key (or the file) and what to change; `PreflightError`
carries them all, and the CLI prints them without a traceback. Everything here reads local files only
(hub ids are looked up in the local Hugging Face cache, never over the network), so it takes well under a
second for the shipped recipes.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl.config import SparkConfig

# config.json keys whose presence (non-zero) marks a mixture-of-experts model, with or without text_config.
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# `make_tiny` architectures that are MoE (the rest are dense).
_TINY_MOE = {"dense": False, "qwen3_moe": True, "muse": True}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


class PreflightError(ValueError):
    """One line per problem, each naming the key or file."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


# ----------------------------------------------------------------------------------------------------
# Paths and the model's config.json
# ----------------------------------------------------------------------------------------------------


def _looks_local(value: str) -> bool:
    """A value that can only be a path (absolute, ./, ../, ~, or more than one '/'), not a hub id."""
    return value.startswith(("/", "./", "../", "~")) or value.count("/") > 1


def model_config(key: str, value: str, problems: list[str]) -> dict | None:
    """config.json of the model `value` names (a directory, or a hub id found in the local cache)."""
    path = Path(value).expanduser()
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            problems.append(
                f"{key}: {path} has no config.json (expected a Hugging Face checkpoint directory)"
            )
            return None
        if not any(f.suffix in _WEIGHT_SUFFIXES for f in path.iterdir()):
            problems.append(f"{key}: {path} holds no weight files (*.safetensors or *.bin)")
    elif path.exists():
        problems.append(f"{key}: {path} is a file; expected a checkpoint directory or a hub id (owner/name)")
        return None
    elif _looks_local(value):
        problems.append(f"{key}: {value}: no such directory (nor a Hugging Face hub id owner/name)")
        return None
    else:
        cfg_file = _hub_cached_file(value, "config.json")
        if cfg_file is None:
            if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
                problems.append(
                    f"{key}: {value} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
                )
            return None  # downloaded by the workers
    try:
        return json.loads(Path(cfg_file).read_text())
    except (OSError, ValueError) as e:
        problems.append(f"{key}: {cfg_file}: not readable JSON ({e})")
        return None


def _hub_cached_file(repo_id: str, filename: str) -> str | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, filename)
    return found if isinstance(found, str) else None


def is_moe(config: dict) -> bool:
    """Whether a Hugging Face config.json describes a mixture-of-experts model."""
    for c in (config, config.get("text_config") or {}):
        if any(c.get(k) for k in _EXPERT_KEYS):
            return True
    return False


def check_model(cfg: SparkConfig, problems: list[str]) -> None:
    """model.path / model.rollout_path exist; LoRA expert targets and R3 fit the architecture."""
    tiny = cfg.model.make_tiny
    if tiny.arch:
        moe, what = _TINY_MOE.get(tiny.arch), f"model.make_tiny.arch={tiny.arch}"
    else:
        config = model_config("model.path", cfg.model.path, problems)
        if cfg.model.rollout_path:
            model_config("model.rollout_path", cfg.model.rollout_path, problems)
        moe = None if config is None else is_moe(config)
        arch = ", ".join((config or {}).get("architectures") or []) or "the model"
        what = f"{cfg.model.path} ({arch})"
    if moe is False:
        if cfg.lora.target_experts:
            problems.append(
                f"lora.target_experts: {what} is dense (no experts); set lora.target_experts=false"
            )
        if cfg.r3.enabled:
            problems.append(
                f"r3.enabled: {what} is dense (no experts, no routing to replay); set r3.enabled=false"
            )


def check_adapter(key: str, adapter: str | Path | None, problems: list[str]) -> None:
    if adapter is None:
        return
    path = Path(adapter)
    if not path.is_dir():
        problems.append(f"{key}: {path}: no such directory")
    elif not (path / "adapter_config.json").is_file():
        problems.append(f"{key}: {path} has no adapter_config.json (expected a PEFT adapter directory)")


# ----------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------


def check_data(key: str, spec: str, problems: list[str]) -> None:
    """Local files and the synthetic task are loaded with the run's own reader (rl.data.sources: parse,
    schema, columns, nulls); a hub id is left to the run (it may need the network)."""
    from rl.data.sources import HUB_PREFIX, SYNTHETIC_PREFIX, load_source, parse_spec

    try:
        location, _ = parse_spec(spec)
    except ValueError as e:
        problems.append(f"{key}: {e}")
        return
    local = Path(location).expanduser()
    if location.startswith(HUB_PREFIX) or (
        not location.startswith(SYNTHETIC_PREFIX) and not local.exists() and _HUB_ID.match(location)
    ):
        return
    try:
        load_source(spec)
    except (ValueError, FileNotFoundError, OSError) as e:
        problems.append(f"{key}: {str(e).splitlines()[0]}")


def preflight(
    cfg: SparkConfig, adapter: str | Path | None = None, train: bool = True, evaluate: bool | None = None
) -> None:
    """Every check that needs no Ray; raises PreflightError listing all problems found.

    `train`: check the training data; `evaluate`: check `eval.data` (default: when eval.every > 0)."""
    problems: list[str] = []
    check_model(cfg, problems)
    check_adapter("--adapter", adapter, problems)
    if train:
        check_data("data.train", cfg.data.train, problems)
    if evaluate is None:
        evaluate = cfg.eval.every > 0
    if evaluate and cfg.eval.data:
        check_data("eval.data", cfg.eval.data, problems)
    if problems:
        raise PreflightError(problems)


# ----------------------------------------------------------------------------------------------------
# The cluster
# ----------------------------------------------------------------------------------------------------


@dataclass
class ClusterInfo:
    cpus: float
    gpus: float
    nodes: int
    address: str = ""


def cluster_info(ray_module: Any) -> ClusterInfo:
    """What the connected Ray cluster has in all (alive nodes only)."""
    total = ray_module.cluster_resources()
    alive = [n for n in ray_module.nodes() if n.get("Alive")]
    address = ray_module.get_runtime_context().gcs_address
    return ClusterInfo(total.get("CPU", 0.0), total.get("GPU", 0.0), len(alive), address)


def resource_needs(cfg: SparkConfig) -> tuple[float, float]:
    """(CPU slots, GPUs) the run's workers ask Ray for: one CPU slot a worker on CPU, the placement group's
    bundles on GPU."""
    from rl.placement import plan_placement

    bundles, _ = plan_placement(cfg)
    if not bundles:
        return float(cfg.trainer.num_ranks + cfg.rollout.num_workers), 0.0
    return sum(b.get("CPU", 0) for b in bundles), sum(b.get("GPU", 0) for b in bundles)


def check_cluster(cfg: SparkConfig, info: ClusterInfo) -> None:
    """The cluster has the CPU slots, GPUs and nodes the placement needs."""
    cpus, gpus = resource_needs(cfg)
    where = f"the Ray cluster at {info.address}" if info.address else "the Ray cluster"
    has = f"{where} has {info.cpus:g} CPU slots, {info.gpus:g} GPUs on {info.nodes} node(s)"
    problems = []
    if cpus > info.cpus:
        if gpus:
            fix = "lower trainer.num_ranks or rollout.num_workers, or add CPUs to the cluster"
        else:
            fix = (
                f"lower trainer.num_ranks ({cfg.trainer.num_ranks}) or rollout.num_workers "
                f"({cfg.rollout.num_workers}), or start the cluster with more CPUs (ray start --num-cpus)"
            )
        problems.append(f"trainer.num_ranks: the run's workers need {cpus:g} CPU slots, but {has}; {fix}")
    if gpus > info.gpus:
        problems.append(
            f"resources.num_gpus: the placement needs {gpus:g} GPUs, but {has}; lower resources.num_gpus "
            f"(with trainer.num_ranks and rollout.num_workers) or join a cluster with more GPUs"
        )
    if cfg.resources.nodes > info.nodes:
        problems.append(
            f"resources.nodes: the run asks for {cfg.resources.nodes} nodes, but {has}; lower "
            f"resources.nodes or start more nodes (launch/worker.sh)"
        )
    if problems:
        raise PreflightError(problems)
