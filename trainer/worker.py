"""One trainer rank: the LoRA policy under FSDP2, its optimizer, and the step (a Ray actor via
`ray.remote(TrainerWorker)`; `trainer.group.TrainerGroup` drives a set of them).

Every rank runs the same number of forward/backward passes (FSDP2's collectives must pair up): a rank with
fewer micro-batches pads with empty ones whose loss is zero. Metrics returned by any rank are global
(all-reduced), so the group reports rank 0's.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from rl.core import algo, user_code
from rl.core.adapter_files import read_peft_dir
from rl.core.batch import RoutingLost, Sample
from rl.core.compat import hf_checkpoint_state_dict
from rl.core.model_info import is_moe
from rl.core.worker_logs import capture, stderr_path
from trainer import checkpoint_io, logprobs, lora, sharded_load
from trainer.batching import MicroBatch, check_lengths, in_batch_order, make_micro_batch, pack_micro_batches
from trainer.expert_parallel import check_expert_parallel, model_expert_count
from trainer.gloo import cpu_backend
from trainer.nvfp4 import is_nvfp4_checkpoint
from trainer.nvfp4_tensor import gather_frozen
from trainer.optim import make_optimizer
from trainer.parallelize import apply_ep, make_meshes, parallelize
from trainer.rendezvous import node_address
from trainer.routing_replay import RoutingReplay, moe_routers
from trainer.spec import TrainerSpec
from trainer.versions import AdapterVersions


@dataclass
class _Prepared:
    """One micro-batch with its loss inputs laid out on the logit window ([B, W] each)."""

    mb: MicroBatch
    dummy: bool
    advantages: torch.Tensor | None = None
    old_log_prob: torch.Tensor | None = None
    ref_log_prob: torch.Tensor | None = None  # the base model's (KL to the reference)
    loss_mask: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    correction: dict[str, float] | None = None  # rollout_corr/* metrics, means over response tokens

    def loss_inputs(self, logp: torch.Tensor, old: torch.Tensor, entropy, device) -> algo.LossInputs:
        """The loss's inputs on `device`: the forward's log-probs and entropy beside this batch's own."""
        return algo.LossInputs(
            log_prob=logp,
            old_log_prob=old,
            advantages=self.advantages.to(device),
            response_mask=self.loss_mask.to(device),
            is_weights=None if self.is_weights is None else self.is_weights.to(device),
            ref_log_prob=None if self.ref_log_prob is None else self.ref_log_prob.to(device),
            entropy=entropy,
        )


