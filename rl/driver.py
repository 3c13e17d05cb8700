"""The GRPO driver: one step of docs/design.md per loop iteration, on a Ray cluster.

    for step in steps:
        batch   = rollout.generate(prompts)                   # 1. samples, log-probs, routed experts
        rewards = reward(batch)                               # 2. verifier scores (+ overlong shaping)
        batch   = dynamic_sampling(batch)                     # 3. drop all-equal groups, draw more
        logp    = trainer.log_probs(batch)                    # 4. adapter v, routing replayed: KL vs rollout
        trainer.train_step(batch, advantages(rewards), logp)  # 5. GRPO update
        rollout.load(trainer.export())                        # 6. adapter v+1 (or merged weights)
        evaluate() every eval.every steps                     # 7. mean@k on the rollout workers

A batch trained in one on-policy optimizer step (no mini-batches, no TIS/MIS) skips 4: the update's own
forward, taken before its optimizer step, gives the same log-probs (`TrainerGroup.can_score_in_update`).

Everything the step needs is built once in `Run.__init__` from the typed config; the config itself never
reaches the workers, only the small specs made from it.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rl.checkpoint import Checkpoints, latest_checkpoint, load_driver_state
from rl.config import MAX_DRAWS, SparkConfig, run_dir, save_config
from rl.core import algo
from rl.core.batch import RoutingLost, Sample
from rl.data.loader import Prompt, PromptLoader
from rl.metrics import MetricsLogger
from rl.monitor import KLMonitor, StopRun, mismatch_tensors, save_violation
from rl.rollout_ahead import Generated, RolloutAhead
from rl.rollout_records import flat_group_fraction, flat_reward_warning, rollout_rows, write_rollouts
from rl.setup import build_components, prompt_requests, sampling_spec

# Step-dependent sampling seeds: distinct per (run seed, step, draw), identical on a resumed run.
_SEED_STRIDE = 1_000_003
_SEED_PRIME = 2**31 - 1  # prime: distinct streams (|difference| < it) give distinct seeds


def train_stream(step: int, draw: int) -> int:
    """The seed stream of dynamic-sampling draw `draw` of training step `step`: one per (step, draw), since
    a step draws at most MAX_DRAWS batches."""
    if not 0 <= draw < MAX_DRAWS:
        raise ValueError(f"draw {draw} outside 0..{MAX_DRAWS - 1} (algorithm.dynamic_sampling.max_draws)")
    return step * MAX_DRAWS + draw


def eval_stream(step: int) -> int:
    """The seed stream of the evaluation at `step`: negative, apart from every training stream."""
    return -1 - step


def sampling_seed(run_seed: int, stream: int) -> int:
    return (run_seed * _SEED_STRIDE + stream * 7919) % _SEED_PRIME


@dataclass
class StepClock:
    """perf_counter readings of one step; the step's times (perf/*) are their differences."""

    start: float = field(default_factory=time.perf_counter)
    rollout_done: float = 0.0  # the batch in hand (the engines asleep, colocated)
    train_start: float = 0.0  # the update began (= rollout_done where its own forward scored the batch)
    train_done: float = 0.0
    end: float = 0.0  # the new policy exported (k = 0: and on the engines)

    def metrics(self, samples: list[Sample], generate_s: float) -> dict:
        n_resp = sum(s.num_generated for s in samples)
        n_all = sum(s.num_tokens for s in samples)
        return {
            "perf/step_s": self.end - self.start,
            "perf/rollout_s": self.rollout_done - self.start,
            "perf/logprob_s": self.train_start - self.rollout_done,
            "perf/train_s": self.train_done - self.train_start,
            "perf/rollout_tokens_per_s": n_resp / max(generate_s, 1e-9),
            "perf/train_tokens_per_s": n_all / max(self.train_done - self.train_start, 1e-9),
        }


@dataclass
class Update:
    """Steps 4-5 on a batch: the metrics of the check and the update, the trainer's log-probs of the batch
    at the version that generated it, and how many trainer calls carried the batch."""

    metrics: dict
    logp: list[np.ndarray]
    trainer_calls: int


