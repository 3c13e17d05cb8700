"""One vLLM engine (offline `LLM`) and the conversions around it: prompts in, `Sample`s out; weights in.

`RolloutWorker` is a plain class; `ray.remote(RolloutWorker)` makes it an actor (rollout.pool does).
On GPU the engine starts in its own process (vLLM's engine core); a CPU engine of one rank in a Ray actor
runs in the actor's process (`in_process`). This module imports vLLM lazily, once the worker has set the engine's
environment.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import ray
import torch

from rl.core.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_peft_dir
from rl.core.batch import Sample
from rl.core.model_info import num_experts, quantization_kind, vllm_lora_rank
from rl.core.worker_logs import capture
from rollout.adapter_layout import merged_to_checkpoint, peft_to_vllm, sibling_prefix
from rollout.config import engine_setting
from rollout.lora_kernels import HopperLoraConfigs, hopper_gpu_name
from rollout.safetensors_io import write_safetensors
from rollout.spec import EngineBundles, EngineSpec, PromptRequest, SamplingSpec
from rollout.staging import StageDir, dir_bytes, stage_root

log = logging.getLogger(__name__)

EXTENSION = "rollout.vllm_ext.SparkWorkerExtension"
SCHEDULER = "rollout.vllm_ext.routing_at_finish_scheduler"


class RoutedExpertsError(RuntimeError):
    """vLLM returned routed experts that cannot be right (all zero, wrong shape, repeated experts)."""


@dataclass(frozen=True)
class ModelInfo:
    """What the rollout side needs to know about a checkpoint, read from its config.json."""

    num_layers: int
    num_experts: int  # 0 for a dense model
    top_k: int
    quantization: str | None  # "nvfp4", another quant_method, or None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def read_model_info(model_path: str, trust_remote_code: bool = False) -> ModelInfo:
    from rl.models import auto_config

    cfg = auto_config(model_path, trust_remote_code=trust_remote_code)
    text = getattr(cfg, "text_config", None) or cfg
    quant = getattr(cfg, "quantization_config", None) or getattr(text, "quantization_config", None)
    return ModelInfo(
        num_layers=text.num_hidden_layers,
        num_experts=num_experts(text.to_dict()),
        top_k=int(getattr(text, "num_experts_per_tok", 0) or 0),
        quantization=quantization_kind(quant),
    )


def stacked_experts(spec: EngineSpec, info: ModelInfo) -> bool:
    """Whether adapters go to this engine with stacked expert tensors (EngineSpec.lora_experts_stacked): the
    engine's flag, the staged layout and the request's flag must agree."""
    return spec.enable_lora and spec.lora_experts_stacked and info.is_moe


def in_process(spec: EngineSpec, bundles: EngineBundles | None) -> bool:
    """Whether the engine runs inside this worker's process: vLLM's uniprocess executor and in-process
    engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0), for a CPU engine of one rank in a Ray actor of its own.
    vLLM's own engine-core and worker processes each import vLLM and torch again, most of a CPU engine's
    start-up. In process it sampled the same tokens as with those processes when compared by hand; no test
    compares the two.
    In process, vLLM's CPU worker pins this process's OpenMP threads to its cores, as it pins its own
    worker process otherwise: right for an actor that exists for the engine, wrong for a caller's process
    (a test, a benchmark), whose later children would inherit the pinning, so those keep the separate
    processes. On GPU the separate engine core overlaps scheduling with the frontend, and tensor
    parallelism needs its workers: both keep vLLM's default."""
    if bundles is not None or spec.rollout.tensor_parallel_size != 1 or torch.cuda.is_available():
        return False
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def engine_kwargs(spec: EngineSpec, info: ModelInfo, bundles: EngineBundles | None = None) -> dict:
    """The `vllm.LLM` arguments of `spec` for the checkpoint described by `info`; `bundles`: the engine's
    TP ranks go to these placement-group bundles through vLLM's Ray executor (`engine_env` sets the rest)."""
    kw = dict(
        model=spec.model_path,
        dtype=spec.dtype,
        seed=spec.seed,
        gpu_memory_utilization=spec.rollout.gpu_memory_utilization,
        enforce_eager=spec.rollout.enforce_eager,
        max_num_seqs=spec.rollout.max_num_seqs,
        tensor_parallel_size=spec.rollout.tensor_parallel_size,
        enable_prefix_caching=spec.rollout.enable_prefix_caching,
        trust_remote_code=spec.trust_remote_code,
        # The sampled token's log-prob after temperature / top-k / top-p: what the sampler drew from.
        logprobs_mode="processed_logprobs",
        worker_extension_cls=EXTENSION,
    )
    if spec.max_model_len:
        kw["max_model_len"] = spec.max_model_len
    if bundles is not None:
        if len(bundles.bundle_indices) != spec.rollout.tensor_parallel_size:
            raise ValueError(
                f"EngineBundles: {len(bundles.bundle_indices)} bundles for tensor_parallel_size "
                f"{spec.rollout.tensor_parallel_size}; one bundle a TP rank"
            )
        kw["distributed_executor_backend"] = "ray"
    elif spec.rollout.tensor_parallel_size > 1:
        # The actor holds the engine's GPUs: TP ranks as its child processes. Left to itself, vLLM picks
        # its Ray executor inside any placement group, which refuses bundles of more than one GPU.
        kw["distributed_executor_backend"] = "mp"
    elif in_process(spec, bundles):
        kw["distributed_executor_backend"] = "uni"
    # An engine given bundles runs on GPUs by construction (rl.placement); its own actor holds none.
    if bundles is None and not torch.cuda.is_available():
        # vLLM's CPU runner rewinds a seeded request's generator after a partial (chunked) prefill with
        # Generator.set_offset, which CPU generators do not have ("CPU Generator does not use offset"):
        # a batch of seeded requests larger than the token budget kills the engine. Whole prefills only.
        kw["enable_chunked_prefill"] = False
    if spec.enable_lora:
        rank = vllm_lora_rank(spec.max_lora_rank)
        if rank is None:
            raise ValueError(f"EngineSpec.max_lora_rank {spec.max_lora_rank} is above vLLM's largest, 512")
        # One adapter at a time: the LRU cache evicts the old one as the new one loads.
        kw.update(enable_lora=True, max_lora_rank=rank, max_loras=1)
        if stacked_experts(spec, info):
            kw["enable_mixed_moe_lora_format"] = True  # accept the stacked layout (is_3d_lora_weight)
    if spec.return_routed_experts and info.is_moe:
        kw["enable_return_routed_experts"] = True
        if spec.routing_at_finish:
            kw["scheduler_cls"] = SCHEDULER
    if spec.enable_sleep_mode:
        kw["enable_sleep_mode"] = True
    if spec.non_kv_bytes and "kv_cache_memory_bytes" not in spec.rollout.engine_args:
        kw["kv_cache_memory_bytes"] = kv_cache_bytes(spec)
    backend = spec.rollout.moe_backend
    # NVFP4 experts with LoRA: vLLM's MoE-LoRA path works with Marlin's weight-only FP4 on Hopper;
    # "auto" may pick a kernel without LoRA support.
    if backend == "auto" and info.is_moe and info.quantization == "nvfp4" and spec.enable_lora:
        backend = "marlin"
    if backend != "auto":
        kw["moe_backend"] = backend
    # The LM head's logits as the trainer computes them: model.head_dtype's values are vLLM's head_dtype
    # names. A user's own engine_args.hf_overrides add to this, and its head_dtype wins.
    kw.update(spec.rollout.engine_args)
    kw["hf_overrides"] = {
        "head_dtype": spec.head_dtype,
        **dict(spec.rollout.engine_args.get("hf_overrides") or {}),
    }
    return kw


