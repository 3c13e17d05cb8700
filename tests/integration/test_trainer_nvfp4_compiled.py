"""The trainer's compiled layers (`trainer.compile`: each decoder layer through torch.compile, inside whole-layer
activation checkpointing, as the Muse recipe runs them) over the frozen base held NVFP4 against the same
compiled layers over its BF16 twin: one gloo rank, the tiny Muse quantized with `sparkrl quantize`, bf16
compute (the GPU's), LoRA rank 8 on attention, latent projections and experts (the grouped expert path), R3
replaying given routing on some samples. The worker compiles on CUDA only; here its `parallelize` is
called with compile on and the backend of tests/integration/test_trainer_compile.py (inductor's graphs and
partitioner run eagerly: the CPU trainer never runs inductor's generated code). The dequantization happens
in FSDP2's post-all-gather, outside the compiled graphs, so the graphs see the twin's weights bit for bit:
the update's log-probs, loss and every LoRA gradient equal (torch.equal)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.multiprocessing as mp

from trainer.rendezvous import free_port

from .test_trainer_nvfp4_base import _samples, _spec

pytestmark = pytest.mark.slow

BACKEND = "aot_eager_decomp_partition"


def _rank_main(rank, world, port, nvfp4, cache, out_dir):
    from torch._dynamo.utils import counters

    import trainer.worker as worker_mod
    from trainer.lora_experts import allow_on_cpu

    os.environ["SPARKRL_CACHE"] = cache
    allow_on_cpu(True)  # the compiled GPU path runs expert LoRA as grouped matmuls
    parallelize = worker_mod.parallelize
    worker_mod.parallelize = lambda *a, **kw: parallelize(
        *a, **{**kw, "compile": True, "compile_backend": BACKEND}
    )
    results = {}
    # One compile for both: the graphs take the dequantized weights as inputs, so the twin's trainer may
    # run the graphs the packed one compiled (and must give the same values through them).
    for fmt in ("nvfp4", "bf16"):
        counters.clear()
        spec = _spec(nvfp4, fmt, "bfloat16")
        # rank 8: widths the grouped expert kernel takes, the path compiled layers run on the GPU
        spec = dataclasses.replace(spec, lora=dataclasses.replace(spec.lora, rank=8, alpha=16.0))
        w = worker_mod.TrainerWorker(rank, world, "127.0.0.1", port, spec)
        cfg = w.hf_model.config
        samples = _samples(cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.num_experts)
        # the update's own forward scores the batch (on-policy): its log-probs come back with the step
        step, logp = w.train_step(samples, [1.0, -0.5, 0.3, 0.7, -1.2], return_logprobs=True)
        results[fmt] = {
            "logp": logp,
            "step": step,
            "grads": w.gradients(),
            "graphs": counters["stats"]["unique_graphs"],
        }
        del w
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from rl.quantize import quantize
    from rl.tiny import make_tiny

    root = tmp_path_factory.mktemp("muse")
    nvfp4 = quantize(make_tiny("muse"), root / "nvfp4")
    mp.spawn(
        _rank_main, args=(1, free_port(), str(nvfp4), str(root / "cache"), str(root)), nprocs=1, join=True
    )
    return torch.load(root / "rank0.pt", weights_only=False)


def test_compiled_layers_over_the_packed_base_are_bitwise_the_twins(results):
    a, b = results["nvfp4"], results["bf16"]
    assert a["graphs"] > 0  # the layers went through torch.compile
    assert len(a["logp"]) == len(b["logp"]) > 0
    for x, y in zip(a["logp"], b["logp"]):
        assert x.dtype == y.dtype and x.shape == y.shape and (x == y).all()
    assert a["step"]["r3/replayed_fraction"] == b["step"]["r3/replayed_fraction"] > 0
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert a["step"][k] == b["step"][k], k
    assert set(a["grads"]) == set(b["grads"]) and any("experts" in k for k in a["grads"])
    for k in a["grads"]:
        assert torch.equal(a["grads"][k], b["grads"][k]), k
        assert a["grads"][k].abs().sum() > 0, k
