"""Multi-turn episodes: the environment a user writes, tool-call parsing, the continuation tokens of the
environment's messages, and the episode loop that advances every episode of a batch turn by turn.

The loop (`run_episodes`) is engine-agnostic: it calls a `TurnEngine` once per turn with the context of every
live episode (one batched engine call a turn) and the environment's `step` of every episode that goes on
concurrently in a bounded thread pool between turns. `rollout.worker.RolloutWorker` gives it vLLM.

Trajectories are token-exact: the context of turn t+1 is the token ids of turn t (its context, the ids as
sampled, then the environment's messages tokenized as the chat template continues after the assistant's
end-of-turn token), never a re-tokenized transcript. docs/environments.md describes the format.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np


@dataclass
class ToolCall:
    """One tool call parsed from the assistant's text: its name and its arguments (a dict, as the JSON gave)."""

    name: str
    arguments: dict


@dataclass
class EnvStep:
    """What an environment answers to one assistant turn: the messages that follow it (chat-template dicts,
    e.g. `{"role": "tool", "content": ...}` or `{"role": "user", ...}`), whether the episode is done, and
    optionally its reward (a float, or a dict with "score" and optionally "acc" and "pred"); None: the
    reward function scores the episode's transcript."""

    messages: list[dict] = field(default_factory=list)
    done: bool = False
    reward: float | dict | None = None


class Environment:
    """Base class of a user's environment (`rollout.env: "file.py:Name"`). One instance per episode, built in
    the rollout worker from the prompt's dataset row (`data_source`, `ground_truth`, `extra_info`, `index`)
    and `rollout.env_kwargs`. `step` is called after every assistant turn that ended on its end-of-turn
    token; it may block (it runs in a thread of a bounded pool, `rollout.env_workers`, and is given up on
    after `rollout.env_timeout_s`). An exception or a timeout ends the episode and is counted."""

    def __init__(self, row: dict, **env_kwargs):
        self.row = row
        self.env_kwargs = env_kwargs

    def step(self, assistant_text: str, tool_calls: list[ToolCall]) -> EnvStep:
        raise NotImplementedError

    def close(self) -> None:
        """Called once the episode ended (release a sandbox, a connection)."""


# ---- tool-call parsers -------------------------------------------------------------------------------

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_json_tool_calls(text: str) -> tuple[list[ToolCall], int]:
    """Qwen / Hermes style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them.
    -> (the calls, the count of blocks that were not such JSON). Parsed with json only."""
    calls, bad = [], 0
    for body in _TOOL_CALL.findall(text):
        try:
            obj = json.loads(body)
        except ValueError:
            bad += 1
            continue
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            bad += 1
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls, bad


def parse_no_tool_calls(text: str) -> tuple[list[ToolCall], int]:
    return [], 0


TOOL_PARSERS: dict[str, Callable[[str], tuple[list[ToolCall], int]]] = {
    "json_tool_call": parse_json_tool_calls,
    "none": parse_no_tool_calls,
}


# ---- continuation tokens -----------------------------------------------------------------------------

_PROBE_USER = "sparkrl-probe-user"
_PROBE_ASSISTANT = "sparkrl-probe-assistant"


class ContinuationError(ValueError):
    """The chat template does not render the environment's messages as a continuation of the turn."""


def continuation_ids(
    tokenizer, messages: list[dict], end_token_id: int, template_kwargs: dict | None = None
) -> list[int]:
    """The token ids the chat template puts after an assistant turn that ended on `end_token_id` (the
    turn's last sampled token): `messages` rendered, then the generation prompt of the next assistant turn.
    template_kwargs: the template's variables the first prompt was rendered with (data.chat_template_kwargs,
    e.g. Qwen3's enable_thinking, which shapes every generation prompt).

    The template renders a probe conversation (a user turn, an assistant turn, then `messages`); the text
    after the end-of-turn token that closes the probe assistant's content is tokenized on its own. That is
    exact for templates whose end-of-turn is a special token (tokenization never merges across it);
    tests/unit/test_rollout_env.py checks it against tokenizing the whole rendering."""
    probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
    full = tokenizer.apply_chat_template(
        probe + list(messages), tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
    )
    at = full.rfind(_PROBE_ASSISTANT)
    eot = tokenizer.decode([end_token_id])
    if at < 0 or not eot:
        raise ContinuationError("the chat template does not render the assistant's content as given")
    end = full.find(eot, at + len(_PROBE_ASSISTANT))
    if end < 0:
        raise ContinuationError(
            f"the chat template does not close an assistant turn with {eot!r}, the token the turn ended on"
        )
    return list(tokenizer.encode(full[end + len(eot) :], add_special_tokens=False))