def kv_cache_bytes(spec: EngineSpec) -> int:
    """The KV cache of each TP rank under sleep mode: gpu_memory_utilization x the GPU's memory, less what
    the plan puts beside it (EngineSpec.non_kv_bytes). The GPU's memory from NVML, without a CUDA context
    here (vLLM's device 0 for this process: its CUDA_VISIBLE_DEVICES' first, the node's first where that is
    empty), or resources.gpu_memory_gib where NVML cannot tell."""
    from vllm.platforms import current_platform

    total = spec.gpu_bytes
    if current_platform.is_cuda_alike():
        try:
            total = current_platform.get_device_total_memory(0)
        except Exception:  # no NVML answer
            pass
    share = engine_setting(spec.rollout, "gpu_memory_utilization")
    kv = int(share * total) - spec.non_kv_bytes
    if kv <= 0:
        planned = ""
        if spec.gpu_bytes and abs(total - spec.gpu_bytes) > 0.05 * total:
            planned = f" (the plan took a {spec.gpu_bytes / 2**30:g} GiB GPU: set resources.gpu_memory_gib)"
        raise ValueError(
            f"rollout.gpu_memory_utilization {share} of a {total / 2**30:.1f} GiB GPU{planned} leaves no KV "
            f"cache beside the {spec.non_kv_bytes / 2**30:.1f} GiB of weights, LoRA slot, activations and "
            "runtime `sparkrl plan` counts; raise rollout.gpu_memory_utilization"
        )
    return kv


