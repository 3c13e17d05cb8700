"""The trainer's sharded load (trainer/sharded_load.py) on real gloo process groups: every rank reads only
its rows of the checkpoint, and the sharded model holds exactly the weights transformers' own
`from_pretrained` + PEFT give a single process. 3 ranks make the shards uneven (8 experts -> 3, 3, 2)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.config import LoraConfig
from trainer.rendezvous import free_port


def _lora(model) -> LoraConfig:
    experts = any(p.dim() == 3 for p in model.parameters())
    return LoraConfig(rank=4, alpha=8.0, target_experts=experts, target_latent=experts)


def _rank_main(rank, world, port, path, activation_checkpointing, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from trainer import lora, sharded_load
    from trainer.gloo import cpu_backend
    from trainer.lora import apply_lora
    from trainer.parallelize import parallelize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(cpu_backend(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        base = sharded_load.build_empty_model(path, torch.bfloat16)
        model = apply_lora(base, _lora(base), seed=3, init_lora_weights=False)
        kept = sharded_load.hold_aside(model)
        assert all(p.is_meta for p in model.parameters())
        parallelize(
            base,
            base.model.layers,
            mesh,
            compute_dtype=torch.bfloat16,
            activation_checkpointing=activation_checkpointing,
        )
        read = sharded_load.materialize(model, path, torch.device("cpu"), kept)
        full = {
            lora.unwrapped_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()
        }
        full.update({lora.unwrapped_name(n): b.clone() for n, b in model.named_buffers()})
        if rank == 0:
            torch.save(full, os.path.join(out_dir, "state.pt"))
        torch.save(read, os.path.join(out_dir, f"read{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run(world, path, tmp_path, activation_checkpointing=False):
    mp.spawn(
        _rank_main,
        args=(world, free_port(), str(path), activation_checkpointing, str(tmp_path)),
        nprocs=world,
        join=True,
    )
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    reads = [torch.load(tmp_path / f"read{r}.pt", weights_only=True) for r in range(world)]
    return state, reads


def _reference(path):
    from rl.models import auto_causal_lm
    from trainer.lora import apply_lora

    base = auto_causal_lm().from_pretrained(path, dtype=torch.bfloat16)
    model = apply_lora(base, _lora(base), seed=3, init_lora_weights=False)
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize(
    ("arch", "world", "activation_checkpointing"),
    [("qwen3_moe", 3, False), ("muse", 2, True), ("dense", 2, False)],
)
def test_sharded_load_equals_from_pretrained(arch, world, activation_checkpointing, tmp_path):
    from rl.tiny import make_tiny

    path = make_tiny(arch)
    state, reads = _run(world, path, tmp_path, activation_checkpointing)
    want = _reference(path)
    assert set(state) == set(want)
    lora = [n for n in want if "lora_" in n]
    assert lora, "the reference has no LoRA weights"
    for name, ref in want.items():
        got = state[name]
        assert got.dtype == ref.dtype and torch.equal(got, ref.detach()), name
    # Each rank read about 1/world of the checkpoint (its rows), and together every tensor exactly once.
    from safetensors import safe_open

    ckpt_bytes = 0
    for f in path.glob("*.safetensors"):
        with safe_open(f, "pt") as s:
            ckpt_bytes += sum(s.get_tensor(k).numel() * s.get_tensor(k).element_size() for k in s.keys())
    assert sum(reads) == ckpt_bytes
    assert max(reads) < ckpt_bytes / world * 1.5


def test_a_checkpoint_that_does_not_match_the_model_is_named(tmp_path):
    """A tensor with the wrong shape (a config edited after the weights were written) names the tensor."""
    import json
    import shutil

    from rl.tiny import make_tiny

    src = make_tiny("dense")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] *= 2
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match=r"mlp\.\w+_proj\.weight has shape \[\d+, \d+\], the model expects"):
        _run(1, bad, tmp_path)
