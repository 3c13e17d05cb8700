"""Checks that run before Ray starts: the mistakes a run would otherwise report minutes later, from a worker.

    preflight(cfg)                          # local paths, the model's config.json vs. LoRA and R3, data files
    check_cluster(cfg, cluster_info(ray))   # after joining a cluster: CPU slots, GPUs and nodes

Each problem is one line that names the config key (or the file) and what to change; `PreflightError`
carries them all, and the CLI prints them without a traceback. Everything here reads local files, except
for hub ids that are not in the local cache: one short request (`HUB_TIMEOUT_S`) asks whether the hub
answers, since without it the run could only fail minutes later, in a worker, after retrying. So it takes
well under a second for the shipped recipes with their models and data at hand, and a few seconds at most
when the hub has to be asked.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl.config import SparkConfig
from rl.core.model_info import is_moe, num_experts
from rl.metrics import tracker_problems
from rl.models import registry

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# How long the preflight waits for the hub to answer. A reachable hub answers its API in well under a second;
# an unreachable one fails at once (refused, no route, no DNS) or, where packets are dropped, after this.
HUB_TIMEOUT_S = 5.0
_DEFAULT_ENDPOINT = "https://huggingface.co"


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


def model_config(key: str, value: str, problems: list[str], hub: Hub | None = None) -> dict | None:
    """config.json of the model `value` names (a directory, or a hub id found in the local cache)."""
    path = Path(value).expanduser()
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            problems.append(
                f"{key}: {path} has no config.json (expected a Hugging Face checkpoint directory)"
            )
            return None
        missing = _missing_weights(path)
        if missing:
            problems.append(f"{key}: {path} {missing}")
    elif path.exists():
        problems.append(f"{key}: {path} is a file; expected a checkpoint directory or a hub id (owner/name)")
        return None
    elif _looks_local(value):
        problems.append(f"{key}: {value}: no such directory (nor a Hugging Face hub id owner/name)")
        return None
    else:
        return _hub_model_config(key, value, problems, hub or Hub())
    return _read_config(key, cfg_file, problems)


def _read_config(key: str, cfg_file: Path, problems: list[str]) -> dict | None:
    try:
        return json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        problems.append(f"{key}: {cfg_file}: not readable JSON ({e})")
        return None


def _missing_weights(directory: Path) -> str | None:
    """What a checkpoint directory lacks of its weights (the shards its index lists, or any weight file)."""
    for name in _WEIGHT_INDEXES:
        index = directory / name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as e:
                return f"has a {name} that lists no weight files ({type(e).__name__}: {e})"
            missing = [s for s in shards if not (directory / s).is_file()]
            if missing:
                more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
                return (
                    f"lacks {len(missing)} of the {len(shards)} weight files its {name} lists "
                    f"({', '.join(missing[:3])}{more})"
                )
            return None
    if any(f.suffix in _WEIGHT_SUFFIXES for f in directory.iterdir()):
        return None
    return "holds no weight files (*.safetensors or *.bin)"


def _hub_model_config(key: str, repo_id: str, problems: list[str], hub: Hub) -> dict | None:
    """config.json of a hub model from the local cache. What the run cannot get, neither from the cache nor
    from the hub (offline, or no answer from it), is a problem; a hub that answers downloads the rest."""
    from huggingface_hub import try_to_load_from_cache

    cache = hub_cache_dir()
    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache)
    # "no local directory" too: a relative path that does not exist reads as a hub id (owner/name).
    config, missing = None, f"is no local directory, nor in the local Hugging Face cache ({cache})"
    if isinstance(found, str):
        snapshot = Path(found).parent
        config = _read_config(key, Path(found), problems)
        lacks = _missing_weights(snapshot)
        if lacks is None:
            return config
        missing = (
            f"is no local directory, and only partly in the local Hugging Face cache: {snapshot} {lacks}"
        )
    fix = f"download it first (hf download {repo_id}) or set {key} to a local checkpoint directory"
    if hub_offline():
        problems.append(f"{key}: {repo_id} {missing}, and HF_HUB_OFFLINE is set; {fix}")
    else:
        unreachable = hub.unreachable("models", repo_id)
        if unreachable:
            problems.append(f"{key}: {repo_id} {missing}, and {unreachable}; {fix}")
    return config


def check_model(cfg: SparkConfig, problems: list[str], hub: Hub | None = None, train: bool = True) -> None:
    """model.path / model.rollout_path exist; LoRA expert targets and R3 fit the architecture; to `train`,
    R3 knows the routers of a mixture-of-experts model (its family in rl/models/ has a router adapter)."""
    tiny = cfg.model.make_tiny
    hub = hub or Hub()
    if tiny.arch:
        family = registry.tiny_family(tiny.arch)
        moe = None if family is None else family.tiny_is_moe
        model_type = "" if family is None else family.model_types[0]
        what = f"model.make_tiny.arch={tiny.arch}"
        experts = None if family is None or family.tiny is None else num_experts(family.tiny.kwargs)
    else:
        config = model_config("model.path", cfg.model.path, problems, hub)
        if cfg.model.rollout_path:
            model_config("model.rollout_path", cfg.model.rollout_path, problems, hub)
        moe = None if config is None else is_moe(config)
        family = None if config is None else registry.family_of(config)
        model_type = registry.config_model_type(config or {})
        arch = ", ".join((config or {}).get("architectures") or []) or "the model"
        what = f"{cfg.model.path} ({arch})"
        experts = None
        if config is not None:
            experts = max(num_experts(config), num_experts(config.get("text_config") or {}))
    if train and moe and cfg.r3.enabled and not (family and family.routers):
        if family is None:
            where = "no family in rl/models/ claims it"
            fix = f"add rl/models/{model_type or '<family>'}/ with its router adapter"
        else:
            where = f"its family, rl/models/{family.name}/, has no router adapter"
            fix = f"add its router adapter to rl/models/{family.name}/"
        problems.append(
            f"r3.enabled: {what} is a mixture-of-experts model of model_type {model_type!r}, and {where}, so "
            f"its routing cannot be replayed; set r3.enabled=false to train without routing replay, or {fix} "
            "(docs/design.md, Models)"
        )
    ep = cfg.trainer.expert_parallel_size
    if train and ep > 1 and experts is not None:
        if not experts:
            problems.append(
                f"trainer.expert_parallel_size: {ep}, but {what} is dense (no experts to spread); set "
                "trainer.expert_parallel_size=1"
            )
        elif experts % ep:
            problems.append(
                f"trainer.expert_parallel_size: {ep} does not divide the expert count of {what} ({experts} "
                "routed experts a layer); use a divisor of it"
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
# The Hugging Face hub and its caches, as the run's processes will see them
# ----------------------------------------------------------------------------------------------------
# Read from the environment at each call, not from huggingface_hub's or datasets' constants (fixed when they
# were first imported): the workers are fresh processes that read the environment as it is now.


def _env_true(name: str) -> bool:
    from huggingface_hub.constants import ENV_VARS_TRUE_VALUES

    return (os.environ.get(name) or "").upper() in ENV_VARS_TRUE_VALUES


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub reads it: the run will not ask the hub."""
    return _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")