DUP_CHECK_ROWS = 64  # rows of a sample whose experts check_routed_experts checks for repeats


def check_routed_experts(routed: np.ndarray, rows: int, top_k: int, num_experts: int) -> np.ndarray:
    """Validate one sample's routing `[rows, layers, top_k]` and return it as uint8/uint16.

    Some vLLM MoE kernels leave the capture buffer at zero; training with that routing replayed would
    silently route every token to expert 0, so it is an error, as are repeated experts within a row (what
    uninitialised or torn capture memory shows). The repeat check looks at up to DUP_CHECK_ROWS rows spread
    over the sample, the first and the last among them: numpy sorts each row of top_k on its own, about
    7 ns a routing entry, and every row of the bench's batch-256 Muse rollout (256 x 319 rows, 16 layers,
    top-8) took 86 ms on the CPU machine, serial after vLLM returns, beside 4 to 6 s for that rollout on the
    H200: a share of the 3 % R3 budget, for a check whose target (bad memory) shows in any row. Sampled: 19 ms.
    """
    routed = np.asarray(routed)
    if routed.ndim != 3 or routed.shape[0] != rows or (top_k and routed.shape[2] != top_k):
        raise RoutedExpertsError(
            f"vLLM routed_experts has shape {routed.shape}, expected [{rows} (prompt + response - 1), "
            f"layers, {top_k} (top_k)]"
        )
    if not routed.any():
        raise RoutedExpertsError(
            "vLLM returned all-zero routed_experts: this MoE kernel does not capture routing; pick another "
            "moe_backend or turn R3 off (r3.enabled=false)"
        )
    if routed.shape[2] > 1:
        step = max(1, -(-rows // DUP_CHECK_ROWS))
        ordered = np.sort(np.concatenate([routed[::step], routed[-1:]]), axis=-1)
        if (ordered[..., 1:] == ordered[..., :-1]).any():
            raise RoutedExpertsError("vLLM routed_experts repeats an expert within a token's top-k")
    if num_experts and routed.max() >= num_experts:
        raise RoutedExpertsError(f"vLLM routed_experts has expert id {routed.max()} >= {num_experts} experts")
    dtype = np.uint8 if num_experts <= 256 else np.uint16
    return routed if routed.dtype == dtype else routed.astype(dtype)


def sampled_logprobs(token_ids, logprobs, where: str) -> np.ndarray:
    """The sampled token's log-prob at each position (vLLM always includes it, top-1 or not)."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise RuntimeError(
            f"{where}: vLLM returned {0 if logprobs is None else len(logprobs)} log-prob "
            f"entries for {len(token_ids)} tokens"
        )
    out = np.empty(len(token_ids), dtype=np.float32)
    for i, (tok, entry) in enumerate(zip(token_ids, logprobs)):
        if entry is None or tok not in entry:
            raise RuntimeError(f"{where}: no log-prob for token {tok} at position {i}")
        out[i] = entry[tok].logprob
    return out


class NonFiniteLogprobsError(RuntimeError):
    """vLLM returned NaN or inf for a sampled token's log-prob."""


def check_finite_logprobs(logprobs: np.ndarray, where: str) -> np.ndarray:
    """A sampled token was drawn with probability > 0, so its log-prob is finite: NaN or inf means the engine's
    logits were broken (a kernel fault), and every number from that forward is suspect. Stop the rollout
    rather than hand the trainer ratios and a k3 KL of NaN, which only show up as skipped steps."""
    bad = ~np.isfinite(logprobs)
    if bad.any():
        first = int(np.argmax(bad))
        raise NonFiniteLogprobsError(
            f"{where}: vLLM returned non-finite sampled log-probs ({int(np.isnan(logprobs).sum())} NaN, "
            f"{int(np.isinf(logprobs).sum())} inf of {len(logprobs)} response tokens; the first at response "
            f"token {first}). The engine's logits were NaN/inf, so this batch cannot be trained on. One known "
            "cause: vLLM issue 48590 (its Triton lora_expand kernel gives NaN on Hopper GPUs past ~128 prompt "
            "tokens; fix proposed in vLLM PR 48638)."
        )
    return logprobs


def _sync_metrics(path: Path, start: float, staged: float) -> dict:
    """A sync's metrics: the staged bytes, and its time split into ours (layout conversion + staged write,
    `start` to `staged`) and vLLM's (loading, old weights out, cache reset, `staged` to now)."""
    end = time.perf_counter()
    return {
        "perf/sync_bytes": dir_bytes(path),
        "perf/sync_s": end - start,
        "perf/sync_stage_s": staged - start,
        "perf/sync_engine_s": end - staged,
    }


def engine_env(spec: EngineSpec, bundles: EngineBundles | None) -> dict[str, str]:
    """Environment the engine needs before vLLM is imported: an engine core in this process (in_process),
    or where vLLM's Ray executor puts the TP ranks."""
    if in_process(spec, bundles):
        return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if bundles is None:
        return {}
    import ray

    from rl.core.compat import vllm_ray_executor_env

    if ray.util.get_current_placement_group() is None:
        raise RuntimeError(
            "EngineBundles given, but this actor is not in a placement group: schedule it with "
            "PlacementGroupSchedulingStrategy(placement_group_capture_child_tasks=True)"
        )
    address = os.environ.get("RAY_ADDRESS") or ray.get_runtime_context().gcs_address
    return vllm_ray_executor_env(bundles.bundle_indices, bundles.gpus_per_rank, address)


class RolloutWorker:
    """Owns one vLLM engine. `stage`: the per-run staging directory, a name resolved on this worker's node or
    an absolute path (rollout.staging.stage_root). `bundles`: the
    placement-group bundles of the engine's TP ranks, when vLLM's Ray executor places them (colocated TP);
    None: the engine runs on what this actor holds. Sleep and wake reach every TP rank: vLLM's executor
    forwards them to all its workers, as it does `collective_rpc`."""

    def __init__(self, spec: EngineSpec, stage: str | Path, bundles: EngineBundles | None = None):
        # This worker's output, and its engine-core process's, into the run's logs/ (rl/core/worker_logs.py).
        capture(f"rollout-{os.getpid()}")
        self.spec = spec
        self.bundles = bundles
        self.info = read_model_info(spec.model_path, spec.trust_remote_code)
        if bundles is not None and os.environ.get("CUDA_VISIBLE_DEVICES") == "":
            # Ray blanks it in an actor holding no GPU where RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1; the engine
            # core must see the node's GPUs to drive the TP workers that hold them.
            del os.environ["CUDA_VISIBLE_DEVICES"]
        if spec.enable_sleep_mode and bundles is None and not _has_cuda():
            raise ValueError("EngineSpec.enable_sleep_mode needs a GPU (vLLM's sleep mode is CUDA/ROCm only)")
        if spec.rollout.cpu_kvcache_gb:
            # Read by vLLM's CPU backend in the engine process, which inherits this environment.
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{spec.rollout.cpu_kvcache_gb:g}"
        self.stage = StageDir(stage_root(stage))
        kwargs = engine_kwargs(spec, self.info, bundles)
        self.in_process = in_process(spec, bundles)
        os.environ.update(engine_env(spec, bundles))  # read by vLLM in this process and the engine core's
        block_n = spec.hopper_lora_expand_block_n if spec.enable_lora else 0
        self.lora_configs = HopperLoraConfigs(
            self.stage.dir / "vllm_lora_configs", block_n, hopper_gpu_name() if block_n else None
        )
        from vllm import LLM

        try:
            self.llm = LLM(**kwargs)
        except BaseException:
            self.lora_configs.restore()
            raise
        self.version = 0  # of the weights generate uses: 0 = base
        self._lora = None  # the LoRARequest in use
        self._lora_ids = 0
        self._staged: str | None = None  # name of the staged directory in use
        self._sleeping = False

    # ---- generation -------------------------------------------------------------------------------
    def generate(
        self, requests: list[PromptRequest], sampling: SamplingSpec, indices: list[int] | None = None
    ) -> list[Sample]:
        """`sampling.n` samples per request, ordered by request then sample index. `indices`: the requests'
        places in the whole batch when this is a pool's share (their seeds follow them); default 0, 1, ..."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_awake("generate")
        if self.spec.rollout.env:
            return self._episodes(requests, sampling, indices)
        params = [
            SamplingParams(
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else -1,
                max_tokens=sampling.max_tokens,
                seed=sampling.request_seed(i),
                stop_token_ids=sampling.stop_token_ids,
                logprobs=0,  # the sampled token only
                # Token ids are all we use (the reward decodes the response once). Otherwise vLLM's
                # frontend detokenizes every sample and every sampled log-prob's token, one token per
                # step: 7/8 of its output processing in a batch-256 decode (profiled on the CPU machine).
                detokenize=False,
            )
            for i in (range(len(requests)) if indices is None else indices)
        ]
        if len(params) != len(requests):
            raise ValueError(f"generate: {len(requests)} requests but {len(params)} indices")
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        outputs = self.llm.generate(prompts, params, lora_request=self._lora, use_tqdm=False)
        capture = self.spec.return_routed_experts and self.info.is_moe
        samples = []
        for req, out in zip(requests, outputs):
            for comp in sorted(out.outputs, key=lambda c: c.index):
                where = f"group {req.group} sample {comp.index}"
                response, logp, routed = self._completion(comp, len(req.prompt_ids), capture, where)
                samples.append(
                    Sample(
                        prompt_ids=list(req.prompt_ids),
                        response_ids=response,
                        response_logprobs=logp,
                        finish_reason=str(comp.finish_reason),
                        adapter_version=self.version,
                        group=req.group,
                        data_source=req.data_source,
                        ground_truth=req.ground_truth,
                        routed_experts=routed,
                    )
                )
        if capture and self.spec.routing_by_reference:
            import ray

            # Owned by this actor, in its node's object store: the trainer rank that trains the sample
            # fetches it; the driver only passes the reference on.
            for s in samples:
                s.routing_ref, s.routed_experts = ray.put(s.routed_experts), None
        return samples

    def _completion(self, comp, prompt_len: int, capture: bool, where: str):
        """(token ids, their sampled log-probs, checked finite, and with `capture` their routed experts
        [prompt_len + len(ids) - 1, layers, top_k]) of one vLLM completion after a prompt of `prompt_len`."""
        ids = list(comp.token_ids)
        routed = None
        if capture:
            if comp.routed_experts is None:
                raise RoutedExpertsError(f"{where}: R3 is on but vLLM returned no routed_experts")
            routed = check_routed_experts(
                comp.routed_experts, prompt_len + len(ids) - 1, self.info.top_k, self.info.num_experts
            )
        return ids, check_finite_logprobs(sampled_logprobs(ids, comp.logprobs, where), where), routed

    def _episodes(
        self, requests: list[PromptRequest], sampling: SamplingSpec, indices: list[int] | None
    ) -> list[Sample]:
        """Multi-turn `generate` (`rollout.env`): `sampling.n` episodes per request, advanced turn by turn by
        rollout.env.run_episodes with one engine call a turn for all live episodes. Episode j of request i
        samples its turn t with seed request_seed(i) + j + t * TURN_SEED_STRIDE."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from rl.core import user_code
        from rollout.env import TOOL_PARSERS, EpisodeLimits, TurnOutput, run_episodes

        rollout = self.spec.rollout
        env_cls = user_code.resolve("rollout.env", rollout.env)
        order = range(len(requests)) if indices is None else indices
        if len(order) != len(requests):
            raise ValueError(f"generate: {len(requests)} requests but {len(order)} indices")
        envs, prompts, seeds, owners = [], [], [], []
        for req, i in zip(requests, order):
            base = sampling.request_seed(i)
            for j in range(sampling.n):
                envs.append(env_cls(dict(req.row or {}), **rollout.env_kwargs))
                prompts.append(list(req.prompt_ids))
                seeds.append(None if base is None else base + j)
                owners.append(req)
        capture = self.spec.return_routed_experts and self.info.is_moe

        def engine(contexts, turn_seeds, max_tokens):
            params = [
                SamplingParams(
                    n=1,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k if sampling.top_k > 0 else -1,
                    max_tokens=m,
                    seed=seed,
                    stop_token_ids=sampling.stop_token_ids,
                    logprobs=0,
                    detokenize=False,
                )
                for seed, m in zip(turn_seeds, max_tokens)
            ]
            prompts_ = [TokensPrompt(prompt_token_ids=list(c)) for c in contexts]
            outputs = self.llm.generate(prompts_, params, lora_request=self._lora, use_tqdm=False)
            turn = []
            for ctx, out in zip(contexts, outputs):
                comp = out.outputs[0]
                where = f"episode turn of {len(ctx)} context tokens"
                ids, logp, routed = self._completion(comp, len(ctx), capture, where)
                cached = getattr(out, "num_cached_tokens", 0) or 0
                turn.append(TurnOutput(ids, logp, str(comp.finish_reason), routed, cached))
            return turn

        max_total = rollout.max_total_tokens or rollout.max_prompt_len + rollout.max_response_len
        limits = EpisodeLimits(rollout.max_turns, max_total, rollout.env_workers, rollout.env_timeout_s)
        episodes = run_episodes(
            envs,
            prompts,
            seeds,
            engine,
            self._tokenizer(),
            limits,
            sampling.max_tokens,
            TOOL_PARSERS[rollout.tool_parser],
            self.spec.chat_template_kwargs,
        )
        samples = []
        for req, e in zip(owners, episodes):
            samples.append(
                Sample(
                    prompt_ids=e.prompt_ids,
                    response_ids=e.response_ids,
                    response_logprobs=np.asarray(e.logprobs, dtype=np.float32),
                    finish_reason=e.finish_reason,
                    adapter_version=self.version,
                    group=req.group,
                    data_source=req.data_source,
                    ground_truth=req.ground_truth,
                    loss_mask=np.asarray(e.mask, dtype=bool),
                    routed_experts=e.routed,
                    episode=e.info,
                )
            )
        if capture and self.spec.routing_by_reference:
            import ray

            for s in samples:
                s.routing_ref, s.routed_experts = ray.put(s.routed_experts), None
        return samples

    def _tokenizer(self):
        """The checkpoint's tokenizer (its chat template renders the environment's messages)."""
        if getattr(self, "_tok", None) is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(
                self.spec.model_path, trust_remote_code=self.spec.trust_remote_code
            )
        return self._tok

    def prompt_logprobs(self, token_ids_list: list[list[int]], use_adapter: bool = True) -> list[np.ndarray]:
        """Teacher-forced log p(ids[i] | ids[:i]) for i >= 1 (length len(ids) - 1), at temperature 1.

        vLLM computes prompt log-probs from the raw logits whatever `logprobs_mode` says.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_awake("prompt_logprobs")
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in token_ids_list]
        outputs = self.llm.generate(
            prompts, params, lora_request=self._lora if use_adapter else None, use_tqdm=False
        )
        result = []
        for ids, out in zip(token_ids_list, outputs):
            result.append(sampled_logprobs(list(ids)[1:], list(out.prompt_logprobs)[1:], "prompt_logprobs"))
        return result

    # ---- weight sync ------------------------------------------------------------------------------
    def load_adapter(self, adapter: dict | str | Path, peft_config: dict | None, version: int) -> dict:
        """Load a PEFT adapter (tensors + adapter_config dict, or a PEFT directory) as `version`."""
        from vllm.lora.request import LoRARequest

        start = time.perf_counter()
        if not self.spec.enable_lora:
            raise RuntimeError(
                "load_adapter: this engine has EngineSpec.enable_lora=False (merged sync mode); "
                "use load_merged_weights"
            )
        self._check_awake("load_adapter")
        if isinstance(adapter, (str, Path)):
            tensors, saved_config = read_peft_dir(adapter)
            peft_config = peft_config or saved_config
        elif peft_config is None:
            raise ValueError("load_adapter: adapter tensors given without peft_config (adapter_config.json)")
        else:
            tensors = adapter
        stacked = stacked_experts(self.spec, self.info)
        tensors, config = peft_to_vllm(tensors, peft_config, stacked_experts=stacked)
        if config["r"] > self.spec.max_lora_rank:
            raise ValueError(
                f"load_adapter: adapter rank {config['r']} > EngineSpec.max_lora_rank "
                f"{self.spec.max_lora_rank}"
            )

        def write(d: Path):
            write_safetensors(d / ADAPTER_WEIGHTS, tensors)  # views sharing memory: see peft_to_vllm
            (d / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1))

        self._lora_ids += 1
        # vLLM caches KV blocks per adapter name, so the name is unique to this load.
        name = f"adapter-v{version}-{self._lora_ids}"
        path = self.stage.stage(name, write)
        staged = time.perf_counter()
        request = LoRARequest(
            lora_name=name, lora_int_id=self._lora_ids, lora_path=str(path), is_3d_lora_weight=stacked
        )
        # add_lora loads eagerly: a broken adapter fails here, during sync, not at the next generate.
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"load_adapter: vLLM did not load adapter {name} from {path}")
        old, old_dir = self._lora, self._staged
        self._lora, self._staged, self.version = request, name, version
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
        if old_dir:
            self.stage.remove(old_dir)
        self.llm.reset_prefix_cache()
        return _sync_metrics(path, start, staged)

    def load_merged_weights(self, named_tensors: dict, version: int) -> dict:
        """Load merged weights (Hugging Face names; fused experts allowed) into the running engine."""
        from safetensors import safe_open

        start = time.perf_counter()
        if self.spec.enable_lora:
            raise RuntimeError(
                "load_merged_weights: this engine has EngineSpec.enable_lora=True (adapter "
                "sync mode); use load_adapter"
            )
        if self.info.quantization:
            raise RuntimeError(
                f"load_merged_weights: the rollout checkpoint is quantized "
                f"({self.info.quantization}); merged sync needs unquantized weights"
            )
        self._check_awake("load_merged_weights")
        tensors = merged_to_checkpoint(named_tensors)
        base = _checkpoint_index(self.spec.model_path)
        unknown = sorted(set(tensors) - set(base))
        if unknown:
            raise KeyError(
                f"load_merged_weights: {len(unknown)} names are not in the checkpoint "
                f"{self.spec.model_path}, e.g. {unknown[:3]}"
            )
        # vLLM processes a fused layer once all its parts arrived; send the untouched parts of every
        # block the update touches (rollout.adapter_layout.sibling_prefix).
        blocks = {sibling_prefix(n) for n in tensors}
        missing = [n for n in base if n not in tensors and sibling_prefix(n) in blocks]
        for file in sorted({base[n] for n in missing}):
            with safe_open(file, framework="pt", device="cpu") as f:
                for n in missing:
                    if base[n] == file:
                        tensors[n] = f.get_tensor(n)
        name = f"merged-v{version}"
        path = self.stage.stage(name, lambda d: write_safetensors(d / "model.safetensors", tensors))
        staged = time.perf_counter()
        counts = self.llm.collective_rpc("sparkrl_reload_weights", args=([str(path / "model.safetensors")],))
        if any(c != len(tensors) for c in counts):
            raise RuntimeError(f"load_merged_weights: workers loaded {counts} of {len(tensors)} tensors")
        old_dir, self._staged, self.version = self._staged, name, version
        if old_dir and old_dir != name:
            self.stage.remove(old_dir)
        self.llm.reset_prefix_cache()
        return _sync_metrics(path, start, staged)

    # ---- colocated placement ----------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the GPU for the trainer: level 1 offloads the weights to CPU memory and drops the KV cache."""
        if not self.spec.enable_sleep_mode:
            raise RuntimeError("sleep: the engine was built with EngineSpec.enable_sleep_mode=False")
        if not self._sleeping:
            self.llm.sleep(level=level)
            self._sleeping = True

    def wake_up(self) -> None:
        if self._sleeping:
            self.llm.wake_up()
            self._sleeping = False
            # The KV cache was dropped while asleep; no cached prefix may point into it.
            self.llm.reset_prefix_cache()

    # ---- housekeeping -----------------------------------------------------------------------------
    def ping(self) -> dict:
        return {
            "pid": os.getpid(),
            "version": self.version,
            "sleeping": self._sleeping,
            "engine_in_process": self.in_process,
            "node_ip": ray.util.get_node_ip_address(),
            # where this worker's engine reads its weights from: its own node's staging directory
            "staged": str(self.stage.dir / self._staged) if self._staged else None,
        }

    def shutdown(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            core = getattr(llm.llm_engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del llm
            gc.collect()
        self.lora_configs.restore()
        self.stage.cleanup()

    def _check_awake(self, what: str) -> None:
        if self.llm is None:
            raise RuntimeError(f"{what}: the worker was shut down")
        if self._sleeping:
            raise RuntimeError(f"{what}: the engine is asleep; call wake_up() first")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _checkpoint_index(model_path: str) -> dict[str, str]:
    """{tensor name: safetensors file} of a checkpoint (a directory, or a Hugging Face id in the cache)."""
    from safetensors import safe_open

    path = Path(model_path)
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(model_path, allow_patterns=["*.safetensors"], local_files_only=True))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {path} (merged sync reads the base checkpoint)")
    index = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                index[name] = str(file)
    return index