# ---- the episode loop --------------------------------------------------------------------------------


@dataclass
class TurnOutput:
    """One episode's share of one turn's engine call."""

    token_ids: list[int]
    logprobs: np.ndarray  # the sampled log-probs, one per token
    finish_reason: str  # "stop" (an end-of-turn / stop token) or "length"
    # [len(context) + len(token_ids) - 1, layers, top_k]: every row the call returned, cached prefix included
    routed: np.ndarray | None = None
    cached_tokens: int = 0  # context tokens the engine read from its prefix cache instead of computing


class TurnEngine(Protocol):
    def __call__(
        self, contexts: list[list[int]], seeds: list[int | None], max_tokens: list[int]
    ) -> list[TurnOutput]: ...


@dataclass
class EpisodeLimits:
    max_turns: int
    max_total_tokens: int  # prompt + response span
    env_workers: int
    env_timeout_s: float


@dataclass
class Episode:
    """One episode's trajectory as it grows."""

    prompt_ids: list[int]
    env: Any
    seed: int | None
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    routed: np.ndarray | None = None
    finish_reason: str = ""
    done: bool = False
    texts: list[str] = field(default_factory=list)  # the assistant's text of every turn
    info: dict = field(default_factory=lambda: dict.fromkeys(EPISODE_COUNTS, 0) | {"reward": None})

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def trimmed(self) -> None:
        """End the response at the last generated token: every position the trainer scores was then
        computed by an engine call, and its routing captured there."""
        last = max((i for i, m in enumerate(self.mask) if m), default=-1) + 1
        del self.response_ids[last:], self.logprobs[last:], self.mask[last:]
        if self.routed is not None:
            self.routed = self.routed[: len(self.prompt_ids) + last - 1]


EPISODE_COUNTS = (
    "turns",
    "tool_calls",
    "tool_errors",
    "env_errors",
    "env_timeouts",
    "env_s",
    "cached_tokens",
)

# Turn t of an episode samples with seed + t * TURN_SEED_STRIDE: seeds of different turns never collide
# with another request's (a batch's seeds span far less than 2**32).
TURN_SEED_STRIDE = 1 << 32
STEP_POLL_S = 0.05  # how often the wait for environment steps looks for ones past env_timeout_s


