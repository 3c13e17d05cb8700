"""The trainer on 2 gloo ranks (real Ray actors through TrainerGroup, FSDP2, activation checkpointing,
R3) against a plain single-process reference of the same math (trainer.testing: one sequence at a time,
no padding, no FSDP): one optimizer step, then PPO mini-batches over two epochs with the KL loss and the
entropy bonus, and resume. No fakes; the LoRA B matrices start random (not PEFT's zeros) so that every
gradient is non-zero and the comparison means something."""

import copy
import dataclasses

import numpy as np
import pytest
import ray
import torch

from rl.core.algo import AlgoConfig
from rl.core.compat import hf_checkpoint_state_dict
from rl.tiny import make_tiny
from trainer.checkpoint_io import write_adapter
from trainer.config import LoraConfig, TrainerConfig
from trainer.group import TrainerGroup
from trainer.lora import apply_lora
from trainer.minibatch import mini_batch_plan
from trainer.optim import make_optimizer
from trainer.routing_replay import RoutingReplay
from trainer.spec import TrainerSpec
from trainer.testing import live_routing, random_samples, reference_logprobs, reference_loss

pytestmark = pytest.mark.slow

ALGO = AlgoConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
# No micro-batch token budget: micro-batches of 2 sequences. compile is ignored on CPU; off for clarity.
TRAINER = TrainerConfig(
    lr=1e-2,
    grad_clip=0.5,
    warmup_steps=2,
    lr_schedule="cosine",
    weight_decay=0.01,
    micro_batch_tokens=0,
    micro_batch_size=2,
    activation_checkpointing=True,
    compile=False,
)
OPTIMIZER_STEPS = 10


def make_spec(**changes) -> TrainerSpec:
    spec = TrainerSpec(
        model_path=str(make_tiny("qwen3_moe")),
        dtype="float32",  # exact comparisons on CPU; bf16 compute is the GPU default
        # rank 8: a rank the grouped expert path (trainer/lora_experts.py, GPU only) would take
        lora=LoraConfig(rank=8, alpha=16.0),
        trainer=copy.deepcopy(TRAINER),
        optimizer_steps=OPTIMIZER_STEPS,
        algo=ALGO,
        max_seq_len=32,
        r3=True,
        seed=1,
        init_lora_weights=False,
    )
    return dataclasses.replace(spec, **changes)


# One prompt (2 samples: random_samples' groups) per optimizer step, two epochs, the KL loss to the base
# model and the entropy bonus on; a smaller lr keeps Adam's ill-conditioned elements (|g| ~ eps, where
# rounding moves a step by up to lr) from drifting the two sides apart over six steps.
MB_ALGO = dataclasses.replace(ALGO, kl_coef=0.1, entropy_coeff=0.01)
MB_TRAINER = dataclasses.replace(TRAINER, lr=1e-3, weight_decay=0.0, mini_batch_size=1, ppo_epochs=2)


def mb_spec() -> TrainerSpec:
    return make_spec(algo=MB_ALGO, trainer=copy.deepcopy(MB_TRAINER))


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    spec = make_spec()
    base = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=torch.float32)
    model = apply_lora(base, spec.lora, spec.seed, init_lora_weights=False)
    model.eval()
    return model, RoutingReplay(base)


