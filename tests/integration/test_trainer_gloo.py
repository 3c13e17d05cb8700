"""The CPU trainer's process group (trainer/gloo.py) on 2 real gloo ranks: ProcessGroupGloo with one worker
thread, under which an FSDP2 step and the full state dict come out bit for bit as under torch's own "gloo"
(two worker threads)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.rendezvous import free_port


def _rank_main(rank, world, port, backend_name, out_dir):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainer.gloo import cpu_backend, worker_threads

    backend = cpu_backend() if backend_name == "trainer" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        threads = worker_threads()
        torch.manual_seed(0)
        # 7 rows over 2 ranks: an uneven shard
        model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3)), torch.nn.Linear(16, 7))
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(3):
            model(torch.randn(5, 16) + rank).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(
                {"backend": dist.get_backend(), "threads": threads, "state": state},
                os.path.join(out_dir, f"{backend_name}.pt"),
            )
    finally:
        dist.destroy_process_group()


def _run(backend_name, tmp_path):
    mp.spawn(_rank_main, args=(2, free_port(), backend_name, str(tmp_path)), nprocs=2, join=True)
    return torch.load(tmp_path / f"{backend_name}.pt", weights_only=True)


def test_the_trainers_gloo_has_one_worker_thread_and_trains_as_torchs(tmp_path):
    ours, torchs = _run("trainer", tmp_path), _run("torch", tmp_path)
    assert (ours["backend"], ours["threads"]) == ("gloo_threads1", 1)
    assert (torchs["backend"], torchs["threads"]) == ("gloo", 2)
    assert set(ours["state"]) == set(torchs["state"]) and len(ours["state"]) == 8
    for name, value in ours["state"].items():
        assert torch.equal(value, torchs["state"][name]), name
