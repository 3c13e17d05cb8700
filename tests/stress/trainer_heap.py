"""The trainer's step, round after round, on 2 gloo ranks without Ray: a search for native heap corruption
in torch, gloo and the trainer's own code alone (no Ray worker, object store or engine in the process).

Each round, on the demo recipe's tiny MoE and trainer spec: log-probs, a train step (routing replayed),
the merged export (get_model_state_dict's full gather, the demo's merged sync) and the adapter export.
Run it under glibc's heap checker, which the spawned ranks inherit:

    LD_PRELOAD=/lib/x86_64-linux-gnu/libc_malloc_debug.so.0 MALLOC_CHECK_=3 MALLOC_PERTURB_=165 \
      PYTHONFAULTHANDLER=1 .venv/bin/python tests/stress/trainer_heap.py --rounds 500

A rank that aborts takes the run down with its exit code (-6 for SIGABRT) and faulthandler's stacks on
stderr. Under tests/stress/quarantine_malloc.c, which reports a write into a freed chunk wherever it lands
(into $QM_DIR) and does not abort:

    gcc -O2 -fno-builtin -fPIC -shared -o /tmp/qm.so tests/stress/quarantine_malloc.c -lpthread
    LD_PRELOAD=/tmp/qm.so QM_DIR=/tmp/qm .venv/bin/python tests/stress/trainer_heap.py --rounds 200

and with QM_GUARD_MIN=65536 the buffers of 64 kB and over are guarded: a read or write after their free
faults where it happens (20 rounds of 8 samples: 57 s against 32 s plain, on the 2-core machine).

Under valgrind's memcheck, which flags a stray write where it happens rather than when glibc next
trips over it (about 13 minutes for 4 rounds of 8 samples a rank on the 2-core machine; the loader's own
strncmp over-reads are its only reports on a clean run):

    PYTHONMALLOC=malloc valgrind --trace-children=yes --undef-value-errors=no --error-limit=no \
      --log-file=vg.%p.log .venv/bin/python tests/stress/trainer_heap.py --rounds 4 --samples 8

Not collected by pytest.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _samples(n: int, seed: int, layers: int, top_k: int, experts: int):
    from trainer.testing import random_samples

    rng = np.random.default_rng(seed)
    out = random_samples(n, seed, prompt_len=(8, 40), response_len=(4, 33))
    for s in out:
        s.routed_experts = rng.integers(0, experts, (s.num_tokens - 1, layers, top_k)).astype(np.uint8)
    return out


def _rank(rank: int, world: int, port: int, rounds: int, n: int) -> None:
    from rl.config import load_config
    from rl.setup import resolve_model_paths, trainer_spec
    from trainer.worker import TrainerWorker

    cfg = load_config("demo_cpu", [])
    spec = trainer_spec(cfg, resolve_model_paths(cfg)[0])
    w = TrainerWorker(rank, world, "127.0.0.1", port, spec)
    start = time.perf_counter()
    for i in range(rounds):
        samples = _samples(n, 1000 * i + rank, w.replay.num_layers, w.replay.top_k, w.replay.num_experts)
        old, _ = w.log_probs(samples)
        adv = np.random.default_rng(i).normal(size=n).tolist()
        w.train_step(samples, adv, old)
        w.export_merged()
        w.export_adapter()
        if rank == 0 and (i + 1) % 10 == 0:
            print(f"round {i + 1}/{rounds}, {time.perf_counter() - start:.0f} s", flush=True)
    w.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--samples", type=int, default=32, help="samples per rank per round")
    args = p.parse_args()
    from trainer.rendezvous import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args.rounds, args.samples)) for r in range(2)]
    for proc in procs:
        proc.start()
    # a rank that died leaves the other waiting in a collective: stop it too
    while any(proc.exitcode is None for proc in procs):
        if any(proc.exitcode not in (None, 0) for proc in procs):
            for proc in procs:
                proc.terminate()
        time.sleep(1)
    codes = [proc.exitcode for proc in procs]
    print(f"ranks exited {codes}")
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
