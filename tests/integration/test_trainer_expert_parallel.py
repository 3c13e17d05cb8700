"""Expert parallelism (`trainer.expert_parallel_size`) on 4 gloo ranks (real FSDP2 and all-to-all,
torch.multiprocessing) against the trainer without it, on the same batch: EP 2 x FSDP 2 and EP 4 x FSDP 1
against EP 1 (FSDP 4), the tiny Qwen3-MoE and the tiny Muse (8 experts a layer, top-2), fp32, LoRA on
attention and on the experts with B random (every gradient non-zero), R3 replaying given routing on some samples and live on
the others, activation checkpointing on.

Compared: log-probs, entropy, loss, grad norm, every LoRA gradient, the exported adapter (all experts at
their global ids) and the merged export; a checkpoint resumed at the same layout trains the next step bit
for bit, and one written at EP 1 resumes at EP 2. The NVFP4-resident bank under EP is bitwise its BF16
twin's, as without EP."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from trainer.config import LoraConfig, TrainerConfig
from trainer.rendezvous import free_port
from trainer.spec import TrainerSpec

pytestmark = pytest.mark.slow

WORLD = 4
LAYOUTS = (1, 2, 4)
# fp32 sums of the same terms in another order (the all-to-all regroups rows; the grad norm is summed per
# rank): a few ulps
ATOL = 1e-6


def _spec(path: str, ep: int, fmt: str = "bf16") -> TrainerSpec:
    return TrainerSpec(
        model_path=path,
        dtype="float32",
        lora=LoraConfig(rank=8, alpha=16.0),
        trainer=TrainerConfig(
            lr=1e-2,
            # Adam's first step is lr * g / (|g| + eps), which moves by up to lr / eps times a change of g: at
            # the default eps (1e-8) an element whose gradient cancels to ~eps turns an ulp of difference in
            # g into ~1e-6 of the step; at 1e-3 every element is well-conditioned
            eps=1e-3,
            grad_clip=0.5,
            micro_batch_tokens=0,
            micro_batch_size=2,
            activation_checkpointing=True,
            compile=False,
            expert_parallel_size=ep,
        ),
        optimizer_steps=10,
        max_seq_len=32,
        r3=True,
        base_format=fmt,
        seed=1,
        init_lora_weights=False,
    )


def _samples(rank: int, num_layers: int, top_k: int, experts: int, step: int = 0):
    """This rank's 3 samples (rank 3 gets 2: it pads with an empty micro-batch); every other one replays
    foreign routing (R3), the rest route live."""
    from trainer.testing import random_samples

    samples = random_samples(3 if rank < 3 else 2, seed=100 * step + rank)
    rng = np.random.default_rng(10 * step + rank)
    for i, s in enumerate(samples):
        if i % 2 == 0:
            s.routed_experts = rng.integers(0, experts, (s.num_tokens - 1, num_layers, top_k)).astype(
                np.uint8
            )
    return samples


def _run(w, rank: int) -> dict:
    samples = _samples(rank, w.replay.num_layers, w.replay.top_k, w.replay.num_experts)
    advantages = [1.0, -0.5, 0.7][: len(samples)]
    lp, metrics = w.log_probs(samples)
    step = w.train_step(samples, advantages)
    return {
        "logp": lp,
        "metrics": metrics,
        "step": step,
        "grads": w.gradients(),
        "adapter": w.export_adapter(),
    }


def _next_step(w, rank: int) -> dict:
    samples = _samples(rank, w.replay.num_layers, w.replay.top_k, w.replay.num_experts, step=1)
    step = w.train_step(samples, [-1.0, 0.4, 0.9][: len(samples)])
    return {"step": step, "adapter": w.export_adapter()}


def _rank_main(rank, world, port, path, out_dir):
    from trainer.worker import TrainerWorker

    results = {}
    for ep in LAYOUTS:
        w = TrainerWorker(rank, world, "127.0.0.1", port, _spec(path, ep))
        r = _run(w, rank)
        r["merged"] = w.export_merged()
        w.save_checkpoint(os.path.join(out_dir, f"ckpt_ep{ep}"))
        r["next"] = _next_step(w, rank)
        results[ep] = r
        del w
    # resume at the same layout (EP 2), and EP 1's checkpoint at EP 2
    for key, ep, ckpt in (("resume_ep2", 2, "ckpt_ep2"), ("resume_ep1_at_ep2", 2, "ckpt_ep1")):
        w = TrainerWorker(rank, world, "127.0.0.1", port, _spec(path, ep))
        w.load_checkpoint(os.path.join(out_dir, ckpt))
        results[key] = _next_step(w, rank)
        del w
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _nvfp4_rank_main(rank, world, port, path, cache, out_dir):
    from trainer.worker import TrainerWorker

    os.environ["SPARKRL_CACHE"] = cache
    results = {}
    for fmt in ("nvfp4", "bf16"):
        w = TrainerWorker(rank, world, "127.0.0.1", port, _spec(path, 2, fmt))
        results[fmt] = _run(w, rank)
        results[fmt]["merged"] = w.export_merged()
        del w
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module", params=["qwen3_moe", "muse"])
def results(request, tmp_path_factory):
    from rl.tiny import make_tiny

    root = tmp_path_factory.mktemp(f"ep_{request.param}")
    path = make_tiny(request.param)
    mp.spawn(_rank_main, args=(WORLD, free_port(), str(path), str(root)), nprocs=WORLD, join=True)
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=ATOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("ep", [2, 4])
def test_log_probs_loss_and_gradients_match_ep1(results, ep):
    for r in results:
        a, b = r[1], r[ep]
        assert len(a["logp"]) == len(b["logp"]) > 0
        for x, y in zip(a["logp"], b["logp"]):
            assert y.dtype == np.float32
            # log-probs of magnitude ~5: 1e-6 relative is a few ulps
            torch.testing.assert_close(torch.from_numpy(y), torch.from_numpy(x), rtol=1e-6, atol=ATOL)
        assert b["metrics"]["r3/replayed_fraction"] == a["metrics"]["r3/replayed_fraction"] > 0
        assert b["step"]["r3/replayed_fraction"] == a["step"]["r3/replayed_fraction"]
        assert b["metrics"]["actor/entropy"] == pytest.approx(a["metrics"]["actor/entropy"], abs=ATOL)
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/pg_clipfrac"):
            assert b["step"][k] == pytest.approx(a["step"][k], rel=1e-6, abs=ATOL), k
    a, b = results[0][1]["grads"], results[0][ep]["grads"]
    assert set(a) == set(b) and any(".experts." in k for k in a)
    logp = max(float(np.abs(x - y).max()) for r in results for x, y in zip(r[1]["logp"], r[ep]["logp"]))
    grad = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"EP {ep} against EP 1: log-probs max |diff| {logp:.2e}, LoRA gradients max |diff| {grad:.2e}")
    for k in a:
        assert a[k].shape == b[k].shape, k
        assert a[k].abs().sum() > 0, k
        _close(b[k], a[k], k)
    assert results[0][1]["step"]["actor/grad_norm"] > 0.5  # clipping was exercised


def test_replayed_rows_are_replayed(results):
    """R3: every row that carries a routing is replayed under EP as without it (3 of 5 samples here)."""
    for r in results:
        for ep in LAYOUTS:
            frac = r[ep]["metrics"]["r3/replayed_fraction"]
            assert 0 < frac < 1
            assert frac == r[1]["metrics"]["r3/replayed_fraction"]


@pytest.mark.parametrize("ep", [2, 4])
def test_exported_adapter_holds_every_expert_at_its_global_id(results, ep):
    (a, config_a), (b, config_b) = results[0][1]["adapter"], results[0][ep]["adapter"]
    assert config_a == config_b
    assert set(a) == set(b)
    for k in a:
        assert a[k].shape == b[k].shape, k
        _close(b[k], a[k], k)
    # after one step the experts differ from each other: a shifted expert block would not match
    key = next(k for k in a if k.endswith(".experts.lora_A.weight"))
    rank = 8
    blocks = a[key].reshape(8, rank, -1)
    assert not torch.allclose(blocks[0], blocks[4])
    for k in results[0][1]["merged"]:
        _close(results[0][ep]["merged"][k], results[0][1]["merged"][k], k)
    for r in results[1:]:
        assert r[ep]["adapter"] is None and r[ep]["merged"] is None


def test_resume_at_the_same_layout_is_bitwise(results):
    a, b = results[0][2]["next"], results[0]["resume_ep2"]
    for k in ("actor/pg_loss", "actor/grad_norm"):
        assert a["step"][k] == b["step"][k], k
    for k, v in a["adapter"][0].items():
        assert torch.equal(v, b["adapter"][0][k]), k


def test_a_checkpoint_of_ep1_resumes_at_ep2(results):
    a, b = results[0][1]["next"], results[0]["resume_ep1_at_ep2"]
    assert b["step"]["actor/pg_loss"] == pytest.approx(a["step"]["actor/pg_loss"], abs=ATOL)
    for k, v in a["adapter"][0].items():
        _close(b["adapter"][0][k], v, k)


@pytest.fixture(scope="module")
def nvfp4_results(tmp_path_factory):
    from rl.quantize import quantize
    from rl.tiny import make_tiny

    root = tmp_path_factory.mktemp("ep_nvfp4")
    nvfp4 = quantize(make_tiny("qwen3_moe"), root / "nvfp4")
    mp.spawn(
        _nvfp4_rank_main,
        args=(WORLD, free_port(), str(nvfp4), str(root / "cache"), str(root)),
        nprocs=WORLD,
        join=True,
    )
    return [torch.load(root / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_nvfp4_bank_under_ep_is_bitwise_its_bf16_twin(nvfp4_results):
    for r in nvfp4_results:
        a, b = r["nvfp4"], r["bf16"]
        for x, y in zip(a["logp"], b["logp"]):
            assert np.array_equal(x, y)
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert a["step"][k] == b["step"][k], k
    a, b = nvfp4_results[0]["nvfp4"], nvfp4_results[0]["bf16"]
    assert set(a["grads"]) == set(b["grads"])
    for k in a["grads"]:
        assert torch.equal(a["grads"][k], b["grads"][k]), k
    for k in a["merged"]:
        assert torch.equal(a["merged"][k], b["merged"][k]), k
