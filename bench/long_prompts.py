"""`python -m bench.long_prompts --out DIR`: long prompts through the NVFP4 + LoRA + R3 engine, with vLLM's
LoRA kernel configs and with the Hopper expand configs (EngineSpec.hopper_lora_expand_block_n).

On sm90, vLLM's `lora_expand` kernel with block_n 128 gives NaN from about the 128th prompt token (vLLM
issue 48590; rollout/lora_kernels.py). Per setting of `hopper_lora_expand_block_n` (`--block-n`, 0 = vLLM's
own configs), one engine in a process of its own (a second engine in one process hung at start on vLLM
0.26), serving the recipe's adapter (rank 32, attention + experts, lora_B drawn at random as in
bench.run_all), measures:
  per prompt length (`--prompt-lens`): `--prompts` prompts of that many random tokens, sampled together
      (`--max-tokens` at temperature 1): how many sampled log-probs are NaN/inf and at which response token
      the first sits; then the prefill (teacher-forced) log-probs of prompt + response with the adapter and
      without: how many positions are not finite and where the first sits in each sequence;
  the same-engine floor of bench.kl on arithmetic prompts (`--kl-prompts` x `--kl-n`, short prompts in one
      batch): the sampled log-probs against the engine's own prefill log-probs of the same tokens, or where
      those went non-finite.
Rows go to DIR/long_prompts.json as they finish; the engine's log (which LoRA configs vLLM read) stays in
DIR/engine_<block_n>.log.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np


def first_nonfinite(values) -> dict:
    """How many of `values` are NaN / inf and the index of the first one (None when all are finite)."""
    v = np.asarray(values, dtype=np.float64)
    bad = np.flatnonzero(~np.isfinite(v))
    return {
        "n": int(v.size),
        "nan": int(np.isnan(v).sum()),
        "inf": int(np.isinf(v).sum()),
        "first": int(bad[0]) if len(bad) else None,
    }


def prefill_row(logps: list, prompt_lens: list[int]) -> dict:
    """Prefill log-probs of whole sequences (entry i scores token i + 1): non-finite counts, and per sequence
    the first non-finite token position, also counted from the response's start."""
    per_seq = [first_nonfinite(lp) for lp in logps]
    firsts = [s["first"] + 1 for s in per_seq if s["first"] is not None]
    return {
        "positions": sum(s["n"] for s in per_seq),
        "nan": sum(s["nan"] for s in per_seq),
        "inf": sum(s["inf"] for s in per_seq),
        "sequences_bad": len(firsts),
        "first_bad_position_min": min(firsts) if firsts else None,
        "first_bad_position_median": float(np.median(firsts)) if firsts else None,
        "first_bad_in_response": sum(
            1 for s, p in zip(per_seq, prompt_lens) if s["first"] is not None and s["first"] + 1 >= p
        ),
    }


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab - 1, size=length).tolist() for _ in range(n)]


def run_setting(model: dict, adapter: tuple, args, block_n: int, out: Path) -> list[dict]:
    """One engine with `hopper_lora_expand_block_n = block_n`, in this (fresh) process; its stdout and
    stderr (vLLM's log: which LoRA kernel configs it read) go to out/engine_<block_n>.log."""
    log_path = out / f"engine_{block_n}.log"
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    import rl.models.muse  # noqa: F401 - RolloutWorker reads config.json through AutoConfig
    from bench import kl
    from bench.engines import CONFIGS, engine_spec
    from rollout.spec import PromptRequest, SamplingSpec
    from rollout.staging import default_stage_root
    from rollout.worker import RolloutWorker

    spec = dataclasses.replace(
        engine_spec(CONFIGS["nvfp4_lora_r3"], model, args, "eager"), hopper_lora_expand_block_n=block_n
    )
    t = time.perf_counter()
    worker = RolloutWorker(spec, default_stage_root(f"long-prompts-{block_n}"))
    start_s = time.perf_counter() - t
    rows = []
    base = dict(model=model["spec"]["name"], hopper_lora_expand_block_n=block_n, engine_start_s=start_s)
    base["tuned_config_folder"] = str(worker.lora_configs.folder) if worker.lora_configs.folder else None
    try:
        worker.load_adapter(*adapter, version=1)
        vocab = model["config"]["vocab_size"]
        for length in args.prompt_lens:
            prompts = random_prompts(args.prompts, length, vocab, seed=length)
            requests = [PromptRequest(p, i) for i, p in enumerate(prompts)]
            row = dict(base, prompt_len=length, prompts=len(prompts), max_tokens=args.max_tokens)
            sampling = SamplingSpec(n=1, temperature=1.0, max_tokens=args.max_tokens, seed=1)
            try:
                samples = worker.generate(requests, sampling)
                row["sampled"] = first_nonfinite(np.concatenate([s.response_logprobs for s in samples]))
            except Exception as e:  # noqa: BLE001 - NonFiniteLogprobsError names the first bad token
                row["sampled_error"] = f"{type(e).__name__}: {str(e)[:400]}"
                samples = None
            if samples:
                seqs = [s.prompt_ids + s.response_ids for s in samples]
                for adapter_on in (True, False):
                    logps = worker.prompt_logprobs(seqs, use_adapter=adapter_on)
                    key = "prefill_adapter" if adapter_on else "prefill_no_adapter"
                    row[key] = prefill_row(logps, [len(s.prompt_ids) for s in samples])
            rows.append(row)
            print(f"long_prompts {json.dumps(row)}", flush=True)
        requests = kl.arith_requests(model["bf16"], args.kl_prompts, model["spec"]["max_operand"])
        row = dict(
            base, prompt_len="arith", prompts=len(requests), n=args.kl_n, max_tokens=args.kl_max_tokens
        )
        samples = kl.collect(worker, requests, args.kl_n, args.kl_max_tokens)
        row["sampled"] = first_nonfinite(np.concatenate([s.response_logprobs for s in samples]))
        try:
            floor = kl.same_engine_floor(worker, samples)
            row["floor"] = {k: v for k, v in floor.items() if k not in ("k3_seq_sums", "seq_tokens")}
        except ValueError as e:
            row["floor_error"] = str(e)[:600]
        rows.append(row)
        print(f"long_prompts {json.dumps(row)}", flush=True)
    finally:
        worker.shutdown()
    return rows