@pytest.fixture(scope="module")
def batch(reference):
    """5 samples (ranks get 3 and 2: one rank pads with an empty micro-batch): replayed own routing,
    replayed foreign ids, and no routing at all. Samples 1 and 2 are laid out as an episode of two turns:
    sampled tokens, tokens an environment put in (Sample.loss_mask False: no loss, no k3, no entropy; their
    rollout log-probs are junk), sampled tokens again; the reference drops the same tokens."""
    model, _ = reference
    samples = random_samples(5, seed=7)
    rng = np.random.default_rng(0)
    for i, s in enumerate(samples):
        if i in (0, 3):
            s.routed_experts = live_routing(model, s.prompt_ids + s.response_ids)
        elif i in (1, 4):
            s.routed_experts = rng.integers(0, 8, (s.num_tokens - 1, 4, 2)).astype(np.uint8)
        if i in (1, 2):
            n = len(s.response_ids)
            first = max(1, n // 3)
            s.loss_mask = np.ones(n, dtype=bool)
            s.loss_mask[first : first + max(1, n // 3)] = False
            s.response_logprobs[~s.loss_mask] = 5.0
    advantages = [1.0, -0.5, 0.7, -1.2, 0.3]
    with torch.no_grad():
        ref_lp = [reference_logprobs(model, s, reference[1]) for s in samples]
    # Old log-probs off by up to +-0.4 so that some ratios are clipped.
    old = [
        (lp + torch.from_numpy(rng.uniform(-0.4, 0.4, len(lp)).astype(np.float32))).numpy() for lp in ref_lp
    ]
    return samples, advantages, old, ref_lp


@pytest.fixture(scope="module")
def group():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    g = TrainerGroup(make_spec(), num_ranks=2)
    yield g
    g.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def mb_group(group):
    """A group of mb_spec(): mini-batches over two epochs, the KL loss and the entropy bonus."""
    group.shutdown()  # this file's 2 CPUs hold one group at a time
    g = TrainerGroup(mb_spec(), num_ranks=2)
    yield g
    g.shutdown()


def test_two_ranks_match_the_single_process_reference(group, reference, batch, tmp_path_factory):
    model, replay = reference
    samples, advantages, old, ref_lp = batch

    logps, metrics = group.log_probs(samples)
    for got, want in zip(logps, ref_lp):
        assert got.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want.numpy(), atol=2e-5)
    # 4 of 5 samples are replayed, on every row that predicts a token (all but its last)
    routed_rows = sum(s.num_tokens - 1 for s in samples if s.routed_experts is not None)
    assert metrics["r3/replayed_fraction"] == pytest.approx(
        routed_rows / sum(s.num_tokens - 1 for s in samples)
    )

    # One step: loss, metrics and gradients against the reference.
    model.zero_grad(set_to_none=True)
    loss, ref_metrics = reference_loss(model, samples, advantages, old, ALGO, replay)
    loss.backward()
    step = group.train_step(samples, advantages, old)
    assert step["actor/pg_loss"] == pytest.approx(float(loss.detach()), rel=1e-4, abs=1e-6)
    assert step["actor/pg_clipfrac"] == pytest.approx(ref_metrics["actor/pg_clipfrac"], abs=1e-6)
    assert 0 < step["actor/pg_clipfrac"] < 1
    assert step["actor/lr"] == pytest.approx(TRAINER.lr / TRAINER.warmup_steps)  # first warm-up step
    assert step["perf/train_tokens"] == sum(s.num_tokens for s in samples)

    params = {n.replace(".default.", "."): p for n, p in model.named_parameters() if p.requires_grad}
    ref_norm = torch.nn.utils.clip_grad_norm_(list(params.values()), TRAINER.grad_clip)
    assert step["actor/grad_norm"] == pytest.approx(float(ref_norm), rel=1e-4)
    assert step["actor/grad_norm"] > TRAINER.grad_clip  # so clipping was exercised
    grads = group.gradients()  # as the optimizer saw them: summed over ranks and micro-batches, clipped
    assert set(grads) == set(params)
    for name, g in grads.items():
        torch.testing.assert_close(
            g, params[name].grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
    # R3 reaches the experts: every expert LoRA weight has a gradient
    assert all(grads[n].abs().max() > 0 for n in grads if ".experts." in n)

    # The update: AdamW with the same hyper-parameters on the reference.
    opt = torch.optim.AdamW(
        list(params.values()), lr=TRAINER.lr / TRAINER.warmup_steps, weight_decay=TRAINER.weight_decay
    )
    opt.step()
    adapter, config = group.export_adapter()
    from peft import get_peft_model_state_dict

    assert set(adapter) == set(get_peft_model_state_dict(model))
    assert config["r"] == 8 and sorted(config["target_parameters"]) == [
        "mlp.experts.down_proj",
        "mlp.experts.gate_up_proj",
    ]
    step_lr = TRAINER.lr / TRAINER.warmup_steps
    for name, v in adapter.items():
        # Adam's first step is lr * g / (|g| + eps): where |g| is within rounding of eps (1e-8) the step
        # is ill-conditioned (any rounding moves it by up to lr), so those elements are held to one step;
        # every other element must match tightly.
        want, g = params[name].detach(), params[name].grad
        well = g.abs() > 1e-6
        torch.testing.assert_close(
            v[well], want[well], rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )
        assert (v - want).abs().max() <= 1.01 * step_lr, name
        assert well.float().mean() > 0.5, name  # most elements are held tightly

    # Merged export: PEFT's own merge of the exported adapter, in on-disk names (per-expert keys).
    merged = group.export_merged()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in twin.named_parameters():
            if p.requires_grad:
                p.copy_(adapter[n.replace(".default.", ".")])
    twin = twin.merge_and_unload()
    want = hf_checkpoint_state_dict(twin, twin.state_dict())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in merged and set(merged) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(merged[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_cpu_ranks_use_gloo_with_one_worker_thread(group):
    """TrainerWorker's process group on CPU is trainer/gloo.py's: torch's gloo with two worker threads
    corrupted a rank's heap now and then."""

    def process_group(worker) -> tuple[str, int]:  # defined here: Ray pickles it by value
        import torch.distributed as dist

        from trainer.gloo import worker_threads

        return dist.get_backend(), worker_threads()

    per_rank = ray.get([w.__ray_call__.remote(process_group) for w in group.workers])
    assert per_rank == [("gloo_threads1", 1)] * 2


def test_bad_input_is_named_and_no_rank_hangs(group, batch, tmp_path):
    samples, advantages, _, _ = batch
    long = random_samples(1, seed=5, prompt_len=(20, 21), response_len=(20, 21))
    with pytest.raises(
        ValueError, match=r"sample 1: 20 prompt \+ 20 response tokens = 40, over the trainer's max_seq_len 32"
    ):
        group.log_probs(samples[:1] + long)
    bad = copy.deepcopy(samples[0])
    bad.routed_experts[0, 0, 0] = 9
    with pytest.raises(ValueError, match=r"expert ids 0\.\.9, but the model has 8 experts"):
        group.train_step([bad] + samples[1:], advantages)
    # An adapter of another rank does not load.
    adapter, config = group.export_adapter()
    # The sync's export: cast on the trainer side to the model dtype, same keys, same values rounded.
    half, half_config = group.export_adapter(dtype="bfloat16")
    assert half_config == config and set(half) == set(adapter)
    for k, v in half.items():
        assert adapter[k].dtype == torch.float32 and v.dtype == torch.bfloat16
        assert torch.equal(v, adapter[k].to(torch.bfloat16)), k
    # The driver's sync leaves the tensors in Ray's object store: the same adapter by reference.
    ref, ref_config = group.export_adapter_ref(dtype="bfloat16")
    by_ref = ray.get(ref)
    assert ref_config == config and set(by_ref) == set(half)
    assert all(torch.equal(by_ref[k], half[k]) for k in half)
    wrong = {
        k: torch.zeros(v.shape[0] * 2, *v.shape[1:]) if ".lora_A." in k else v for k, v in adapter.items()
    }
    write_adapter(tmp_path / "wrong", wrong, config)
    with pytest.raises(
        ValueError,
        match=r"does not match the model\n(.*\n)*.*k_proj.lora_A.weight: shape \(16, 128\), the model has",
    ):
        group.load_adapter(str(tmp_path / "wrong"))
    # the group still works after rejecting all of these
    logps, _ = group.log_probs(samples)
    assert len(logps) == len(samples)


def test_one_on_policy_step_scores_the_batch_in_its_own_forward(group, batch, tmp_path):
    """train_step(return_logprobs=True), what the driver runs for a batch of one on-policy step: the
    log-probs from the update's forward are those `log_probs` gives before the step, and the step is the one
    taken with them passed as the old log-probs."""
    samples, advantages, _, _ = batch
    assert group.can_score_in_update(samples)
    before, _ = group.log_probs(samples)
    with pytest.raises(ValueError, match="return_logprobs needs one on-policy optimizer step"):
        group.train_step(samples, advantages, before, return_logprobs=True)
    group.save_checkpoint(str(tmp_path / "ckpt"))
    fused, scored = group.train_step(samples, advantages, return_logprobs=True)
    fused_adapter, _ = group.export_adapter()
    for got, want in zip(scored, before):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert fused["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-7)

    group.load_checkpoint(str(tmp_path / "ckpt"))
    separate = group.train_step(samples, advantages, before)
    separate_adapter, _ = group.export_adapter()
    for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "r3/replayed_fraction"):
        assert fused[k] == pytest.approx(separate[k], rel=1e-5, abs=1e-7), k
    for k, v in fused_adapter.items():
        torch.testing.assert_close(
            v, separate_adapter[k], rtol=1e-5, atol=1e-7, msg=lambda m, k=k: f"{k}: {m}"
        )


def _held_by_an_actor(samples):
    """Copies of the samples whose routing is in the object store, put there and owned by another actor,
    as a run's rollout worker returns them (Sample.routing_ref); -> (copies, the owning actor)."""

    class Holder:  # defined here: Ray pickles it by value (the workers cannot import this test module)
        def put(self, arrays):
            return [ray.put(a) for a in arrays]

    holder = ray.remote(Holder).options(num_cpus=0).remote()
    refs = iter(
        ray.get(holder.put.remote([s.routed_experts for s in samples if s.routed_experts is not None]))
    )
    copies = copy.deepcopy(samples)
    for s in copies:
        if s.routed_experts is not None:
            s.routing_ref, s.routed_experts = next(refs), None
    return copies, holder


def test_routing_held_by_reference_is_fetched_by_the_ranks(group, batch):
    """Routing by reference (owned by another actor, as a run's rollout worker owns it) scores exactly as
    by value, and the caller's samples keep their references."""
    samples, _, _, _ = batch
    by_value, _ = group.log_probs(samples)
    by_ref, holder = _held_by_an_actor(samples)
    try:
        got, _ = group.log_probs(by_ref)
    finally:
        ray.kill(holder)
    for g, w in zip(got, by_value):
        np.testing.assert_array_equal(g, w)
    assert sum(s.routing_ref is not None for s in by_ref) == 4 and all(
        s.routed_experts is None for s in by_ref
    )


def test_mini_batches_epochs_kl_and_entropy_match_the_reference(mb_group, batch):
    """Six optimizer steps over one batch (3 prompts x 2 epochs), on-policy (old log-probs from the pass
    before the first update), against the same steps taken by the single-process reference."""
    samples, advantages, _, _ = batch
    spec = mb_spec()
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=torch.float32)
    model = apply_lora(base, spec.lora, spec.seed, init_lora_weights=False)
    model.eval()
    replay = RoutingReplay(base)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, sched = make_optimizer(params, spec.trainer, spec.optimizer_steps)
    with torch.no_grad():
        old = [reference_logprobs(model, s, replay) for s in samples]
        with model.disable_adapter():
            ref = [reference_logprobs(model, s, replay) for s in samples]
    plan = mini_batch_plan([s.group for s in samples], 1, 2, spec.seed, 0)
    assert len(plan) == 6 and all(len(step) in (1, 2) for step in plan)  # groups of 2, 2 and 1
    want = {"actor/pg_loss": [], "actor/kl_loss": [], "actor/entropy_loss": [], "actor/ppo_kl": []}
    lrs = []
    for step in plan:

        def pick(xs, step=step):
            return [xs[i] for i in step]

        opt.zero_grad(set_to_none=True)
        loss, m = reference_loss(
            model, pick(samples), pick(advantages), pick(old), MB_ALGO, replay, ref_logprobs=pick(ref)
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, spec.trainer.grad_clip)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        for k in want:
            want[k].append(m[k])

    mb = mb_group
    # six steps: the old log-probs come from a pass of their own
    assert not mb.can_score_in_update(samples)
    got = mb.train_step(samples, advantages)
    assert got["actor/optimizer_steps"] == 6
    assert got["actor/lr"] == pytest.approx(lrs[0])
    for k, values in want.items():
        assert got[k] == pytest.approx(np.mean(values), rel=2e-3, abs=1e-4), k
    # The first mini-batch trains on-policy (ratio 1); the later ones see a moved policy.
    assert want["actor/ppo_kl"][0] == pytest.approx(0.0, abs=1e-7) and abs(got["actor/ppo_kl"]) > 1e-6
    assert got["actor/kl_loss"] > 0  # the adapter (random B) moves the policy off the base model
    logps, _ = mb.log_probs(samples)
    with torch.no_grad():
        after = [reference_logprobs(model, s, replay) for s in samples]
    for g, w in zip(logps, after):
        np.testing.assert_allclose(g, w.numpy(), atol=1e-3)


def test_resume_gives_the_same_next_step(mb_group, batch, tmp_path):
    """Last in this file: with mini-batches (6 optimizer steps a batch), a step after a resume, in the same
    processes and in fresh ones, equals the uninterrupted step bit for bit. On the mini-batch test's group
    (a batch in, when that test ran)."""
    samples, advantages, old, _ = batch
    second = random_samples(4, seed=11)
    adv2 = [0.5, -1.0, 1.5, -0.2]
    group = mb_group
    batches_before = group.batches
    try:
        first = group.train_step(samples, advantages, old)
        assert first["actor/optimizer_steps"] == 6
        group.save_checkpoint(str(tmp_path / "ckpt"))
        uninterrupted = group.train_step(second, adv2)
        assert uninterrupted["actor/optimizer_steps"] == 4  # 2 prompts x 2 epochs
        after, _ = group.export_adapter()

        step = group.load_checkpoint(str(tmp_path / "ckpt"))
        assert step == batches_before + 1
        resumed = group.train_step(second, adv2)
        again, _ = group.export_adapter()
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/entropy", "actor/kl_loss"):
            assert resumed[k] == uninterrupted[k], k  # exactly
        for k in after:
            assert torch.equal(after[k], again[k]), k
    finally:
        group.shutdown()  # the CPUs go to the fresh group

    # A fresh set of processes (a restarted run) resumes to the same step too.
    fresh = TrainerGroup(mb_spec(), num_ranks=2)
    try:
        assert fresh.load_checkpoint(str(tmp_path / "ckpt")) == step
        restarted = fresh.train_step(second, adv2)
        for k in ("actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/entropy", "actor/kl_loss"):
            assert restarted[k] == uninterrupted[k], k
        final, _ = fresh.export_adapter()
        assert all(torch.equal(after[k], final[k]) for k in after)
    finally:
        fresh.shutdown()
