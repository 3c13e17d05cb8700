"""rollout.env: the tool-call parser, the continuation tokens of environment messages, and the episode loop.

The loop is driven here by a fake engine (`FakeEngine`): it answers each turn from a script and returns
routing whose rows say which call computed them, so the bookkeeping (token-exact contexts, the loss mask,
log-prob placeholders, the routing stitched across calls, the bounds, env errors and timeouts) is checked
without vLLM. tests/integration/test_rollout_env.py runs the same loop on the real engine.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from rl.tiny import EOS_TOKEN, train_tokenizer
from rollout.env import (
    EnvStep,
    EpisodeLimits,
    ToolCall,
    TurnOutput,
    continuation_ids,
    parse_json_tool_calls,
    run_episodes,
)


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(0)


# ---- parser ------------------------------------------------------------------------------------------


def test_json_tool_calls():
    text = (
        'think <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and '
        '<tool_call>\n{"name": "mul", "arguments": "{\\"a\\": 3}"}\n</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
    )
    calls, bad = parse_json_tool_calls(text)
    assert calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("mul", {"a": 3})]
    assert bad == 2
    assert parse_json_tool_calls("no calls here") == ([], 0)


# ---- continuation tokens -----------------------------------------------------------------------------


def _check_continuation(tok, messages, eot_id):
    """The ids appended after the turn's end token are exactly what the template renders after it."""
    convo = [{"role": "user", "content": "what is 2+3?"}, {"role": "assistant", "content": "let me see"}]
    ids = continuation_ids(tok, messages, eot_id)
    head = tok.apply_chat_template(convo, tokenize=False)
    cut = head.rfind(tok.decode([eot_id])) + len(tok.decode([eot_id]))
    full = tok.apply_chat_template(convo + messages, tokenize=False, add_generation_prompt=True)
    assert full.startswith(head[:cut])
    assert tok.encode(head[:cut], add_special_tokens=False) + ids == tok.encode(
        full, add_special_tokens=False
    )
    return ids


def test_continuation_tiny_template(tok):
    eot = tok.convert_tokens_to_ids(EOS_TOKEN)
    messages = [{"role": "tool", "content": '{"result": 5}'}, {"role": "user", "content": "and 7+8?"}]
    ids = _check_continuation(tok, messages, eot)
    text = tok.decode(ids)
    assert text.startswith("\n<|tool|>\n") and text.endswith("<|assistant|>\n")


# ---- the episode loop --------------------------------------------------------------------------------

LAYERS, TOP_K = 2, 2


class FakeEngine:
    """Answers each turn of each episode from `script` (a list of token lists, one per turn); the routing it
    returns fills every row with the call number, so the stitched routing shows which call computed a row."""

    def __init__(self, tok, script, end_id):
        self.tok, self.script, self.end_id = tok, script, end_id
        self.calls = []  # (contexts, seeds, max_tokens) of every call

    def __call__(self, contexts, seeds, max_tokens):
        self.calls.append((contexts, seeds, max_tokens))
        call = len(self.calls)
        outs = []
        for ctx, m in zip(contexts, max_tokens):
            # every live episode is at the same turn: run_episodes calls the engine once a turn
            ids = list(self.script[min(call - 1, len(self.script) - 1)]) + [self.end_id]
            reason = "stop"
            if len(ids) > m:
                ids, reason = ids[:m], "length"
            routed = np.full((len(ctx) + len(ids) - 1, LAYERS, TOP_K), call, dtype=np.uint8)
            outs.append(TurnOutput(ids, np.full(len(ids), -0.5, dtype=np.float32), reason, routed))
        return outs


class CountingEnv:
    def __init__(self, row, turns=3, fail_at=None, sleep_at=None):
        self.row, self.turns, self.fail_at, self.sleep_at = row, turns, fail_at, sleep_at
        self.seen, self.closed = [], False

    def step(self, text, calls):
        self.seen.append((text, calls))
        if self.fail_at == len(self.seen):
            raise RuntimeError("tool crashed")
        if self.sleep_at == len(self.seen):
            time.sleep(2)
        done = len(self.seen) >= self.turns
        return EnvStep([{"role": "tool", "content": f"result {len(self.seen)}"}], done, float(len(self.seen)))

    def close(self):
        self.closed = True


def _limits(**kw):
    return EpisodeLimits(
        **({"max_turns": 3, "max_total_tokens": 512, "env_workers": 2, "env_timeout_s": 0} | kw)
    )


def _script(tok):
    return [
        tok.encode('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'),
        tok.encode("ok"),
        tok.encode("done"),
    ]