def run_episodes(
    envs: list[Any],
    prompts: list[list[int]],
    seeds: list[int | None],
    engine: TurnEngine,
    tokenizer,
    limits: EpisodeLimits,
    max_tokens: int,
    parser: Callable[[str], tuple[list[ToolCall], int]] = parse_json_tool_calls,
    template_kwargs: dict | None = None,
) -> list[Episode]:
    """Advance every episode turn by turn: one `engine` call a turn for all live episodes, then the
    environments' steps concurrently (also after the last turn, for their reward). An episode ends when its
    environment says done, its turn hit the token limit (finish "length"), `max_turns` turns were generated, the next turn would not fit
    `max_total_tokens`, or its environment raised or timed out (counted in `info`). Each episode's response
    ends at its last generated token (`Episode.trimmed`). template_kwargs: the chat template's variables of
    the prompts, for the environments' messages and the next turns' generation prompts (`continuation_ids`)."""
    episodes = [Episode(list(p), env, s) for p, env, s in zip(prompts, envs, seeds)]
    pool = ThreadPoolExecutor(max(1, limits.env_workers), thread_name_prefix="sparkrl-env")
    try:
        for turn in range(limits.max_turns):
            live = [e for e in episodes if not e.done]
            budgets = [min(max_tokens, limits.max_total_tokens - len(e.context)) for e in live]
            for e, b in zip(live, budgets):
                if b < 1:
                    e.done = True
            live = [e for e, b in zip(live, budgets) if b >= 1]
            if not live:
                break
            outs = engine(
                [e.context for e in live],
                [None if e.seed is None else e.seed + turn * TURN_SEED_STRIDE for e in live],
                [min(max_tokens, limits.max_total_tokens - len(e.context)) for e in live],
            )
            stepping = []
            for e, out in zip(live, outs):
                _append_turn(e, out)
                e.info["turns"] += 1
                if out.finish_reason != "stop":
                    e.done = True
                else:
                    stepping.append(e)
            # After the last turn the environments still see it (for their reward); their messages are unused.
            final = turn == limits.max_turns - 1
            _step_envs(stepping, tokenizer, limits, parser, pool, final, template_kwargs)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    for e in episodes:
        e.trimmed()
        close = getattr(e.env, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                e.info["env_errors"] += 1
    return episodes


def _append_turn(e: Episode, out: TurnOutput) -> None:
    if out.routed is not None:
        rows = len(e.context) + len(out.token_ids) - 1
        if out.routed.shape[0] != rows:
            raise ValueError(f"turn routing has {out.routed.shape[0]} rows, expected {rows}")
        # Rows the earlier calls computed (up to the last token they sampled, which they never forwarded)
        # keep those calls' routing, even where this call read them from the prefix cache; the rest (that
        # token, the environment's tokens, this turn's) are this call's.
        done = 0 if e.routed is None else len(e.routed)
        e.routed = out.routed if done == 0 else np.concatenate([e.routed, out.routed[done:]])
    e.info["cached_tokens"] += out.cached_tokens
    e.response_ids.extend(out.token_ids)
    e.logprobs.extend(np.asarray(out.logprobs, dtype=np.float32).tolist())
    e.mask.extend([True] * len(out.token_ids))
    e.finish_reason = out.finish_reason


def _timed_step(env, text: str, calls: list, started: list[float]) -> tuple[Any, float]:
    started.append(time.perf_counter())
    result = env.step(text, calls)
    return result, time.perf_counter() - started[0]


def _wait_steps(steps: list[tuple[Future, list[float]]], timeout_s: float) -> set[Future]:
    """Wait for every step; those running longer than `timeout_s` (0: no limit) since they began, not since
    they were queued (with more episodes than rollout.env_workers, steps wait their turn in the pool), are
    returned as timed out. Their threads run on (Python cannot stop a thread) and hold a worker until the
    step returns."""
    pending = {f for f, _ in steps}
    if timeout_s <= 0:
        wait(pending)
        return set()
    began = {f: s for f, s in steps}
    timed_out: set[Future] = set()
    while pending:
        _, pending = wait(pending, timeout=STEP_POLL_S, return_when=FIRST_COMPLETED)
        now = time.perf_counter()
        late = {f for f in pending if began[f] and now - began[f][0] > timeout_s}
        timed_out |= late
        pending -= late
    return timed_out


def _step_envs(
    episodes: list[Episode],
    tokenizer,
    limits: EpisodeLimits,
    parser,
    pool,
    final: bool,
    template_kwargs: dict | None,
) -> None:
    if not episodes:
        return
    futures = []
    for e in episodes:
        gen = e.response_ids[len(e.response_ids) - _last_turn_len(e) :]
        text = tokenizer.decode(gen, skip_special_tokens=True)
        e.texts.append(text)
        calls, bad = parser(text)
        e.info["tool_calls"] += len(calls) + bad
        e.info["tool_errors"] += bad
        started: list[float] = []  # set by the worker thread when the step begins
        futures.append((e, started, pool.submit(_timed_step, e.env, text, calls, started)))
    timed_out = _wait_steps([(f, s) for _, s, f in futures], limits.env_timeout_s)
    for e, started, fut in futures:
        if fut in timed_out:
            e.info["env_timeouts"] += 1
            e.info["env_s"] += time.perf_counter() - started[0]
            e.done = True
            continue
        try:
            result, seconds = fut.result()
        except Exception:
            e.info["env_errors"] += 1
            e.info["env_s"] += time.perf_counter() - started[0] if started else 0.0
            e.done = True
            continue
        e.info["env_s"] += seconds
        if not isinstance(result, EnvStep):
            e.info["env_errors"] += 1
            e.done = True
            continue
        if result.reward is not None:
            e.info["reward"] = result.reward
        if result.done or final or not result.messages:
            e.done = True
            continue
        try:
            ids = continuation_ids(tokenizer, result.messages, e.response_ids[-1], template_kwargs)
        except Exception:
            e.info["env_errors"] += 1
            e.done = True
            continue
        if len(e.context) + len(ids) >= limits.max_total_tokens:
            e.done = True  # no room for the next turn's first token
            continue
        e.response_ids.extend(ids)
        e.logprobs.extend([0.0] * len(ids))
        e.mask.extend([False] * len(ids))


def _last_turn_len(e: Episode) -> int:
    n = 0
    for m in reversed(e.mask):
        if not m:
            break
        n += 1
    return n