def datasets_offline() -> bool:
    """HF_DATASETS_OFFLINE where set, else HF_HUB_OFFLINE, as `datasets` reads them."""
    if os.environ.get("HF_DATASETS_OFFLINE") is not None:
        return _env_true("HF_DATASETS_OFFLINE")
    return hub_offline()


def _hf_home() -> str:
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.expandvars(
        os.path.expanduser(os.environ.get("HF_HOME") or os.path.join(xdg, "huggingface"))
    )


def hub_cache_dir() -> str:
    """Where huggingface_hub keeps downloaded repos (`models--owner--name/snapshots/...`)."""
    cache = (
        os.environ.get("HF_HUB_CACHE")
        or os.environ.get("HUGGINGFACE_HUB_CACHE")
        or os.path.join(_hf_home(), "hub")
    )
    return os.path.expandvars(os.path.expanduser(cache))


def datasets_cache_dir() -> str:
    """Where `datasets` keeps prepared datasets (`owner___name/config/version/hash/`): what load_dataset
    reads when it cannot reach the hub (the hub cache's raw files alone do not serve it)."""
    return os.path.expanduser(os.environ.get("HF_DATASETS_CACHE") or os.path.join(_hf_home(), "datasets"))


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or _DEFAULT_ENDPOINT).rstrip("/")