class Run:
    def __init__(self, cfg: SparkConfig, resume: bool = False):
        self.cfg = cfg
        self.dir = run_dir(cfg)
        self._check_run_dir(resume)
        self.checkpoints = Checkpoints(self.dir, cfg.trainer.keep_checkpoints)
        # Before Ray starts: a run with nothing that verifies is an error here, and what lies above the
        # resume point is moved aside before this run writes checkpoints of those steps.
        resume_from = self.checkpoints.for_resume() if resume else None
        self.dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, self.dir / "config.yaml")
        c = build_components(cfg, self.dir)  # tokenizer, data, Ray, rollout pool, trainer group, reward
        self.tokenizer, self.rollout, self.trainer, self.reward = c.tokenizer, c.rollout, c.trainer, c.reward
        self.adv_estimator = c.trainer_spec.algo.adv_estimator
        self.colocated = c.rollout.spec.enable_sleep_mode  # GPU, rollout.placement=colocated
        self.owns_ray = c.owns_ray
        self.loader = PromptLoader(
            c.train_prompts, cfg.data.train_batch_size, cfg.data.shuffle, cfg.data.seed
        )
        self.eval_prompts: list[Prompt] = c.eval_prompts
        self.monitor = KLMonitor(cfg.monitor.k3_kl_max, cfg.monitor.k3_kl_trend_max, cfg.monitor.trend_window)
        self.step, self.version, self.skipped_in_a_row, self.skipped_total = 0, 0, 0, 0
        self.flat_steps_in_a_row = 0  # steps in a row whose every group had equal rewards
        self.eval_history: list[tuple[int, dict]] = []
        # Every rollout call goes through one thread; with rollout.max_staleness = k > 0 the next k batches
        # are generated there while the trainer updates.
        self.ahead = RolloutAhead(
            cfg.rollout.max_staleness, self.collect_batch, self._load_weights, self.loader
        )
        if resume_from is not None:
            self._resume(resume_from)
        else:
            if resume:
                print(f"resume: {self.dir} recorded no step and has no checkpoint; starting at step 0")
            if self.ahead.k:
                self.ahead.publish(0, self._export_weights())  # a batch of version 0 generated again needs it
        self.log = MetricsLogger(
            self.dir,
            cfg.trainer.total_steps,
            self.step,
            cfg.logging.console_every,
            cfg.logging.tensorboard,
            cfg.logging.wandb_project,
            cfg.logging.wandb_entity,
            cfg.run.name,
            config=dataclasses.asdict(cfg),
            mlflow_tracking_uri=cfg.logging.mlflow_tracking_uri,
            mlflow_experiment=cfg.logging.mlflow_experiment,
        )
        self.start_step = self.step  # where this invocation began (the summary counts its own steps)
        self._stop_signal: str | None = None

    # ------------------------------------------------------------------------------------------------
    # The loop
    # ------------------------------------------------------------------------------------------------

    def train(self) -> dict:
        from trainer.group import TrainerRankLost

        start = time.perf_counter()
        previous = self._install_signal_handlers()
        for notice in (compile_notice(self.cfg), staleness_notice(self.cfg), eval_notice(self.cfg)):
            if notice:
                self.log.event(notice)
        try:
            if self.cfg.eval.at_start and self.step == 0 and self._has_eval():
                self.log.log(0, self.evaluate(0))
            while self.step < self.cfg.trainer.total_steps:
                self.step += 1
                metrics = self.train_step(self.step)
                if self._eval_due(self.step):
                    metrics.update(self.evaluate(self.step))
                self.log.log(self.step, metrics)
                if self._checkpoint_due(self.step):
                    self.checkpoint()
                if self._stop_signal:
                    self.log.event(
                        f"[yellow]{self._stop_signal}: checkpoint written at step {self.step}; "
                        f"continue with --resume"
                    )
                    break
        except TrainerRankLost as e:
            raise StopRun(self._lost_message(e)) from e
        finally:
            self.log.close()
            for sig, handler in previous.items():  # a caller's own handlers (a notebook's, a test's) are back
                signal.signal(sig, handler)
        from rl.report import write_report

        summary = self.summary(time.perf_counter() - start)
        summary["report"] = str(write_report([self.dir]))
        return summary

    def train_step(self, step: int) -> dict:
        """One step of docs/design.md. Its batch was generated on the rollout thread by adapter
        g = max(0, step - 1 - k), k = rollout.max_staleness (k = 0: the version this step starts from); the
        batches of the next k steps are queued before this one's update, so they are generated during it."""
        ahead, clock = self.ahead, StepClock()
        # 1-3. Generate, score, dynamic sampling (queued on the rollout thread; taken here once done).
        ahead.fill(min(self.cfg.trainer.total_steps, step + ahead.k), self.version)
        monitor_before = self.monitor.state_dict()
        batch, generated = ahead.take(step)
        # 4-5. Log-probs (the on-policy check) and the update. A batch whose routing was lost with its rollout
        # worker's node before the trainer ranks fetched it (RoutingLost: no optimizer step has run) is
        # generated again, once, at its version and from its loader state: the same batch.
        for attempt in (1, 2):
            if self.colocated:  # hand the GPUs to the trainer: weights to host memory, KV cache dropped
                self.rollout.sleep()
            clock.rollout_done = time.perf_counter()
            try:
                update = self._score_and_update(step, generated.samples, batch.version, clock)
                break
            except RoutingLost as e:
                if attempt == 2:
                    raise
                self.log.event(f"[yellow]step {step}: {e}; generating the batch again")
                self.monitor.load_state_dict(monitor_before)
                if self.colocated:
                    self._wake_engines()
                batch, generated = ahead.again(batch)
        clock.train_done = time.perf_counter()
        overlap = ahead.overlap_s(clock.rollout_done, clock.train_done)
        # 6. The new policy for the batches that need it; at k = 0 onto the engines now.
        if self.colocated:
            self._wake_engines()
        lag = self.version - batch.version
        self.version += 1
        ahead.publish(self.version, self._export_weights())
        loaded = ahead.load(self.version) if ahead.k == 0 else {}
        clock.end = time.perf_counter()
        return self._step_metrics(step, generated, update, loaded, clock, lag, overlap)

    def _wake_engines(self) -> None:
        """Hand the GPUs back to the colocated engines: the trainer ranks first return their cached free
        blocks (PyTorch keeps the update's peak reserved, and the engines' weights and KV cache come back into
        that memory: `sparkrl plan`'s rollout phase counts the trainer's resident state alone), then the
        engines wake."""
        self.trainer.release_cached_memory()
        self.rollout.wake_up()

    def _step_metrics(
        self,
        step: int,
        generated: Generated,
        update: Update,
        loaded: dict,
        clock: StepClock,
        lag: int,
        overlap,
    ) -> dict:
        """The step's record: the batch's metrics, the update's, the hand-over's and the step's times; and
        what follows from them (skip count, flat-reward warning, rollout records)."""
        samples, metrics = generated.samples, {**generated.metrics, **update.metrics}
        metrics["train/skipped_steps"] = self._count_skips(step, update.metrics)
        # The batch's bytes through this process: the samples in from the rollout (every draw), out to the
        # trainer ranks (once a call), the log-probs back. R3's routing is not among them (it goes from
        # rollout worker to trainer rank by reference: Sample.routing_ref).
        sent = update.trainer_calls * sum(s.payload_bytes() for s in samples)
        metrics["perf/driver_bytes"] = generated.received_bytes + sent + sum(x.nbytes for x in update.logp)
        self._check_flat_rewards(step, metrics)
        every = self.cfg.logging.rollouts_every
        if every and step % every == 0:
            self._record_rollouts(step, samples, update.logp)
        # perf/sync_load_s is the engines' load of a version: at k = 0 this step's, else the batch's (on the
        # rollout thread, before it generated). perf/sync_s is the whole hand-over (wake, export, load) at
        # k = 0; perf/export_s the export alone at k > 0, where the load overlaps the next update.
        if self.ahead.k == 0:
            metrics.update(loaded)
            metrics["perf/sync_load_s"] = metrics.pop("perf/sync_s", float("nan"))
            metrics["perf/sync_s"] = clock.end - clock.train_done
        else:
            if "perf/sync_s" in metrics:  # the batch's version was loaded first, on the rollout thread
                metrics["perf/sync_load_s"] = metrics.pop("perf/sync_s")
            metrics["rollout/staleness"] = float(lag)
            metrics["perf/generate_s"] = generated.generate_s
            metrics["perf/rollout_overlap_s"] = overlap
            metrics["perf/export_s"] = clock.end - clock.train_done
        metrics.update(clock.metrics(samples, generated.generate_s))
        metrics["adapter/version"] = self.version
        metrics["actor/lr"] = metrics.get("actor/lr", float("nan"))
        return metrics

    def _record_rollouts(self, step: int, samples: list[Sample], logp: list[np.ndarray]) -> None:
        """The trained samples, as text with their rewards and k3, to rollouts/step_<N>.jsonl and the
        trackers (logging.rollouts_*)."""
        lg = self.cfg.logging
        t, r, mask = mismatch_tensors(logp, samples)
        sums, counts = algo.k3_sequence_sums(t, r, mask)
        k3 = [float(a / n) if n > 0 else None for a, n in zip(sums.tolist(), counts.tolist())]
        rows = rollout_rows(step, samples, k3, self.tokenizer, lg.rollouts_per_step, lg.rollouts_max_chars)
        write_rollouts(self.dir, step, rows)
        self.log.log_rollouts(step, rows)

    def _check_flat_rewards(self, step: int, metrics: dict) -> None:
        """Warn of a step whose every group had equal rewards (no gradient), louder after
        monitor.flat_reward_steps of them in a row."""
        flat = metrics.get("batch/flat_group_frac", 0.0) >= 1.0
        self.flat_steps_in_a_row = self.flat_steps_in_a_row + 1 if flat else 0
        warning = flat_reward_warning(
            step,
            self.flat_steps_in_a_row,
            self.cfg.monitor.flat_reward_steps,
            metrics.get("reward/mean", float("nan")),
            self.dir,
        )
        if warning:
            self.log.event(warning)

    def _advantages(self, samples: list[Sample]) -> list[float]:
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        groups = torch.tensor([s.group for s in samples])
        return algo.compute_advantages(rewards, groups, estimator=self.adv_estimator).tolist()

    def _score_and_update(
        self, step: int, samples: list[Sample], generated_by: int, clock: StepClock
    ) -> Update:
        """Steps 4-5 on a batch generated by adapter `generated_by`, the trainer at `self.version`.

        On-policy (generated_by is the current version): the trainer's log-probs at adapter v are the
        on-policy check, then the GRPO update; a single on-policy update scores the batch in its own
        forward, before its optimizer step, without a pass of its own (a run that stops on a KL violation
        keeps the separate pass, so that it stops before the update).

        A batch that waited (k > 0): the check scores it at the generating version (the trainer keeps the
        last k, so the check still isolates the engines' mismatch); the update's old log-probs are the
        current version's (the decoupled formulation, as verl's: PPO's ratio against the proximal policy,
        the current adapter; TIS/MIS weights against the rollout's log-probs, lag included), and the lag
        itself is `rollout/policy_lag_k3_kl`."""
        advantages = self._advantages(samples)
        metrics: dict[str, float] = {}
        if generated_by != self.version:
            at_generation, logp_metrics = self.trainer.log_probs(samples, version=generated_by)
            metrics.update(logp_metrics)
            metrics.update(self._check_kl(step, at_generation, samples))
            current, _ = self.trainer.log_probs(samples, live=False)  # the live score came with the first
            metrics["rollout/policy_lag_k3_kl"] = policy_lag_k3(current, at_generation, samples)
            clock.train_start = time.perf_counter()
            metrics.update(self.trainer.train_step(samples, advantages, current))
            return Update(metrics, at_generation, trainer_calls=3)
        if self.ahead.k:
            metrics["rollout/policy_lag_k3_kl"] = 0.0
        if not self.cfg.monitor.stop_on_violation and self.trainer.can_score_in_update(samples):
            clock.train_start = clock.rollout_done
            train_metrics, logp = self.trainer.train_step(samples, advantages, return_logprobs=True)
            metrics.update(self._check_kl(step, logp, samples))
            metrics.update(train_metrics)
            return Update(metrics, logp, trainer_calls=1)
        logp, logp_metrics = self.trainer.log_probs(samples)
        metrics.update(logp_metrics)
        metrics.update(self._check_kl(step, logp, samples))
        clock.train_start = time.perf_counter()
        metrics.update(self.trainer.train_step(samples, advantages, logp))
        return Update(metrics, logp, trainer_calls=2)

    def _check_kl(self, step: int, logp: list[np.ndarray], samples: list[Sample]) -> dict:
        """The on-policy check: `rollout_corr/*` of trainer vs rollout log-probs, against the KL budget."""
        metrics = mismatch_metrics(logp, samples)
        warning = self.monitor.check(metrics["rollout_corr/k3_kl"])
        if warning:
            self.log.event(f"[red]step {step}: KL budget broken: {warning}")
            if self.monitor.violations <= self.cfg.monitor.save_violations:
                path = save_violation(self.dir, step, samples, logp, metrics)
                self.log.event(f"step {step}: the tokens and samples where trainer and rollout part: {path}")
            if self.cfg.monitor.stop_on_violation:
                self.checkpoint()
                raise StopRun(f"step {step}: {warning} (monitor.stop_on_violation is set)")
        metrics["monitor/kl_violations"] = self.monitor.violations
        return metrics

    def collect_batch(self, step: int) -> Generated:
        """Steps 1-3 on the engines as they are: generate, score, and (with dynamic sampling) keep only the
        groups that carry signal."""
        cfg = self.cfg
        want = cfg.data.train_batch_size
        draws = cfg.algorithm.dynamic_sampling.max_draws if cfg.algorithm.dynamic_sampling.enabled else 1
        kept: list[Sample] = []
        all_samples: list[Sample] = []
        gen_s, reward_errors, received, first_error = 0.0, 0.0, 0, ""
        for draw in range(draws):
            prompts = self.loader.next_batch(want if draw == 0 else want - len({s.group for s in kept}))
            t = time.perf_counter()
            samples = self.rollout.generate(
                prompt_requests(prompts, offset=draw * want, rows=bool(cfg.rollout.env)),
                self._sampling(train_stream(step, draw)),
            )
            gen_s += time.perf_counter() - t
            received += sum(s.payload_bytes() for s in samples)
            scored = self._score(samples, prompts, offset=draw * want)
            reward_errors += scored.errors
            first_error = first_error or next(iter(scored.messages), "")
            all_samples.extend(samples)
            if not cfg.algorithm.dynamic_sampling.enabled:
                kept = samples
                break
            keep, _ = algo.filter_groups(
                torch.tensor([s.reward for s in samples]), torch.tensor([s.group for s in samples])
            )
            kept.extend(s for s, k in zip(samples, keep.tolist()) if k)
            if len({s.group for s in kept}) >= want:
                break
        self._check_reward_errors(f"step {step}", reward_errors, len(all_samples), first_error)
        if not kept:
            # Every group had equal rewards: nothing to learn from; train on the plain batch (zero advantages).
            kept = all_samples[: want * cfg.rollout.n]
        metrics = batch_metrics(all_samples, kept, cfg.rollout.max_response_len)
        metrics["reward/errors"] = reward_errors
        return Generated(kept, gen_s, received, metrics)

    def _export_weights(self, version: int | None = None) -> tuple:
        """The policy as the rollout loads it, left in the trainer's object store: ("adapter", tensors,
        peft config) or ("merged", weights). version: a kept older one (None: the current)."""
        if self.cfg.sync.mode == "adapter":
            # The trainer keeps fp32 LoRA masters; vLLM computes LoRA in the model dtype, so the trainer
            # casts to that before the transfer (half the bytes in bf16). Checkpoints keep fp32.
            # The tensors go from the trainer's object store to the rollout workers, not through the driver.
            return ("adapter", *self.trainer.export_adapter_ref(dtype=self.cfg.model.dtype, version=version))
        return ("merged", self.trainer.export_merged_ref(version=version))

    def _load_weights(self, weights: tuple, version: int) -> dict:
        kind, *payload = weights
        if kind == "adapter":
            return self.rollout.load_adapter(*payload, version)
        return self.rollout.load_merged_weights(*payload, version)

    def evaluate(self, step: int) -> dict:
        """Step 7: k samples per eval problem on the rollout workers; mean@k, maj@k, best@k per source. On the
        rollout thread with the engines at the finished version (after the batches queued before it)."""
        return self.ahead.at_version(self.version, lambda: self._evaluate(step))

    def _evaluate(self, step: int) -> dict:
        from rl.evaluation import eval_metrics, records_from_samples, records_path, write_records

        cfg = self.cfg
        samples = self.rollout.generate(
            prompt_requests(self.eval_prompts, rows=bool(cfg.rollout.env)),
            self._sampling(eval_stream(step), eval=True),
        )
        # the task's rewards, as `sparkrl eval` scores them: the overlong shaping is a training signal, and
        # eval.max_response_len is not the length it is measured against
        scored = self._score(samples, self.eval_prompts, shaped=False)
        self._check_reward_errors(
            f"eval at step {step}", scored.errors, len(samples), next(iter(scored.messages), "")
        )
        records = records_from_samples(samples, scored.responses)
        write_records(records_path(self.dir, step), records)
        metrics = eval_metrics(records, k=cfg.eval.k)
        self.eval_history.append((step, metrics))
        self.log.event(
            f"[cyan]eval step {step}: "
            + "  ".join(f"{k.removeprefix('val-core/')} {v:.3f}" for k, v in metrics.items())
        )
        return metrics

    # ------------------------------------------------------------------------------------------------
    # Pieces of the step
    # ------------------------------------------------------------------------------------------------

    def _sampling(self, stream: int, eval: bool = False):
        return sampling_spec(self.cfg, sampling_seed(self.cfg.rollout.seed, stream), eval=eval)

    def _score(self, samples: list[Sample], prompts: list[Prompt], offset: int = 0, shaped: bool = True):
        """Fill reward/acc/pred of every sample (shaped: with DAPO's overlong penalty, algorithm.overlong),
        each scored against its prompt's row (`prompts[group - offset]`: data source, ground truth,
        extra_info). -> the RewardResults, with the decoded responses as `responses`."""
        from rl.reward import RewardRow, score_episodes

        responses = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        rows = [RewardRow.of_prompt(prompts[s.group - offset]) for s in samples]
        results = score_episodes(self.reward, samples, responses, rows)
        results.responses = responses
        for line in results.logged:
            self.log.event(
                f"[red]reward: {line}; the first failure of this checker, its traceback and row in "
                f"{self.dir / 'logs' / 'reward.log'}"
            )
        ov = self.cfg.algorithm.overlong
        if shaped and ov.buffer_len > 0:
            lengths = torch.tensor([s.num_generated for s in samples])
            penalty = algo.overlong_penalty(
                lengths, self.cfg.rollout.max_response_len, ov.buffer_len, ov.penalty_factor
            )
            for s, p in zip(samples, penalty.tolist()):
                s.reward += p
        return results

    def _check_reward_errors(self, what: str, errors: float, total: int, first: str) -> None:
        """Stop the run when more than reward.max_error_fraction of `what`'s responses failed to score."""
        limit = self.cfg.reward.max_error_fraction
        if total and errors / total > limit:
            raise StopRun(
                f"{what}: {int(errors)} of {total} responses failed to score ({errors / total:.0%}, over "
                f"reward.max_error_fraction={limit:g}); first: {first}. The traceback and row are in "
                f"{self.dir / 'logs' / 'reward.log'}; fix the reward function and resume (`sparkrl train "
                f"{self.dir} --resume`) or start again"
            )

    def _count_skips(self, step: int, train_metrics: dict) -> int:
        """Counts a skipped update (non-finite loss or gradient); stops the run after
        trainer.max_skipped_steps in a row. -> the run's skipped updates so far (train/skipped_steps)."""
        if train_metrics.get("actor/skipped_step", 0):
            self.skipped_in_a_row += 1
            self.skipped_total += 1
            self.log.event(
                f"[red]step {step}: non-finite loss or gradient; update skipped "
                f"({self.skipped_in_a_row} in a row)"
            )
            limit = self.cfg.trainer.max_skipped_steps
            if limit and self.skipped_in_a_row >= limit:
                raise StopRun(
                    f"step {step}: {self.skipped_in_a_row} updates in a row had a non-finite loss or "
                    f"gradient (trainer.max_skipped_steps={limit}); lower trainer.lr, check the data, or "
                    f"resume from {latest_checkpoint(self.dir)}"
                )
        else:
            self.skipped_in_a_row = 0
        return self.skipped_total

    def _lost_message(self, lost) -> str:
        """What to do once a trainer rank is gone: the step, the rank and node, the checkpoint to resume."""
        ckpt = latest_checkpoint(self.dir)
        then = (
            f"resume from {ckpt} with `sparkrl train {self.dir} --resume`"
            if ckpt is not None
            else "no checkpoint was written yet: start the run again"
        )
        ranks = self.cfg.trainer.num_ranks
        self.log.event(f"[red]step {self.step}: {lost}")
        return (
            f"step {self.step}: {lost}; the run stopped (its steps are collective over all "
            f"{ranks} trainer ranks). Once the cluster has room for {ranks} ranks again, {then}"
        )

    def _has_eval(self) -> bool:
        return bool(self.eval_prompts)

    def _eval_due(self, step: int) -> bool:
        every = self.cfg.eval.every
        return self._has_eval() and (
            (every > 0 and step % every == 0) or step == self.cfg.trainer.total_steps
        )

    def _checkpoint_due(self, step: int) -> bool:
        every = self.cfg.trainer.checkpoint_every
        return (
            bool(self._stop_signal)
            or step == self.cfg.trainer.total_steps
            or (every > 0 and step % every == 0)
        )

    # ------------------------------------------------------------------------------------------------
    # Checkpoint, resume, signals
    # ------------------------------------------------------------------------------------------------

    def checkpoint(self) -> Path:
        state = {
            "step": self.step,
            "adapter_version": self.version,
            # with batches in flight, the state before the oldest: a resumed run generates them again
            "loader": self.ahead.loader_state(),
            "monitor": self.monitor.state_dict(),
            "skipped_total": self.skipped_total,
            "flat_steps_in_a_row": self.flat_steps_in_a_row,
            "eval_history": self.eval_history,
        }
        path = self.checkpoints.save(self.step, state, lambda d: self.trainer.save_checkpoint(str(d)))
        self.log.event(f"checkpoint: {path}")
        return path

    def _resume(self, ckpt: Path) -> None:
        state = load_driver_state(ckpt)
        self.trainer.load_checkpoint(str(ckpt / "trainer"))
        self.step, self.version = state["step"], state["adapter_version"]
        self.loader.load_state_dict(state["loader"])
        self.monitor.load_state_dict(state["monitor"])
        self.skipped_total = state.get("skipped_total", 0)
        self.flat_steps_in_a_row = state.get("flat_steps_in_a_row", 0)
        self.eval_history = [tuple(x) for x in state.get("eval_history", [])]
        print(f"resume: from {ckpt} (step {self.step}, adapter version {self.version})")
        ahead, k = self.ahead, self.ahead.k
        ahead.next_step = self.step + 1
        if k == 0:
            if self.version > 0:  # the fresh engines hold the base model: put the checkpoint's policy on them
                ahead.publish(self.version, self._export_weights())
                ahead.load(self.version)
            return
        # The batches in flight at the checkpoint are generated again, by the versions that generated them
        # (the trainer checkpoint keeps them), from the loader state before the first: the same batches.
        for v in range(max(0, self.step - k), self.version + 1):
            ahead.publish(v, self._export_weights(None if v == self.version else v))
        steps = range(self.step + 1, min(self.cfg.trainer.total_steps, self.step + k) + 1)
        if steps:
            which = ", ".join(f"step {j} (adapter v{ahead.generating_version(j)})" for j in steps)
            print(f"resume: the batches in flight at the checkpoint are generated again: {which}")

    def _check_run_dir(self, resume: bool) -> None:
        if resume:
            if not (self.dir / "config.yaml").exists():
                raise FileNotFoundError(f"--resume: {self.dir} holds no run (no config.yaml)")
            return
        if (self.dir / "metrics.jsonl").exists() or (self.dir / "checkpoints").exists():
            raise FileExistsError(
                f"run directory {self.dir} already holds a run: pass --resume to continue it, "
                f"or choose another run.name"
            )

    def _install_signal_handlers(self) -> dict:
        """SIGTERM and SIGINT finish the step, checkpoint and stop; returns the handlers they replace."""

        def handler(signum, frame):
            if self._stop_signal:  # second signal: stop now
                raise StoppedAtOnce(signal.Signals(signum).name, self.step)
            self._stop_signal = signal.Signals(signum).name
            self.log.event(
                f"[yellow]{self._stop_signal}: finishing step {self.step}, then checkpoint and exit "
                f"(send again to stop at once)"
            )

        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.getsignal(sig)
            signal.signal(sig, handler)
        return previous

    def summary(self, seconds: float) -> dict:
        from rl.metrics import read_metrics

        records = read_metrics(self.dir)
        kls = [r["rollout_corr/k3_kl"] for r in records if isinstance(r.get("rollout_corr/k3_kl"), float)]
        out = {
            "run_dir": str(self.dir),
            "steps": self.step,  # the step the run has reached
            "first_step": self.start_step + 1,  # the first step this invocation ran
            "total_steps": self.cfg.trainer.total_steps,
            "stopped_by": self._stop_signal,  # SIGINT or SIGTERM when a signal stopped it (checkpoint written)
            "seconds": round(seconds, 1),
            "k3_kl_mean": float(np.mean(kls)) if kls else None,
            "k3_kl_max": max(kls) if kls else None,
        }
        if self.eval_history:
            key = next((k for k in self.eval_history[0][1] if "/acc/mean@" in k), None)
            if key:
                out["eval_key"] = key
                out["eval_start"] = self.eval_history[0][1][key]
                out["eval_end"] = self.eval_history[-1][1][key]
        return out

    def close(self) -> None:
        self.ahead.close()
        for part in (self.rollout, self.trainer, self.reward):
            try:
                part.shutdown() if hasattr(part, "shutdown") else part.close()
            except Exception as e:  # noqa: BLE001 - best effort on the way out; report, don't mask the real error
                print(f"shutdown: {type(part).__name__}: {e}")
        if self.owns_ray:
            import ray

            ray.shutdown()