def make_adapter(model: dict) -> tuple:
    """The recipe's adapter on this model, lora_B drawn at random (bench.host, a trainer process of its own)."""
    from bench.engines import LORA_RANK
    from bench.host import TrainerHost
    from bench.trainer import trainer_spec

    host = TrainerHost()
    try:
        spec = trainer_spec(model["dq"], model["spec"]["name"], LORA_RANK, "all", False, ac=True)
        host.call("create_trainer", "adapter", spec)
        host.call("perturb_lora_b", "adapter", 2e-3, 0)
        tensors, config, _ = host.call("export_adapter", "adapter")
    finally:
        host.close()
    return tensors, config


def main(argv=None) -> int:
    from bench.models import NAMES, build, spec_for

    p = argparse.ArgumentParser(prog="python -m bench.long_prompts", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="directory for long_prompts.json (created)")
    p.add_argument("--root", required=True, help="where the bench models are built (bench.models)")
    p.add_argument("--model", default="qwen3_moe", choices=NAMES)
    p.add_argument("--block-n", default="0,32", help="hopper_lora_expand_block_n per engine (0: vLLM's)")
    p.add_argument("--prompt-lens", default="128,512,2048")
    p.add_argument("--prompts", type=int, default=8, help="prompts per length, sampled in one batch")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kl-prompts", type=int, default=128)
    p.add_argument("--kl-n", type=int, default=4)
    p.add_argument("--kl-max-tokens", type=int, default=64)
    p.add_argument("--gpu-mem", type=float, default=0.5)
    args = p.parse_args(argv)
    args.prompt_lens = [int(v) for v in args.prompt_lens.split(",")]
    block_ns = [int(v) for v in args.block_n.split(",")]
    # what bench.engines.engine_spec reads
    args.tiny, args.max_num_seqs, args.batch_sizes = False, 256, []
    args.max_model_len = max(args.prompt_lens) + args.max_tokens + 64
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        model = pool.submit(build, spec_for(args.model, False), Path(args.root), print).result()
    model["config"] = json.loads((Path(model["nvfp4"]) / "config.json").read_text())
    t = time.perf_counter()
    adapter = make_adapter(model)
    print(f"adapter: {len(adapter[0])} tensors in {time.perf_counter() - t:.0f}s", flush=True)
    rows = []
    for block_n in block_ns:
        try:
            with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
                rows += pool.submit(run_setting, model, adapter, args, block_n, out).result()
        except Exception as e:  # noqa: BLE001 - the next setting may still run
            rows.append(
                {"hopper_lora_expand_block_n": block_n, "error": f"{type(e).__name__}: {str(e)[:400]}"}
            )
        tmp = out / "long_prompts.json.tmp"
        tmp.write_text(json.dumps({"argv": sys.argv[1:], "rows": rows}, indent=1))
        os.replace(tmp, out / "long_prompts.json")
        print(f"block_n {block_n}: {len(rows)} rows so far", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
