"""Two gloo ranks gather FSDP2-style shards (DTensor Shard(0) -> full, as the trainer's merged export and
adapter export do) in a loop, with no model, no Ray and no checker: the smallest setting that shows the heap
corruption of the CPU trainer.

    .venv/bin/python tests/stress/gather_stress.py SECONDS [--threads N]

Each round gathers 48 tensors of 6 shapes, one all-gather at a time: torch waits on each before
`full_tensor()` returns. Every gathered tensor is compared with the full one.
--threads N: ProcessGroupGloo's worker threads, through trainer/gloo.py's backend_with_threads (torch's
"gloo" has 2; the trainer's, cpu_backend, 1).
A rank that dies of a signal (SIGSEGV, or SIGABRT from glibc's heap checks) fails the run; with
`ulimit -c unlimited` it leaves a core.

On the 2-core machine it does about 1,000 gathers a second alone. What it showed at 2 worker threads and at 1
is in trainer/gloo.py.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.gloo import backend_with_threads
from trainer.rendezvous import free_port

SHAPES = [(64, 32), (8, 16, 32), (34, 7), (128,), (4, 64, 8), (2, 3)] * 8


def _rank_main(rank, world, port, seconds, threads):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    backend = "gloo" if threads is None else backend_with_threads(threads)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        full = [torch.randn(shape) for shape in SHAPES]
        shards = [distribute_tensor(t, mesh, [Shard(0)]) for t in full]
        rounds, start = 0, time.monotonic()
        while time.monotonic() - start < seconds:
            for i, (shard, want) in enumerate(zip(shards, full)):
                if not torch.equal(shard.full_tensor(), want):
                    raise AssertionError(f"rank {rank}: round {rounds}, tensor {i} gathered wrong")
            rounds += 1
        elapsed = time.monotonic() - start
        print(f"rank {rank}: {rounds} rounds, {rounds * len(shards)} gathers in {elapsed:.0f} s", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seconds", type=float)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    mp.spawn(_rank_main, args=(2, free_port(), args.seconds, args.threads), nprocs=2, join=True)


if __name__ == "__main__":
    main()