def mismatch_metrics(trainer_logp: list[np.ndarray], samples: list[Sample]) -> dict:
    """`rollout_corr/*` over all response tokens: trainer (adapter v, replayed routing) vs rollout log-probs."""
    t, r, mask = mismatch_tensors(trainer_logp, samples)
    return {k: float(v) for k, v in algo.rollout_mismatch_metrics(t, r, mask).items()}


def policy_lag_k3(current: list[np.ndarray], at_generation: list[np.ndarray], samples: list[Sample]) -> float:
    """k3 KL between the trainer's current adapter and the one that generated the batch (both trainer
    log-probs, routing replayed): how far the policy moved while the batch waited."""
    t, _, mask = mismatch_tensors(current, samples)
    g, _, _ = mismatch_tensors(at_generation, samples)
    return float(algo.rollout_mismatch_metrics(t, g, mask)["rollout_corr/k3_kl"])


EPISODE_METRICS = {
    "turns": "rollout/turns",
    "tool_calls": "rollout/tool_calls",
    "tool_errors": "rollout/tool_errors",
    "cached_tokens": "rollout/prefix_cached_tokens",
}


def episode_metrics(samples: list[Sample]) -> dict:
    """Multi-turn counts (rollout.env): turns, tool calls, tool-call parse errors and context tokens read
    from the engine's prefix cache (an earlier turn's, or the prompt's) per episode (means),
    environment errors and timeouts (totals), and perf/env_s (environment seconds, summed over episodes:
    their steps overlap in a pool, so this is the work, not the wall time). Empty for one-turn batches."""
    eps = [s.episode for s in samples if s.episode is not None]
    if not eps:
        return {}
    out = {name: float(np.mean([e.get(k, 0) for e in eps])) for k, name in EPISODE_METRICS.items()}
    out["rollout/env_errors"] = float(sum(e.get("env_errors", 0) for e in eps))
    out["rollout/env_timeouts"] = float(sum(e.get("env_timeouts", 0) for e in eps))
    out["perf/env_s"] = float(sum(e.get("env_s", 0.0) for e in eps))
    return out