def test_template_variables_shape_every_turns_generation_prompt():
    """data.chat_template_kwargs (here a Qwen3-style `enable_thinking`) rendered the first prompt; the
    environment's messages and the next turn's generation prompt are rendered with them too, through the
    episode loop as through continuation_ids."""
    tok = train_tokenizer(0)
    tok.chat_template = tok.chat_template.replace(
        "{{ '<|assistant|>\\n' }}",
        "{{ '<|assistant|>\\n' }}{%- if enable_thinking is defined and not enable_thinking %}{{ 'no thinking: ' }}"
        "{%- endif %}",
    )
    end = tok.convert_tokens_to_ids(EOS_TOKEN)
    messages = [{"role": "tool", "content": "result 1"}]
    plain = continuation_ids(tok, messages, end)
    off = continuation_ids(tok, messages, end, {"enable_thinking": False})
    assert tok.decode(off).endswith("<|assistant|>\nno thinking: ")
    assert off[: len(plain)] == plain and len(off) > len(plain)

    engine = FakeEngine(tok, _script(tok), end)
    prompt = tok.encode("<|user|>\nadd<|end|>\n<|assistant|>\nno thinking: ")
    run_episodes(
        [CountingEnv({})],
        [prompt],
        [7],
        engine,
        tok,
        _limits(),
        64,
        template_kwargs={"enable_thinking": False},
    )
    assert engine.calls[1][0][0] == prompt + _script(tok)[0] + [end] + off


def test_three_turns_token_exact(tok):
    end = tok.convert_tokens_to_ids(EOS_TOKEN)
    engine = FakeEngine(tok, _script(tok), end)
    prompt = tok.encode("<|user|>\nadd<|end|>\n<|assistant|>\n")
    envs = [CountingEnv({}), CountingEnv({})]
    eps = run_episodes(envs, [prompt, prompt], [7, None], engine, tok, _limits(), 64)
    assert len(engine.calls) == 3 and [len(c[0]) for c in engine.calls] == [2, 2, 2]  # batched per turn
    assert engine.calls[1][1] == [7 + (1 << 32), None]  # per-turn seeds
    e = eps[0]
    # turn t+1's context is turn t's, its sampled ids and the env message's continuation ids
    ctx1 = engine.calls[1][0][0]
    turn0 = _script(tok)[0] + [end]
    assert ctx1 == prompt + turn0 + continuation_ids(tok, [{"role": "tool", "content": "result 1"}], end)
    assert engine.calls[2][0][0][: len(ctx1)] == ctx1
    assert e.prompt_ids == prompt and e.prompt_ids + e.response_ids == engine.calls[2][0][0] + _script(tok)[
        2
    ] + [end]
    mask = np.array(e.mask)
    assert mask.sum() == sum(len(t) + 1 for t in _script(tok)) and mask[-1] and not mask.all()
    lp = np.array(e.logprobs)
    assert (lp[mask] == -0.5).all() and (lp[~mask] == 0.0).all()
    assert e.info["turns"] == 3 and e.info["tool_calls"] == 1 and e.info["reward"] == 3.0
    assert len(envs[0].seen) == 3  # stepped after the last turn too, for its reward
    assert envs[0].seen[0][1] == [ToolCall("add", {"a": 1})] and envs[0].closed
    # routing: every row from the call that computed it; rows before a call's context end from earlier calls
    assert e.routed.shape[0] == len(e.prompt_ids) + len(e.response_ids) - 1
    # (call k computed its context's rows past the earlier calls' and its sampled tokens' but the last)
    ends = [len(engine.calls[k][0][0]) + len(_script(tok)[k]) for k in range(3)]
    assert (e.routed[: ends[0]] == 1).all()
    assert (e.routed[ends[0] : ends[1]] == 2).all()
    assert (e.routed[ends[1] :] == 3).all() and len(e.routed) == ends[2]


def test_max_turns_ends_at_last_generated_token(tok):
    end = tok.convert_tokens_to_ids(EOS_TOKEN)
    engine = FakeEngine(tok, _script(tok), end)
    eps = run_episodes([CountingEnv({}, turns=10)], [[5, 6]], [0], engine, tok, _limits(max_turns=2), 64)
    e = eps[0]
    assert e.info["turns"] == 2 and e.done
    assert e.mask[-1] and e.response_ids[-1] == end  # no trailing env tokens: every scored row was routed
    assert e.routed.shape[0] == 2 + len(e.response_ids) - 1


def test_max_total_tokens(tok):
    end = tok.convert_tokens_to_ids(EOS_TOKEN)
    engine = FakeEngine(tok, _script(tok), end)
    first = len(_script(tok)[0]) + 1
    limit = 2 + first + 3  # room for the first turn, not for the env message and another turn
    eps = run_episodes(
        [CountingEnv({}, turns=10)], [[5, 6]], [0], engine, tok, _limits(max_total_tokens=limit), 64
    )
    assert eps[0].info["turns"] == 1 and len(eps[0].prompt_ids) + len(eps[0].response_ids) <= limit
    # a turn is cut to the room left (finish "length"), which ends the episode
    engine = FakeEngine(tok, _script(tok), end)
    eps = run_episodes(
        [CountingEnv({}, turns=10)], [[5, 6]], [0], engine, tok, _limits(max_total_tokens=5), 64
    )
    assert eps[0].finish_reason == "length" and len(eps[0].response_ids) == 3