class TrainerWorker:
    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, spec: TrainerSpec):
        capture(f"trainer-rank{rank}")  # this rank's own output into the run's logs/ (rl/core/worker_logs.py)
        self.rank, self.world_size, self.spec = rank, world_size, spec
        # A loss named by import path is resolved here, in this rank's process: a missing file or name fails
        # the group's start, not its first step.
        algo.policy_loss_fn(spec.algo.loss_mode)
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            local = int(os.environ.get("LOCAL_RANK", 0))  # Ray sets CUDA_VISIBLE_DEVICES to one GPU
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
        else:
            self.device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group(
                "nccl" if use_cuda else cpu_backend(),  # gloo with one worker thread (trainer/gloo.py)
                init_method=f"tcp://{master_addr}:{master_port}",
                rank=rank,
                world_size=world_size,
            )
        ep_size = spec.trainer.expert_parallel_size
        if world_size % ep_size:
            raise ValueError(
                f"trainer.expert_parallel_size={ep_size} must divide trainer.num_ranks={world_size}"
            )
        # all ranks; with expert parallelism also the (dp, ep) mesh (trainer/parallelize.py)
        self.mesh, self.ep_mesh = make_meshes(self.device.type, world_size, ep_size)
        random.seed(spec.seed)
        np.random.seed(spec.seed)
        torch.manual_seed(spec.seed)

        packed = spec.base_format == "nvfp4"
        if packed and not is_nvfp4_checkpoint(spec.model_path):
            raise ValueError(f"base_format nvfp4: {spec.model_path} is not an NVFP4 checkpoint directory")
        # nvfp4: the packed checkpoint itself; bf16: its dequantized twin (or a plain checkpoint as it is)
        path = (
            spec.model_path
            if packed
            else checkpoint_io.resolve_base_model(spec.model_path, rank == 0, dist.barrier)
        )
        dtype = getattr(torch, spec.dtype)
        # The model is built, LoRA-wrapped and sharded on the meta device; each rank then reads only its
        # own rows of the base weights (trainer/sharded_load.py): host memory per rank ~ its shard.
        base = sharded_load.build_empty_model(path, dtype, spec.trust_remote_code)
        self.hf_model = base  # the causal LM inside the PEFT wrapper: FSDP root
        self.model = lora.apply_lora(base, spec.lora, spec.seed, spec.init_lora_weights)
        # R3 on a MoE model whose router no family adapter knows is an error, never a silent 0 % replay
        # (the preflight says so first, before Ray starts; this holds for any other way in, a bench included).
        if spec.r3 and is_moe(base.config.to_dict()) and not moe_routers(base):
            raise ValueError(
                f"r3: {type(base).__name__} is a MoE model whose router no model family knows "
                f"(model_type {base.config.model_type!r}); add its folder under rl/models/ or set r3.enabled=false"
            )
        self.replay = RoutingReplay(base) if moe_routers(base) else None
        # expert parallelism: this rank keeps its EP rank's experts (trainer/expert_parallel.py); None = all
        self.ep = None
        if self.ep_mesh is not None:
            check_expert_parallel(ep_size, world_size, model_expert_count(base))
            self.ep = apply_ep(self.model, self.ep_mesh, model_expert_count(base))
        self.final_hidden = logprobs.FinalHidden(base.model)  # the LM head runs in chunks on it
        self.pad_id = base.config.pad_token_id if base.config.pad_token_id is not None else 0
        kept = sharded_load.hold_aside(self.model)
        if packed:
            sharded_load.pack_frozen_weights(self.model, path, world_size, self.ep)
        parallelize(
            base,
            base.model.layers,
            self.mesh,
            compute_dtype=dtype,
            activation_checkpointing=spec.trainer.activation_checkpointing,
            compile=spec.trainer.compile and use_cuda,
            activation_memory_budget=spec.trainer.activation_memory_budget,
            expert_mesh=self.ep_mesh,
        )
        sharded_load.materialize(self.model, path, self.device, kept, self.ep)
        # trainer/base_bytes: this rank's resident bytes of the weights the checkpoint holds in NVFP4
        self.base_bytes = sharded_load.frozen_base_bytes(self.model, spec.model_path)
        self._base_bytes_reported = False
        self._routing_cache: dict[str, np.ndarray] = {}  # this batch's fetched routing, by object id
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = make_optimizer(self.params, spec.trainer, spec.optimizer_steps)
        self.step = 0  # updates so far: the adapter's version
        self.versions = AdapterVersions(self.params, spec.keep_versions)  # older ones (rollout.max_staleness)

    # ------------------------------------------------------------------------------------------------
    # Batches.

    def _all_reduce(self, values: list[float], op=dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.tolist()

    def _agree(self, check) -> None:
        """Runs check() (raises on bad input) on every rank; if any rank's check failed, every rank raises
        that rank's error (a rank that went on alone would wait forever in the next collective)."""
        error = None
        try:
            check()
        except (ValueError, TypeError) as e:
            # RoutingLost stays itself: it tells the driver to generate the batch again
            error = (RoutingLost if isinstance(e, RoutingLost) else ValueError)(str(e))
        if self._all_reduce([error is not None], dist.ReduceOp.MAX)[0]:
            self._routing_cache.clear()  # a batch that fails its check is over
            errors = [None] * self.world_size
            dist.all_gather_object(errors, error)
            raise next(e for e in errors if e is not None)

    def _fetch_routing(self, samples: list[Sample], ids: list[int]) -> None:
        """Fill routed_experts of the samples that carry a routing_ref, fetched from the rollout workers'
        object stores. Once a batch: what the log-prob pass fetched is kept for the update, which ends
        the batch (and empties the cache)."""
        pending = [s for s in samples if s.routing_ref is not None]
        missing = {
            s.routing_ref.hex(): s.routing_ref
            for s in pending
            if s.routing_ref.hex() not in self._routing_cache
        }
        if missing:
            import ray
            from ray.exceptions import ObjectLostError

            try:
                arrays = ray.get(list(missing.values()))
            except ObjectLostError as e:  # its owner, the rollout worker, or that worker's node is gone
                lost = [i for i, s in zip(ids, samples) if s.routing_ref is not None]
                raise RoutingLost(
                    f"the routing of samples {lost[:8]}{'...' if len(lost) > 8 else ''} was lost with the "
                    f"rollout worker that held it ({type(e).__name__}: {e})"
                ) from e
            # Copies: Ray hands a numpy array out of shared memory read-only and without copying, and
            # the memory goes back to the store when the reference does.
            self._routing_cache.update({k: np.array(a, copy=True) for k, a in zip(missing, arrays)})
        for s in pending:
            s.routed_experts, s.routing_ref = self._routing_cache[s.routing_ref.hex()], None

    def _check_samples(self, samples: list[Sample], sample_ids: list[int] | None) -> None:
        """sample_ids: the samples' positions in the whole batch, for error messages. Fetches routing held
        by reference first (collectively checked: a lost object fails every rank at once)."""
        ids = sample_ids if sample_ids is not None else list(range(len(samples)))
        self._fetch_routing(samples, ids)
        check_lengths(samples, self.spec.max_seq_len, ids)
        if self.spec.r3 and self.replay is not None:
            for i, s in zip(ids, samples):
                if s.routed_experts is not None:
                    self.replay.check(s.routed_experts, f"sample {i}")

    def _micro_batches(self, samples: list[Sample]) -> list[tuple[MicroBatch, list[int], bool]]:
        """(micro-batch, indices into samples, is_dummy), the same count on every rank. Inputs are
        checked (collectively) by the caller."""
        replay_shape = None
        if self.spec.r3 and self.replay is not None:
            replay_shape = (self.replay.num_layers, self.replay.top_k)
        groups = pack_micro_batches(
            [s.num_tokens for s in samples], self.spec.trainer.micro_batch_size, self.spec.micro_batch_tokens
        )
        count = int(self._all_reduce([len(groups)], dist.ReduceOp.MAX)[0])
        if count == 0:
            raise ValueError("trainer: the batch is empty on every rank")
        out = [
            (make_micro_batch([samples[i] for i in g], self.pad_id, replay_shape), g, False) for g in groups
        ]
        filler = Sample([self.pad_id], [self.pad_id], [0.0], "", 0, -1)
        while len(out) < count:
            out.append((make_micro_batch([filler], self.pad_id, None), [], True))
        return out

    def _routing(self, mb: MicroBatch):
        if mb.routed is None or self.replay is None:
            return nullcontext()
        return self.replay.active(mb.routed.to(self.device), mb.routed_valid.to(self.device))

    def _forward(
        self, mb: MicroBatch, with_entropy: bool, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> log-probs of the targets [B, W] fp32 (with grad when enabled), entropy [B, W] or None (with
        grad only when entropy_grad: the entropy bonus)."""
        with self.final_hidden.taken():
            self.model(
                input_ids=mb.input_ids.to(self.device),
                attention_mask=mb.attention_mask.to(self.device),
                logits_to_keep=logprobs.NO_LOGITS.to(self.device),
                use_cache=False,
            )
            hidden = self.final_hidden.value[:, -mb.window :]
        return logprobs.head_logprobs(
            self.hf_model.get_output_embeddings(),
            hidden,
            mb.targets.to(self.device),
            self.spec.trainer.logits_chunk_tokens,
            with_entropy,
            entropy_grad,
            self.spec.temperature,
            self.spec.top_p,
            float32_head=self.spec.head_dtype == "float32",
        )

    @staticmethod
    def _row_counts(mbs) -> np.ndarray:
        """[replayed, routable, token] rows of the real (not dummy) micro-batches."""
        real = [mb for mb, _, dummy in mbs if not dummy]
        return np.array(
            [[mb.replayed_rows, mb.routable_rows, mb.token_rows] for mb in real] or [[0, 0, 0]]
        ).sum(0)

    def _replay_fraction(self, mbs) -> float:
        rows, routable, _ = self._all_reduce(self._row_counts(mbs).tolist())
        return rows / routable if routable else 0.0

    # ------------------------------------------------------------------------------------------------
    # Log-probs and the step.

    @torch.no_grad()
    def log_probs(
        self,
        samples: list[Sample],
        sample_ids: list[int] | None = None,
        version: int | None = None,
        live: bool = True,
    ) -> tuple[list[np.ndarray], dict[str, float]]:
        """Per-sample response-token log-probs (float32, in the order of `samples`) and global metrics
        {"r3/replayed_fraction", "actor/entropy"}. No dropout, no gradients. sample_ids: the samples'
        positions in the whole batch (error messages name them). version: the adapter version to score
        with (one of the kept older ones: trainer/versions.py); None = the current one. live: with
        spec.r3_live_kl, also the live-routing forward and "r3/live_k3_kl" (False: a batch's second scoring,
        whose live score would repeat the first's forward)."""
        self._agree(lambda: self._check_samples(samples, sample_ids))
        with self.versions.at(version, self.step):
            policy, _, metrics = self._scoring_pass(samples, policy=True, reference=False, live=live)
        return policy, metrics

    @torch.no_grad()
    def _scoring_pass(
        self, samples: list[Sample], policy: bool, reference: bool, live: bool = False
    ) -> tuple[list[np.ndarray] | None, list[np.ndarray] | None, dict[str, float]]:
        """One no-grad pass over the samples' micro-batches (inputs checked by the caller): the policy's
        log-probs (adapter on) and/or the reference's (the base model: adapter switched off, no second copy
        of the weights), each micro-batch under one routing replay for both. -> (policy, reference,
        metrics); the metrics, {"r3/replayed_fraction", "actor/entropy"}, come with the policy's, and with
        live (and spec.r3_live_kl) "r3/live_k3_kl" from one more forward a micro-batch with live routing."""
        self.model.eval()
        mbs = self._micro_batches(samples)
        out = {"policy": [None] * len(samples), "reference": [None] * len(samples)}
        ent_sum = ent_n = live_sum = live_n = 0.0
        # The same spec on every rank, so every rank runs the extra forward (FSDP2 gathers in each one).
        live = live and policy and self.spec.r3 and self.spec.r3_live_kl and self.replay is not None
        for mb, idx, dummy in mbs:
            if live:  # the router's own choices: what the on-policy check would read without R3
                live_logp, _ = self._forward(mb, with_entropy=False)
                if not dummy:
                    rollout = mb.scatter([samples[i].response_logprobs for i in idx])
                    sums, counts = algo.k3_sequence_sums(live_logp, rollout, mb.response_mask)
                    live_sum += float(sums.sum())
                    live_n += float(counts.sum())
            with self._routing(mb):
                if policy:
                    logp, ent = self._forward(mb, with_entropy=True)
                    if not dummy:
                        mask = mb.response_mask.to(self.device)
                        ent_sum += float(ent[mask].sum())
                        ent_n += float(mask.sum())
                        for i, v in zip(idx, mb.gather(logp)):
                            out["policy"][i] = v
                if reference:
                    with self.model.disable_adapter():
                        ref, _ = self._forward(mb, with_entropy=False)
                    if not dummy:
                        for i, v in zip(idx, mb.gather(ref)):
                            out["reference"][i] = v
        metrics = {}
        if policy:
            ent_sum, ent_n = self._all_reduce([ent_sum, ent_n])
            metrics = {
                "r3/replayed_fraction": self._replay_fraction(mbs),
                "actor/entropy": ent_sum / ent_n if ent_n else 0.0,
            }
            if live:
                live_sum, live_n = self._all_reduce([live_sum, live_n])
                metrics["r3/live_k3_kl"] = live_sum / live_n if live_n else 0.0
            self._report_base_bytes(metrics)
        return (out["policy"] if policy else None), (out["reference"] if reference else None), metrics

    def _report_base_bytes(self, metrics: dict) -> None:
        """trainer/base_bytes once per run: with the first policy log-probs of the first step."""
        if not self._base_bytes_reported:
            metrics["trainer/base_bytes"] = float(self.base_bytes)
            self._base_bytes_reported = True

    def _correction_keys(self) -> list[str]:
        a, keys = self.spec.algo, []
        if a.tis_cap is not None:
            keys += ["rollout_corr/tis_capped_frac", "rollout_corr/tis_weight_mean"]
        if a.mis_token_bounds is not None or a.mis_seq_bounds is not None:
            keys.append("rollout_corr/mis_masked_frac")
        return keys

    def _prepare(self, mb, idx, dummy, samples, advantages, old_logprobs, ref_logprobs) -> _Prepared:
        if dummy:
            return _Prepared(mb, True, loss_mask=torch.zeros(mb.targets.shape, dtype=torch.bool))
        p = _Prepared(
            mb, False, advantages=mb.scatter([advantages[i] for i in idx]), loss_mask=mb.response_mask
        )
        if old_logprobs is not None:
            p.old_log_prob = mb.scatter([old_logprobs[i] for i in idx])
        if ref_logprobs is not None:
            p.ref_log_prob = mb.scatter([ref_logprobs[i] for i in idx])
        if self.spec.algo.corrects_rollout:
            a = self.spec.algo
            rollout = mb.scatter([samples[i].response_logprobs for i in idx])
            p.is_weights, keep, p.correction = algo.rollout_correction(
                p.old_log_prob, rollout, mb.response_mask, a.tis_cap, a.mis_token_bounds, a.mis_seq_bounds
            )
            p.loss_mask = keep.bool()
        return p

    def _check_step_inputs(self, samples, advantages, old_logprobs, sample_ids, mini_batches) -> None:
        self._check_samples(samples, sample_ids)
        if len(advantages) != len(samples):
            raise ValueError(f"train_step: {len(advantages)} advantages for {len(samples)} samples")
        if not np.isfinite(np.asarray(advantages, dtype=np.float64)).all():
            raise ValueError("train_step: advantages has NaN/inf values")
        if old_logprobs is not None:
            if len(old_logprobs) != len(samples):
                raise ValueError(f"train_step: {len(old_logprobs)} old_logprobs for {len(samples)} samples")
            for i, (s, o) in enumerate(zip(samples, old_logprobs)):
                if len(o) != len(s.response_ids):
                    raise ValueError(
                        f"train_step: old_logprobs[{i}] has {len(o)} values for {len(s.response_ids)} tokens"
                    )
        if mini_batches is not None:
            bad = [i for step in mini_batches for i in step if not 0 <= i < len(samples)]
            if bad:
                raise ValueError(f"train_step: mini_batches index {bad[0]}, but this rank has {len(samples)}")

    def train_step(
        self,
        samples: list[Sample],
        advantages: list[float],
        old_logprobs: list[np.ndarray] | None = None,
        sample_ids: list[int] | None = None,
        mini_batches: list[list[int]] | None = None,
        return_logprobs: bool = False,
    ) -> dict[str, float] | tuple[dict[str, float], list[np.ndarray]]:
        """One batch on this rank's samples: one optimizer and scheduler step per entry of mini_batches
        (indices into `samples`; every rank the same number of entries, any of them empty; None = one step
        over all samples). old_logprobs None = on-policy: with a single step and no TIS/MIS, the current
        log-probs, detached, are the old ones; otherwise a pass before the first update computes them.
        With algo.kl_coef > 0 that pass also computes the reference's (the adapter switched off).
        Loss normalisers are each mini-batch's own (tokens or sequences over all ranks); actor/* metrics
        are means over the mini-batches, actor/lr the first step's.

        return_logprobs (one on-policy step only): also -> the samples' log-probs from the update's own
        forward, before the optimizer step, so at the adapter that `log_probs` would have scored: the
        caller's on-policy check then needs no pass of its own."""
        t0 = time.perf_counter()
        self._agree(
            lambda: self._check_step_inputs(samples, advantages, old_logprobs, sample_ids, mini_batches)
        )
        steps = mini_batches if mini_batches is not None else [list(range(len(samples)))]
        counts = self._all_reduce([len(steps), -len(steps)], dist.ReduceOp.MAX)
        if counts[0] != -counts[1]:
            raise ValueError(f"train_step: ranks disagree on the number of mini-batches ({counts})")
        need_old = old_logprobs is None and (len(steps) > 1 or self.spec.algo.corrects_rollout)
        if return_logprobs and (need_old or old_logprobs is not None or self.spec.lora.dropout):
            raise ValueError(
                "train_step: return_logprobs needs one on-policy optimizer step (no old_logprobs, no TIS/MIS, "
                "one mini-batch, no LoRA dropout)"
            )
        self.versions.save(self.step)  # the adapter this batch's update replaces
        # indices into the (single) step's samples; put back in the order of `samples` after the step
        scored: list[np.ndarray | None] | None = [None] * len(steps[0]) if return_logprobs else None
        ref_logprobs = None
        if need_old or self.spec.algo.kl_coef:
            old, ref_logprobs, _ = self._scoring_pass(
                samples, policy=need_old, reference=bool(self.spec.algo.kl_coef)
            )
            if need_old:
                old_logprobs = old

        per_step, lrs, skipped, rows = [], [], 0, np.zeros(3)
        for k, idx in enumerate(steps):
            m, mbs = self._optimizer_step(
                [samples[i] for i in idx],
                _pick(advantages, idx),
                _pick(old_logprobs, idx),
                _pick(ref_logprobs, idx),
                k,
                scored,
            )
            lrs.append(m.pop("lr"))
            skipped += int(m.pop("skipped"))
            per_step.append(m)
            rows += self._row_counts(mbs)
        self.step += 1
        self._routing_cache.clear()  # the batch is done
        metrics = {k: float(np.mean([m[k] for m in per_step])) for k in per_step[0]}
        replayed, routable, total = self._all_reduce(rows.tolist())
        metrics.update(
            {
                "actor/lr": lrs[0],
                "actor/optimizer_steps": float(len(steps) - skipped),
                "actor/skipped_step": float(skipped),
                "r3/replayed_fraction": replayed / routable if routable else 0.0,
                "perf/train_tokens": total,  # token rows trained on, summed over the mini-batches
                "perf/train_s": time.perf_counter() - t0,
            }
        )
        if scored is None:
            return metrics
        self._report_base_bytes(metrics)
        return metrics, in_batch_order(len(samples), [steps[0]], [scored])

    def _optimizer_step(self, samples, advantages, old_logprobs, ref_logprobs, k: int, scored=None):
        """Forward/backward over one mini-batch's micro-batches, then one optimizer and scheduler step.
        -> (metrics of this step, its micro-batches). scored: a list (one entry a sample) that receives
        the forward's log-probs, taken before the optimizer step."""
        a = self.spec.algo
        self.model.train()
        mbs = self._micro_batches(samples)
        prepared = [
            self._prepare(mb, idx, d, samples, advantages, old_logprobs, ref_logprobs) for mb, idx, d in mbs
        ]
        counts = [algo.loss_normalisers(p.loss_mask) for p in prepared]
        tokens, seqs = self._all_reduce([sum(c[0] for c in counts), sum(c[1] for c in counts)])
        if tokens == 0:
            raise ValueError(f"train_step: mini-batch {k} has no response token to train on (all masked out)")
        loss_config = algo.LossConfig.of_step(a, int(tokens), int(seqs))  # once for the step's micro-batches

        self.optimizer.zero_grad(set_to_none=True)
        lr = self.optimizer.param_groups[0]["lr"]
        shares = ["actor/pg_loss"] + (["actor/kl_loss"] if a.kl_coef else [])
        shares += ["actor/entropy_loss"] if a.entropy_coeff else []
        # A loss of the user's own (an import path) reports what it likes: every metric it returns is a
        # token-weighted mean over the micro-batches that returned it, keys agreed over the ranks below.
        own_loss = user_code.is_import_path(a.loss_mode)
        weighted = ("actor/entropy",) if own_loss else ("actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy")
        sums = dict.fromkeys(shares + list(weighted), 0.0)
        own_sums: dict[str, float] = {}
        own_tokens: dict[str, float] = {}
        for (_, idx, _), p in zip(mbs, prepared):
            with self._routing(p.mb):
                logp, ent = self._forward(p.mb, with_entropy=not p.dummy, entropy_grad=bool(a.entropy_coeff))
                if p.dummy:
                    # Zero loss, but the backward runs: FSDP2's gradient reduction must happen on every rank.
                    (logp.sum() * 0.0).backward()
                    continue
                old = p.old_log_prob.to(self.device) if p.old_log_prob is not None else logp.detach()
                if scored is not None:
                    for i, v in zip(idx, p.mb.gather(logp)):
                        scored[i] = v
                out = algo.compute_loss(p.loss_inputs(logp, old, ent, self.device), loss_config)
                out.loss.backward()
                m = out.metrics
            n = float(p.loss_mask.sum())
            for key in shares:
                sums[key] += m[key]  # already this micro-batch's share of the mini-batch's loss
            for key in weighted:
                sums[key] += m[key] * n  # micro-batch means -> token-weighted means over the mini-batch
            for key in m.keys() - sums.keys() if own_loss else ():
                own_sums[key] = own_sums.get(key, 0.0) + m[key] * n
                own_tokens[key] = own_tokens.get(key, 0.0) + n
        # TIS/MIS metrics: token-weighted over the mini-batch; the key list is fixed by the config so that
        # every rank all-reduces the same list.
        corr_keys = self._correction_keys()
        corr_tokens = 0.0
        for p in prepared:
            if p.correction is not None:
                r = float(p.mb.response_mask.sum())
                corr_tokens += r
                for key in corr_keys:
                    sums[key] = sums.get(key, 0.0) + p.correction.get(key, 0.0) * r
        keys = sorted(sums.keys() | set(corr_keys))
        reduced = self._all_reduce([sums.get(key, 0.0) for key in keys] + [corr_tokens])
        metrics = dict(zip(keys, reduced[:-1]))
        for key in weighted:
            metrics[key] /= tokens
        for key in corr_keys:
            metrics[key] /= max(reduced[-1], 1.0)
        if own_loss:
            metrics.update(self._own_loss_metrics(own_sums, own_tokens))

        grad_norm = self._clip_gradients()
        skipped = not np.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
        self.scheduler.step()
        metrics.update({"actor/grad_norm": grad_norm, "lr": lr, "skipped": skipped})
        return metrics, mbs

    def _own_loss_metrics(self, sums: dict[str, float], tokens: dict[str, float]) -> dict[str, float]:
        """The metrics of a loss of the user's own: each key's token-weighted mean over every rank's
        micro-batches that returned it. The key lists are gathered first, as ranks may differ (a rank
        whose micro-batches are all padding calls no loss)."""
        every: list = [None] * self.world_size
        dist.all_gather_object(every, sorted(sums))
        keys = sorted(set().union(*every))
        if not keys:
            return {}
        reduced = self._all_reduce([sums.get(k, 0.0) for k in keys] + [tokens.get(k, 0.0) for k in keys])
        return {k: reduced[i] / reduced[len(keys) + i] for i, k in enumerate(keys) if reduced[len(keys) + i]}

    def _clip_gradients(self) -> float:
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.ep is not None:
            return self._clip_gradients_two_meshes(grads)
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # the shards' partial norms, reduced over ranks
        if self.spec.trainer.grad_clip > 0 and torch.isfinite(norm):
            torch.nn.utils.clip_grads_with_norm_(self.params, self.spec.trainer.grad_clip, norm)
        return float(norm)

    def _clip_gradients_two_meshes(self, grads: list[torch.Tensor]) -> float:
        """_clip_gradients with expert parallelism: the experts' gradients are sharded over the dp sub-mesh,
        the others over all ranks, and every element sits on exactly one rank, so the squared norm is the
        sum over ranks of each rank's own squares (torch's norm and clipping take one mesh)."""
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        if local:
            squares = torch.stack(torch._foreach_norm(local, 2.0)).float().square().sum()
        dist.all_reduce(squares)
        norm = squares.sqrt()
        if self.spec.trainer.grad_clip > 0 and torch.isfinite(norm) and local:
            torch._foreach_mul_(local, torch.clamp(self.spec.trainer.grad_clip / (norm + 1e-6), max=1.0))
        return float(norm)

    # ------------------------------------------------------------------------------------------------
    # Export.

    def _lora_fqns(self) -> dict[str, tuple[int, ...]]:
        """Trainable parameter names as the state-dict API spells them (no wrapper prefixes), with the
        full (unsharded) shapes: the whole model's, all experts, under expert parallelism too."""
        out = {
            lora.unwrapped_name(n): tuple(p.shape)
            for n, p in self.model.named_parameters()
            if p.requires_grad
        }
        if self.ep is not None:
            out = {n: self.ep.global_shape(n, shape) for n, shape in out.items()}
        return out

    def _gathered(self, tensors, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Full copies on CPU of `tensors` (one per trainable parameter, in `self.params` order: the
        parameters or their gradients), by state-dict name, on rank 0 ({} elsewhere), cast to `dtype` first.
        One at a time: gathered on the device, cast there (a sync ships bf16: half the bytes to copy out, and
        no fp32 -> bf16 pass over every weight on the host), then copied; the base weights never move.
        Under expert parallelism an expert's LoRA is gathered from its EP rank and put at its global id."""
        out = {}
        for name, t in zip(self._lora_fqns(), tensors):
            full = t.detach().full_tensor() if isinstance(t, DTensor) else t.detach()
            if dtype is not None and full.is_floating_point():
                full = full.to(dtype)
            if self.ep is not None:
                full = self.ep.to_global(name, full)
            if self.rank == 0:
                out[name] = full.cpu() if full.device.type != "cpu" else full.clone()
        return out

    def export_adapter(
        self, dtype: str | None = None, version: int | None = None
    ) -> tuple[dict[str, torch.Tensor], dict] | None:
        """PEFT adapter tensors (`get_peft_model_state_dict` key names, CPU) and adapter_config contents,
        on rank 0; None on the other ranks. The fp32 masters as they are, or cast to `dtype` (a torch dtype
        name) here, before they travel: the rollout computes LoRA in the model dtype, so a sync ships that
        (half the bytes in bf16); checkpoints keep fp32. version: a kept older version instead of the current one."""
        with self.versions.at(version, self.step):
            state = self._gathered(self.params, getattr(torch, dtype) if dtype else None)
        if self.rank != 0:
            return None
        tensors = {lora.peft_key(k): v for k, v in state.items()}
        return tensors, lora.peft_config_dict(self.model, self.spec.model_path)

    def export_adapter_pair(
        self, dtype: str | None = None, version: int | None = None
    ) -> tuple[dict | None, dict | None]:
        """export_adapter as two values (tensors, config), (None, None) off rank 0: for Ray's
        `num_returns=2`, which keeps each in the object store under its own reference."""
        return self.export_adapter(dtype, version) or (None, None)

    def gradients(self) -> dict[str, torch.Tensor] | None:
        """Full gradients of the LoRA weights after the last train_step, PEFT key names (rank 0; tests)."""
        grads = self._gathered([p.grad for p in self.params])
        return {lora.peft_key(k): v for k, v in grads.items()} if self.rank == 0 else None

    def export_merged(self, version: int | None = None) -> dict[str, torch.Tensor] | None:
        """The base weights with the LoRA update merged, in the model's on-disk Hugging Face names and
        dtype (rank 0; others None). Gathers the whole model on rank 0: for merged sync of small models.
        version: a kept older adapter version instead of the current one."""
        layout = lora.lora_layout(self.model)
        packed = self.spec.base_format == "nvfp4"
        ep = self.ep is not None  # every EP rank contributes its experts, so keeps its gathered shards
        # A packed base is gathered packed, one weight at a time, and dequantized (trainer/nvfp4_tensor.py).
        with self.versions.at(version, self.step):
            full = get_model_state_dict(
                self.model,
                options=StateDictOptions(
                    full_state_dict=True, cpu_offload=not ep, ignore_frozen_params=packed
                ),
            )
        if packed:
            full.update(gather_frozen(self.model, self.rank == 0 or ep))
        if ep:
            full, layout = self.ep.globalize(full, self.rank == 0), self.ep.global_layout(layout)
        if self.rank != 0:
            return None
        return hf_checkpoint_state_dict(self.hf_model, lora.merge_lora(full, layout))

    # ------------------------------------------------------------------------------------------------
    # Checkpoints.

    def load_adapter(self, directory: str) -> None:
        """Loads a PEFT adapter written by `export_adapter`/`save_checkpoint` (same targets and rank)."""
        tensors, _ = read_peft_dir(directory)
        # After a forward without backward (log_probs) FSDP2 leaves the root's parameters unsharded, plain
        # tensors that the state-dict load cannot copy DTensors into: shard them back first.
        self.hf_model.reshard()
        expected = {lora.peft_key(k): v for k, v in self._lora_fqns().items()}
        lora.check_adapter(expected, tensors, f"adapter {directory}")
        by_peft = {lora.peft_key(k): k for k in self._lora_fqns()}
        state = {by_peft[k]: v.float() for k, v in tensors.items()}
        if self.ep is not None:  # this rank's experts of the file's (all, at their global ids)
            state = {k: self.ep.to_local(k, v) for k, v in state.items()}
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True, strict=False))

    def save_checkpoint(self, directory: str) -> None:
        """Adapter (PEFT format), optimizer, scheduler, step, and every rank's RNG, written into a
        temporary sibling and renamed into place once complete. Needs a filesystem all ranks share."""
        dst = Path(directory)
        holder = [None]
        if self.rank == 0:
            dst.parent.mkdir(parents=True, exist_ok=True)
            holder[0] = tempfile.mkdtemp(prefix=dst.name + ".tmp-", dir=dst.parent)
        dist.broadcast_object_list(holder, src=0)
        tmp = Path(holder[0])
        checkpoint_io.atomic_torch_save(_rng_state(), tmp / f"rng_rank{self.rank}.pt")
        adapter = self.export_adapter()
        # the kept older versions: a batch in flight at the checkpoint was generated by one of them
        older = {v: self.export_adapter(version=v) for v in self.versions.versions()}
        # The optimizer state of the whole model, all experts at their global ids whatever the layout
        ep = self.ep is not None
        optim = get_optimizer_state_dict(
            self.model, self.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=not ep)
        )
        if ep:
            optim = self.ep.globalize_optimizer(optim, self.rank == 0)
        if self.rank == 0:
            checkpoint_io.write_adapter(tmp, *adapter)
            for v, older_adapter in older.items():
                checkpoint_io.write_adapter(tmp / checkpoint_io.older_version_dir(v), *older_adapter)
            checkpoint_io.atomic_torch_save(optim, tmp / "optimizer.pt")
            checkpoint_io.atomic_torch_save(self.scheduler.state_dict(), tmp / "scheduler.pt")
            checkpoint_io.atomic_write_json(
                {
                    "step": self.step,
                    "world_size": self.world_size,
                    "expert_parallel_size": self.spec.trainer.expert_parallel_size,
                },
                tmp / "trainer_state.json",
            )
        dist.barrier()
        if self.rank == 0:
            checkpoint_io.replace_dir(tmp, dst)
        dist.barrier()

    def load_checkpoint(self, directory: str) -> int:
        """Restores what save_checkpoint wrote; returns the step. RNG needs the same world size. The adapter
        and the optimizer state are the whole model's, so any `trainer.expert_parallel_size` reads them."""
        d = Path(directory)
        state = json.loads((d / "trainer_state.json").read_text())
        self.versions.clear()
        for v, path in checkpoint_io.older_versions(d).items():  # oldest first
            self.load_adapter(str(path))
            self.versions.save(v)
        self.load_adapter(str(d))
        optim = torch.load(d / "optimizer.pt", weights_only=True)
        if self.ep is not None:
            optim = self.ep.localize_optimizer(optim)
        set_optimizer_state_dict(
            self.model, self.optimizer, optim, options=StateDictOptions(full_state_dict=True, strict=False)
        )
        self.scheduler.load_state_dict(torch.load(d / "scheduler.pt", weights_only=True))
        self.step = int(state["step"])
        rng = d / f"rng_rank{self.rank}.pt"
        if state["world_size"] == self.world_size and rng.exists():
            _set_rng_state(torch.load(rng, weights_only=True))
        return self.step

    def node(self) -> tuple[str, str]:
        """(node id, node address) of this rank, as Ray reports them: what a lost rank's message names."""
        return node_address()

    def output(self) -> str | None:
        """The file this rank's stderr goes to (its log in the run's logs/, or Ray's log of the worker): where
        a rank that crashed left why, for the lost rank's message."""
        return stderr_path()

    def release_cached_memory(self) -> int:
        """Returns the caching allocator's free blocks to the device (torch.cuda.empty_cache): a colocated
        engine wakes into that memory, and PyTorch would otherwise keep the update's peak reserved. The bytes
        this rank still reserves (0 without CUDA)."""
        if not torch.cuda.is_available():
            return 0
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _pick(values: list | None, idx: list[int]) -> list | None:
    return None if values is None else [values[i] for i in idx]


def _rng_state() -> dict:
    """Every generator's state in types torch.load(weights_only=True) accepts (numpy's key array as a
    tensor)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