def batch_metrics(all_samples: list[Sample], kept: list[Sample], max_response_len: int) -> dict:
    rewards = np.array([s.reward for s in all_samples], dtype=np.float64)
    lengths = np.array([s.num_generated for s in all_samples], dtype=np.float64)
    from rl.reward import reward_metrics

    return {
        "reward/mean": float(rewards.mean()),
        "acc/mean": float(np.mean([bool(s.acc) for s in all_samples])),
        **reward_metrics(all_samples),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(np.mean([s.finish_reason == "length" for s in all_samples])),
        "batch/kept_groups": len({s.group for s in kept}),
        "batch/flat_group_frac": flat_group_fraction(all_samples),
        "batch/samples": len(kept),
        **episode_metrics(all_samples),
    }


class StoppedAtOnce(KeyboardInterrupt):
    """A second SIGINT/SIGTERM: the run stops where it is, without a checkpoint of the step under way."""

    def __init__(self, signal_name: str, step: int):
        super().__init__(f"{signal_name} again: stopped at once during step {step}")
        self.signal_name, self.step = signal_name, step


def train(cfg: SparkConfig, resume: bool = False) -> dict:
    run = Run(cfg, resume=resume)
    try:
        return run.train()
    finally:
        run.close()


def compile_notice(cfg) -> str | None:
    """The first training step of a compiled GPU trainer runs minutes longer (trainer/parallelize.py): say so
    before it starts, so that a quiet first step does not read as a hang."""
    if cfg.trainer.compile and cfg.resources.num_gpus > 0:
        return (
            "trainer: the first step compiles each decoder layer (torch.compile; a few minutes, once per "
            "trainer start); trainer.compile=false skips it"
        )
    return None