def test_env_error_and_timeout_end_the_episode(tok):
    end = tok.convert_tokens_to_ids(EOS_TOKEN)
    engine = FakeEngine(tok, _script(tok), end)
    envs = [
        CountingEnv({}, turns=10, fail_at=1),
        CountingEnv({}, turns=10, sleep_at=2),
        CountingEnv({}, turns=3),
    ]
    eps = run_episodes(envs, [[5, 6]] * 3, [0, 1, 2], engine, tok, _limits(env_timeout_s=0.5), 64)
    assert eps[0].info["env_errors"] == 1 and eps[0].info["turns"] == 1
    assert eps[1].info["env_timeouts"] == 1 and eps[1].info["turns"] == 2
    assert eps[2].info["turns"] == 3 and eps[2].info["env_errors"] == eps[2].info["env_timeouts"] == 0
    for e in eps:
        assert e.mask[-1]


class SlowEnv:
    """Each step takes `seconds`; done after the second."""

    def __init__(self, row, seconds):
        self.seconds, self.steps = seconds, 0

    def step(self, text, calls):
        self.steps += 1
        time.sleep(self.seconds)
        return EnvStep([{"role": "tool", "content": "r"}], self.steps >= 2)


def test_env_timeout_counts_from_the_step_start_not_its_queueing(tok):
    """12 episodes on 2 env workers: steps of 0.2 s wait up to 1.0 s and more in the pool's queue before they
    begin, longer than env_timeout_s 1.0 (counted from submission, the last ones would time out); none of
    them does, each step running a fifth of the limit. A step of 3 s does."""
    end = tok.convert_tokens_to_ids(EOS_TOKEN)
    engine = FakeEngine(tok, _script(tok), end)
    envs = [SlowEnv({}, 0.2) for _ in range(12)] + [SlowEnv({}, 3.0)]
    eps = run_episodes(envs, [[5, 6]] * 13, list(range(13)), engine, tok, _limits(env_timeout_s=1.0), 64)
    for e in eps[:12]:
        assert e.info["env_timeouts"] == 0 and e.info["turns"] == 2, e.info
        assert 0.35 <= e.info["env_s"] < 1.5  # two steps' own time, not their time in the queue
    assert eps[12].info["env_timeouts"] == 1 and eps[12].info["turns"] == 1


# ---- config, preflight, reward and metrics -----------------------------------------------------------

ENV_FILE = """
from rollout.env import EnvStep


class Good:
    def __init__(self, row, scale=1):
        assert "ground_truth" in row and "extra_info" in row
        self.scale = scale

    def step(self, text, calls):
        return EnvStep(done=True, reward=float(self.scale))


class WithTools(Good):
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


class BadTools(Good):
    tools = ["calc"]  # names, not schemas


class Broken:
    def __init__(self, row):
        raise KeyError("needs a tools column")

    def step(self, text, calls):
        return EnvStep(done=True)
"""


def test_env_config_and_preflight(tmp_path):
    from rl.config import ConfigError, load_config
    from rl.preflight import env_problems

    env_file = tmp_path / "my_env.py"
    env_file.write_text(ENV_FILE)
    base = ["logging.tensorboard=false", "run.name=t"]
    cfg = load_config("demo_cpu", [*base, "rollout.env=my_env.py:Good", "rollout.env_kwargs={scale: 2}"])
    # made absolute at load: an override against the working directory
    assert cfg.rollout.env == f"{Path.cwd() / 'my_env.py'}:Good" and cfg.rollout.env_kwargs == {"scale": 2}
    cfg.rollout.env = f"{env_file}:Good"
    rows = [{"data_source": "d", "reward_model": {"ground_truth": "5"}, "extra_info": {}, "prompt": []}]

    class Rows(list):
        pass

    assert env_problems(cfg, Rows(rows)) == []
    cfg.rollout.env, cfg.rollout.env_kwargs = f"{env_file}:Broken", {}
    (problem,) = env_problems(cfg, Rows(rows))
    assert problem.startswith("rollout.env:") and "KeyError" in problem
    cfg.rollout.env = f"{env_file}:Missing"
    (problem,) = env_problems(cfg, Rows(rows))
    assert "rollout.env" in problem and "Missing" in problem
    with pytest.raises(ConfigError, match="rollout.max_total_tokens"):
        load_config("demo_cpu", [*base, "rollout.max_total_tokens=100000"])
    with pytest.raises(ConfigError, match="rollout.env"):
        load_config("demo_cpu", [*base, "rollout.env=not_an_import_path"])


