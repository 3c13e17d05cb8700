"""Adapter sync: from the trainer's export to the first token generated with the new adapter.

One row per (rank, targets), the median of `repeats` syncs, each a new adapter version:
  export_s       trainer.export_adapter() as the driver sees it (gather to CPU + the process transfer);
  load_s         RolloutWorker.load_adapter(): PEFT -> vLLM layout, staged under /dev/shm, add_lora
                 (eager load), old adapter removed, prefix cache reset; load_stage_s / load_engine_s
                 split it into ours (conversion + write) and vLLM's, as the worker times them;
  first_token_s  a one-token generate on a fresh prompt with the new adapter;
  total_s        the three together; GB/s = staged bytes / total_s.
`stage_s` times the layout conversion and the staged write alone (no engine), and `baseline_first_token_s`
the same one-token generate with no adapter change, to tell the sync's share from generation's.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np

from bench.common import log

# (rank, targets): "attn" = q/k/v/o only; "all" = attention + every routed expert (+ Muse's latent
# pooler/unpooler): the recipes' targets.
CASES = ((8, "attn"), (8, "all"), (32, "attn"), (32, "all"))


def stage_only(tensors: dict, config: dict, stacked_experts: bool = False) -> tuple[float, int]:
    """(seconds, bytes): what load_adapter does before vLLM sees the adapter, without an engine."""
    from rollout.adapter_layout import peft_to_vllm
    from rollout.safetensors_io import write_safetensors
    from rollout.staging import default_stage_root

    root = default_stage_root("bench-sync")
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as d:
        t = time.perf_counter()
        converted, _ = peft_to_vllm(tensors, config, stacked_experts)
        write_safetensors(f"{d}/adapter_model.safetensors", converted)
        seconds = time.perf_counter() - t
        size = sum(v.numel() * v.element_size() for v in converted.values())
    return seconds, size


def _one_token(worker, seed: int, vocab: int) -> float:
    from rollout.spec import PromptRequest, SamplingSpec

    prompt = np.random.default_rng(seed).integers(10, vocab - 1, size=64).tolist()  # fresh: no cached prefix
    t = time.perf_counter()
    worker.generate([PromptRequest(prompt, 0)], SamplingSpec(max_tokens=1, seed=seed))
    return time.perf_counter() - t


def measure(
    host, trainer: str, worker, repeats: int, version0: int, vocab: int, dtype: str = "bfloat16"
) -> dict:
    """One case; `worker` None (--tiny: no MoE-LoRA engine on CPU) times the export and staging only."""
    from rollout.worker import stacked_experts

    stacked = worker is not None and stacked_experts(worker.spec, worker.info)  # the layout this engine loads
    runs = []
    for i in range(repeats):
        t0 = time.perf_counter()
        # In the model dtype, as the driver's sync ships it (the first session's figures were fp32).
        tensors, config, inner_s = host.call("export_adapter", trainer, dtype)
        t1 = time.perf_counter()
        run = {
            "export_s": t1 - t0,
            "export_inner_s": inner_s,
            "raw_bytes": sum(v.numel() * v.element_size() for v in tensors.values()),
        }
        run["stage_s"], run["staged_tensor_bytes"] = stage_only(tensors, config, stacked)
        if worker is not None:
            t2 = time.perf_counter()
            m = worker.load_adapter(tensors, config, version0 + i)
            t3 = time.perf_counter()
            run.update(
                load_s=t3 - t2,
                load_stage_s=m["perf/sync_stage_s"],  # conversion + staged write, in the engine's process
                load_engine_s=m["perf/sync_engine_s"],  # vLLM: add_lora, old adapter out, cache reset
                bytes=m["perf/sync_bytes"],
                first_token_s=_one_token(worker, 100 + i, vocab),
            )
            run["total_s"] = run["export_s"] + run["load_s"] + run["first_token_s"]
            run["baseline_first_token_s"] = _one_token(worker, 200 + i, vocab)
        runs.append(run)
    row = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    row.update(repeats=repeats, tensors=len(tensors), dtype=str(next(iter(tensors.values())).dtype))
    if worker is not None:
        row["gb_per_s"] = row["bytes"] / row["total_s"] / 1e9
        log(
            f"    sync {trainer}: {row['bytes'] / 1e6:.1f} MB in {row['total_s']:.3f}s "
            f"(export {row['export_s']:.3f}, load {row['load_s']:.3f} = ours {row['load_stage_s']:.3f} + vLLM "
            f"{row['load_engine_s']:.3f}, "
            f"first token {row['first_token_s']:.3f}) "
            f"= {row['gb_per_s']:.2f} GB/s"
        )
    else:
        log(
            f"    sync {trainer}: export {row['export_s']:.3f}s, stage {row['stage_s']:.3f}s "
            f"({row['raw_bytes'] / 1e6:.1f} MB); no engine"
        )
    return row