def eval_notice(cfg) -> str | None:
    """eval.every > 0 without eval.data: the run has nothing to evaluate on, said before it starts."""
    if cfg.eval.every > 0 and not cfg.eval.data:
        return (
            f"[yellow]eval.every={cfg.eval.every} but eval.data is not set: no held-out evaluation in this run "
            "(set eval.data to a prompt source, or eval.every=0)"
        )
    return None


def staleness_notice(cfg) -> str | None:
    """rollout.max_staleness > 0 with no cap named: the correction the run applies to the lag and why, said
    before the run; a warning when algorithm.rollout_correction.mode=none leaves the lag unweighed (the update
    then weighs the older adapter's tokens as its own, which stalled the CPU demo, docs/benchmarks.md)."""
    from rl.config import rollout_correction_caps

    k, rc = cfg.rollout.max_staleness, cfg.algorithm.rollout_correction
    if not k or rc.tis_cap or rc.mis_low or rc.mis_high:
        return None
    if rc.mode == "none":
        return (
            f"[yellow]rollout.max_staleness={k} with algorithm.rollout_correction.mode=none: the update weighs "
            "tokens an older adapter sampled as its own (the CPU demo collapsed so); "
            "mode=auto weighs them by current / rollout probability and drops the outliers"
        )
    tis, low, high = rollout_correction_caps(cfg)
    return (
        f"rollout.max_staleness={k}: algorithm.rollout_correction.mode=auto applies tis_cap={tis:g}, "
        f"mis_low={low:g}, mis_high={high:g}: tokens an older adapter sampled are weighed by current / rollout "
        f"probability (at most {tis:g}), those whose probability has since fallen below {low:g}x or risen above "
        f"{high:g}x dropped (mode=none turns it off)"
    )