class Hub:
    """Whether the hub answers, asked once for a whole preflight: every hub id shares the answer, so a
    preflight with several uncached ids waits for one request at most."""

    def __init__(self, timeout_s: float = HUB_TIMEOUT_S):
        self.endpoint, self.timeout_s = hub_endpoint(), timeout_s
        self._asked, self._reason = False, None

    def unreachable(self, kind: str, repo_id: str) -> str | None:
        """None when the hub answers its repo-info route for `repo_id` (`kind`: models or datasets), with any
        status: the run's own request decides about a missing or private repo. Else why it cannot be reached."""
        if not self._asked:
            self._asked = True
            why = _no_answer(f"{self.endpoint}/api/{kind}/{repo_id}", self.timeout_s)
            self._reason = why and f"the hub at {self.endpoint} cannot be reached ({why})"
        return self._reason


def _no_answer(url: str, timeout_s: float) -> str | None:
    """Why `url` gives no HTTP answer within `timeout_s`, or None. httpx, as huggingface_hub's own client, so
    the proxy and certificate settings it honors (HTTPS_PROXY, SSL_CERT_FILE, ...) are the run's. In a thread
    with a deadline: the client's timeout does not cover name resolution, which can hang far longer."""
    import httpx

    answer: list[str | None] = []

    def ask() -> None:
        try:
            httpx.get(url, timeout=timeout_s, follow_redirects=False)
            answer.append(None)
        except Exception as e:  # any failure to get a response is the answer: connect, DNS, TLS, bad URL
            answer.append(" ".join(str(e).split()) or type(e).__name__)

    thread = threading.Thread(target=ask, name="sparkrl-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout_s + 1.0)
    return answer[0] if answer else f"no answer in {timeout_s:g} s"


# ----------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------


def check_data(
    key: str, spec: str, problems: list[str], hub: Hub | None = None, text_answers=True, prompt_key="prompt"
):
    """Local files and the synthetic task are loaded with the run's own reader (rl.data.sources: parse,
    schema, columns, every bad cell); a hub dataset must be in the local datasets cache or the hub must
    answer (the run then downloads it). text_answers: which rows need a text ground truth (a data source's
    checker is a built-in one). -> the loaded source, or None (a hub dataset, or a problem)."""
    from rl.data.problems import DataError
    from rl.data.sources import hub_dataset, load_source, parse_spec

    try:
        location, query = parse_spec(spec)
    except ValueError as e:
        problems.append(f"{key}: {e}")
        return
    repo_id = hub_dataset(location)
    if repo_id is not None:
        # `hf:` before a local path: datasets reads that path itself, no hub involved.
        if _HUB_ID.match(repo_id) and not Path(repo_id).expanduser().exists():
            split, config = query.get("split", "train"), query.get("config")
            _check_hub_dataset(key, repo_id, config, split, problems, hub or Hub())
        return
    try:
        return load_source(spec, text_answers=text_answers, prompt_key=prompt_key)
    except DataError as e:
        problems.extend(f"{key}: {line}" for line in str(e).splitlines())
    except (ValueError, FileNotFoundError, OSError) as e:
        problems.append(f"{key}: {str(e).splitlines()[0]}")
    return None


def _check_hub_dataset(
    key: str, repo_id: str, config: str | None, split: str, problems: list[str], hub: Hub
) -> None:
    """A hub dataset the run can load: from the datasets cache, or from a hub that answers."""
    missing = _datasets_cache_lacks(repo_id, config, split)
    if missing is None:
        return
    fix = (
        f"download it first (hf download {repo_id} --repo-type dataset --local-dir DIR) and set "
        f"{key}=DIR (or one of its parquet files)"
    )
    if datasets_offline():
        flag = (
            "HF_DATASETS_OFFLINE" if os.environ.get("HF_DATASETS_OFFLINE") is not None else "HF_HUB_OFFLINE"
        )
        problems.append(f"{key}: {repo_id} {missing}, and {flag} is set; {fix}")
        return
    unreachable = hub.unreachable("datasets", repo_id)
    if unreachable:
        problems.append(f"{key}: {repo_id} {missing}, and {unreachable}; {fix}")


def _datasets_cache_lacks(repo_id: str, config: str | None, split: str) -> str | None:
    """What keeps `datasets.load_dataset(repo_id, config, split=split)` from loading from the local cache
    alone, or None. Mirrors datasets' fallback when the hub does not answer (CachedDatasetModuleFactory and
    the `cache` builder): `<HF_DATASETS_CACHE>/<owner>___<snake_case name>/<config>/<version>/<hash>/` with a
    dataset_info.json whose config_name is the directory's; the newest one is taken, and without a config
    named it must be the only config cached at that version and hash."""
    from datasets.naming import camelcase_to_snakecase

    cache = datasets_cache_dir()
    owner, name = repo_id.split("/")
    root = Path(cache) / f"{owner}___{camelcase_to_snakecase(name)}"
    infos: dict[Path, dict] = {}
    for d in root.glob(f"{glob.escape(config) if config else '*'}/*/*"):
        try:
            info = json.loads((d / "dataset_info.json").read_text())
        except (OSError, ValueError):  # not a prepared dataset (a lock, a half-written one)
            continue
        if isinstance(info, dict) and info.get("config_name") == d.parts[-3]:
            infos[d] = info
    if not infos:
        where = f" with config {config!r}" if config else ""
        return f"is no local file or directory, nor in the local datasets cache{where} ({cache})"
    newest = max(infos, key=lambda d: d.stat().st_mtime)
    if not config:
        configs = sorted(d.parts[-3] for d in infos if d.parts[-2:] == newest.parts[-2:])
        if len(configs) > 1:
            return (
                f"is in the local datasets cache ({root}) in several configs ({', '.join(configs)}), and the "
                f"spec names none (add ?config=NAME)"
            )
    splits = infos[newest].get("splits") or {}
    wanted = [part.split("[")[0].strip() for part in split.split("+")]
    lacking = [w for w in wanted if w not in splits]
    if lacking:
        return (
            f"is in the local datasets cache ({newest}) without split {lacking[0]!r} "
            f"(it has {', '.join(sorted(splits)) or 'none'})"
        )
    return None


def preflight(
    cfg: SparkConfig, adapter: str | Path | None = None, train: bool = True, evaluate: bool | None = None
) -> None:
    """Every check that needs no Ray; raises PreflightError listing all problems found.

    `train`: check the training data; `evaluate`: check `eval.data` (default: when eval.every > 0)."""
    from rl.reward import RewardSpec

    problems: list[str] = []
    hub = Hub()  # asked at most once, and only for a hub id the local caches lack
    check_model(cfg, problems, hub, train)
    check_adapter("--adapter", adapter, problems)
    text = RewardSpec.of_config(cfg.reward).needs_text
    rows = None
    if train:
        source = check_data("data.train", cfg.data.train, problems, hub, text, cfg.data.prompt_key)
        rows = source.dataset if source is not None else None
        problems += tracker_problems(cfg.logging)  # a tracker turned on whose package is missing
        problems += algorithm_problems(cfg)
    if evaluate is None:
        evaluate = cfg.eval.every > 0
    if evaluate and cfg.eval.data:
        source = check_data("eval.data", cfg.eval.data, problems, hub, text, cfg.data.prompt_key)
        if rows is None and source is not None:
            rows = source.dataset
    problems += reward_problems(cfg, rows)
    problems += env_problems(cfg, rows)
    problems += kv_cache_problems(cfg)
    if problems:
        raise PreflightError(problems)


def kv_cache_problems(cfg: SparkConfig) -> list[str]:
    """Colocated on GPUs, an engine's KV cache is what the plan leaves of its memory share
    (rl.plan.colocated_engine_plan); it must hold one sequence of the engine's context, or the engine dies at
    start."""
    from rl.plan import colocated_engine_plan
    from rollout.config import engine_setting

    p = colocated_engine_plan(cfg)
    if p is None or p.kv_room >= p.kv_per_seq:
        return []
    gib = 2**30
    share = engine_setting(cfg.rollout, "gpu_memory_utilization")
    return [
        f"rollout.gpu_memory_utilization: {share:g} of a {cfg.resources.gpu_memory_gib:g} GiB GPU "
        f"(resources.gpu_memory_gib) leaves {max(p.kv_room, 0) / gib:.2f} GiB of KV cache beside "
        f"{p.r_beside_kv / gib:.2f} GiB of weights, LoRA slot, activations and runtime; one "
        f"{p.context:,}-token sequence needs {p.kv_per_seq / 2**20:,.1f} MiB: raise it (`sparkrl plan` shows "
        "the split)"
    ]


# ----------------------------------------------------------------------------------------------------
# Code of the user's own: reward functions, advantage estimators, policy losses
# ----------------------------------------------------------------------------------------------------

_REWARD_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
_BATCHED_ARGS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
PREFLIGHT_CALL_S = 30.0  # longest a reward function may take on the preflight's row


def _binds(fn, names: tuple[str, ...], kwargs: dict) -> str | None:
    """Why `fn` cannot be called with `names` and `kwargs` as keywords (None when it can)."""
    import inspect

    try:
        inspect.signature(fn).bind(**dict.fromkeys(names), **kwargs)
    except TypeError as e:
        return str(e)
    except ValueError:  # no signature to read (a builtin): the call itself will tell
        return None
    return None


def _call_with_deadline(fn, seconds: float):
    """fn() in a thread; (result, None), or (None, why) on an exception or after `seconds`."""
    import traceback

    box: list = []

    def run() -> None:
        try:
            box.append((fn(), None))
        except Exception as e:  # the user's function failed: reported as one line
            frame = traceback.extract_tb(e.__traceback__)[-1]
            where = f" ({Path(frame.filename).name}:{frame.lineno})"
            box.append((None, f"raised {type(e).__name__}: {str(e).strip()[:200]}{where}"))

    thread = threading.Thread(target=run, name="sparkrl-reward-preflight", daemon=True)
    thread.start()
    thread.join(seconds)
    return box[0] if box else (None, f"did not return within {seconds:g} s")


def env_problems(cfg: SparkConfig, dataset=None) -> list[str]:
    """The environment class of `rollout.env` imported once and built from the first row (the training
    data's, else eval's) with `rollout.env_kwargs`, as a rollout worker builds it; its `step` is not called."""
    from rl.core import user_code
    from rl.data.loader import reward_extra_info

    ro = cfg.rollout
    if not ro.env:
        return []
    try:
        cls = user_code.resolve("rollout.env", ro.env)
    except user_code.UserCodeError as e:
        return [str(e)]
    if not callable(getattr(cls, "step", None)):
        return [f"rollout.env: {ro.env} has no step(assistant_text, tool_calls) method"]
    from rl.data.loader import tool_schemas

    try:
        tool_schemas(getattr(cls, "tools", None), f"rollout.env: {ro.env}")
    except ValueError as e:
        return [str(e)]
    if dataset is None or len(dataset) == 0:
        return []
    row = dataset[0]
    env_row = {
        "data_source": row["data_source"],
        "ground_truth": row["reward_model"]["ground_truth"],
        "extra_info": reward_extra_info(row),
        "index": 0,
    }
    _, why = _call_with_deadline(functools.partial(cls, env_row, **ro.env_kwargs), PREFLIGHT_CALL_S)
    if why:
        return [f"rollout.env: {ro.env} {why} when built from the first row with rollout.env_kwargs"]
    return []


def reward_problems(cfg: SparkConfig, dataset=None) -> list[str]:
    """Each reward function of the user's own imported once, its signature checked against verl's, and the
    function called on the first row of its data source (the first training row for reward.function) with
    an empty response: what it returns must be a number or a dict with a numeric `score`."""
    from rl.core import user_code
    from rl.data.loader import reward_extra_info
    from rl.reward import RewardSpec, is_own, normalise

    spec = RewardSpec.of_config(cfg.reward)
    own = {key: c for key, c in spec.checkers().items() if is_own(c)}
    if not own:
        return []
    out = []
    first: dict[str, dict] = {}  # data source -> its first row
    if dataset is not None:
        for row in dataset.select(range(min(len(dataset), 10_000))):
            first.setdefault(row["data_source"], row)
    for key, checker in own.items():
        try:
            fn = user_code.resolve(key, checker)
        except user_code.UserCodeError as e:
            out.append(str(e))
            continue
        args = _BATCHED_ARGS if spec.batched else _REWARD_ARGS
        wrong = _binds(fn, args, spec.kwargs)
        if wrong:
            form = "batched (reward.batched)" if spec.batched else "verl's"
            kw = f" plus reward.kwargs {sorted(spec.kwargs)}" if spec.kwargs else ""
            out.append(f"{key}: {checker} does not take {form} arguments ({', '.join(args)}){kw}: {wrong}")
            continue
        sources = [s for s in first if spec.key(s) == key]
        if not sources:
            continue
        row = first[sources[0]]
        gt, extra = row["reward_model"]["ground_truth"], reward_extra_info(row)
        if spec.batched:
            args = {"data_sources": [row["data_source"]], "solution_strs": [""]}
            args |= {"ground_truths": [gt], "extra_infos": [extra]}
        else:
            args = {
                "data_source": row["data_source"],
                "solution_str": "",
                "ground_truth": gt,
                "extra_info": extra,
            }
        on = f"on the first row of data source {sources[0]!r} with an empty response (the model may answer anything)"
        result, why = _call_with_deadline(functools.partial(fn, **args, **spec.kwargs), PREFLIGHT_CALL_S)
        if why:
            out.append(f"{key}: {checker} {why} {on}")
            continue
        try:
            if spec.batched:
                if not isinstance(result, list | tuple) or len(result) != 1:
                    got = (
                        f"{len(result)} results"
                        if isinstance(result, list | tuple)
                        else type(result).__name__
                    )
                    raise TypeError(
                        f"{key}: {checker} (batched) returned {got} for 1 response; expected a list"
                    )
                result = result[0]
            normalise(result, key, checker)
        except (TypeError, ValueError) as e:
            out.append(f"{e} ({on})")
    return out


def algorithm_problems(cfg: SparkConfig) -> list[str]:
    """algorithm.adv_estimator / algorithm.policy_loss named by import path: imported and called once on a
    small batch (2 groups of 2), as the driver and the trainer ranks will call them."""
    from rl.core import user_code

    al = cfg.algorithm
    todo = [
        (k, v)
        for k, v in (("algorithm.adv_estimator", al.adv_estimator), ("algorithm.policy_loss", al.policy_loss))
        if user_code.is_import_path(v)
    ]
    if not todo:
        return []
    import torch

    from rl.core import algo

    out = []
    for key, value in todo:
        try:
            user_code.resolve(key, value)
            if key == "algorithm.adv_estimator":
                adv = algo.compute_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), [0, 0, 1, 1], value)
                if adv.shape != (4,):
                    out.append(f"{key}: {value} gave advantages of shape {tuple(adv.shape)} for 4 samples")
            else:
                logp = torch.full((4, 3), -1.0, requires_grad=True)
                loss, _ = algo.policy_loss(
                    logp,
                    logp.detach() - 0.1,
                    torch.tensor([1.0, -1.0, 0.5, -0.5]),
                    torch.ones(4, 3),
                    loss_mode=value,
                    clip_ratio_low=al.clip_ratio_low,
                    clip_ratio_high=al.clip_ratio_high,
                    loss_agg_mode=al.loss_agg_mode,
                    loss_scale_factor=float(cfg.rollout.max_response_len),
                )
                loss.backward()
        except user_code.UserCodeError as e:
            out.append(str(e))
        except Exception as e:  # the user's function failed on the small batch
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            text = (
                first
                if first.startswith(key)
                else f"{key}: {value} failed on a batch of 4 samples: {type(e).__name__}: {first}"
            )
            out.append(text)
    return out


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