# A chat template that lists the tools it is given before the conversation, as Qwen3's and Muse's do
TOOLS_TEMPLATE = (
    "{%- if tools %}{{ 'TOOLS ' }}{%- for t in tools %}{{ t['function']['name'] + ' ' }}{%- endfor %}"
    "{%- endif %}{%- for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{%- endif %}"
)


def test_prompts_render_the_environments_tools(tok, tmp_path):
    """An environment's `tools` reach the chat template of every prompt (a row's own `tools` column takes
    precedence); malformed tools are one line naming the row or the class, at load and in the preflight."""
    import copy

    import datasets

    from rl.config import load_config
    from rl.data.loader import tokenize_prompts
    from rl.preflight import env_problems
    from rl.setup import env_tools

    tok = copy.deepcopy(tok)
    tok.chat_template = TOOLS_TEMPLATE
    env_file = tmp_path / "my_env.py"
    env_file.write_text(ENV_FILE)
    cfg = load_config("demo_cpu", ["logging.tensorboard=false", f"rollout.env={env_file}:WithTools"])
    tools = env_tools(cfg)
    assert [x["function"]["name"] for x in tools] == ["calc"]
    row = {
        "data_source": "d",
        "reward_model": {"ground_truth": "5"},
        "prompt": [{"role": "user", "content": "2+3"}],
    }
    own = json.dumps([{"type": "function", "function": {"name": "search"}}])
    ds = datasets.Dataset.from_list([{**row, "tools": ""}, {**row, "tools": own}])
    prompts, _ = tokenize_prompts(ds, tok, 256, tools=tools)
    texts = [tok.decode(p.prompt_ids) for p in prompts]
    assert texts[0].startswith("TOOLS calc ") and texts[1].startswith("TOOLS search ")
    (plain,), _ = tokenize_prompts(datasets.Dataset.from_list([row]), tok, 256)
    assert "TOOLS" not in tok.decode(plain.prompt_ids)  # no environment tools, no tools column

    bad = datasets.Dataset.from_list([{**row, "tools": "[not json"}])
    with pytest.raises(ValueError, match=r"row 0, column 'tools': tools must be a JSON list"):
        tokenize_prompts(bad, tok, 256)
    cfg.rollout.env = f"{env_file}:BadTools"
    (problem,) = env_problems(cfg)
    assert problem.startswith("rollout.env:") and "tools must be a list of tool schemas" in problem


def test_env_reward_and_episode_metrics():
    from rl.core.batch import Sample
    from rl.driver import episode_metrics
    from rl.reward import apply_env_reward

    def sample(episode):
        s = Sample(
            [1, 2], [3, 4], np.zeros(2), "stop", 0, 0, loss_mask=np.array([True, False]), episode=episode
        )
        s.reward, s.acc = -1.0, False
        return s

    info = {"turns": 3, "tool_calls": 2, "tool_errors": 1, "env_errors": 0, "env_timeouts": 1, "env_s": 0.5}
    a, b, c = (
        sample(info | {"reward": 1.0}),
        sample(info | {"reward": {"score": 0.5, "acc": False}}),
        sample(None),
    )
    for s in (a, b, c):
        apply_env_reward(s)
    assert (a.reward, a.acc, b.reward, b.acc, c.reward) == (1.0, True, 0.5, False, -1.0)
    assert (a.pred, b.pred, c.pred) == ("", "", None)  # an env reward without a pred: no answer, for maj@k
    m = episode_metrics([a, b, c])
    assert m["rollout/turns"] == 3 and m["rollout/env_timeouts"] == 2 and m["perf/env_s"] == 1.0
    assert episode_metrics([c]) == {}


def test_only_episodes_without_an_env_reward_go_to_the_reward_function():
    from rl.core.batch import Sample
    from rl.reward import RewardResults, RewardRow, score_episodes

    class Scorer:
        def score_samples(self, samples, responses, rows):
            self.seen = list(responses)
            for s in samples:
                s.reward, s.acc = 0.25, False
            return RewardResults([{"score": 0.25, "acc": False, "pred": ""} for _ in samples])

    samples = [
        Sample([1], [2], np.zeros(1), "stop", 0, 0, episode={"reward": r})
        for r in (1.0, None, {"score": 0.0})
    ]
    scorer = Scorer()
    out = score_episodes(scorer, samples, ["a", "b", "c"], [RewardRow("d", "x")] * 3)
    assert scorer.seen == ["b"] and len(out.results) == 1
    assert [s.reward for s in samples] == [1.0, 0.25, 0.0]
    assert score_episodes(scorer, samples[:1], ["a"], [RewardRow("d", "x")]).results == []
