"""The data contract between rollout, reward and trainer: one `Sample` per generated response.

docs/design.md describes the fields and who fills them. Everything here is plain Python and
numpy so that a batch crosses Ray process boundaries cheaply and without torch in the rollout process.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    # The sampled token's log-prob after temperature (vLLM logprobs_mode="processed_logprobs"),
    # one per response token.
    response_logprobs: np.ndarray
    finish_reason: str
    adapter_version: int
    group: int
    data_source: str = ""
    ground_truth: str = ""
    # One per response token: True where the policy sampled the token (the loss, the k3 check, the entropy
    # and the length metrics count it), False on tokens the environment put into the response span (tool
    # results, user turns of a multi-turn episode), whose log-probs above are placeholders. None: every
    # response token was sampled (one turn).
    loss_mask: np.ndarray | None = None
    # [len(prompt) + len(response) - 1, num_layers, top_k], uint8 or uint16; None without R3 / dense.
    routed_experts: np.ndarray | None = None
    # Or, in a run, a Ray ObjectRef to that array in the object store of the rollout worker's node: the
    # routing goes from the rollout worker to the trainer rank that trains the sample, never through the
    # driver; the rank fetches it and fills routed_experts (trainer.worker).
    routing_ref: Any = None
    # Filled by the reward step.
    reward: float | None = None
    acc: bool | None = None
    pred: str | None = None
    extra: dict = field(default_factory=dict)
    # A multi-turn episode's counts (rollout.env): turns, tool_calls, tool_errors, env_errors, env_timeouts,
    # env_s (seconds in the environment's steps) and reward (the environment's, None: the reward function
    # scores the transcript). None for one-turn rollouts.
    episode: dict | None = None

    def __post_init__(self):
        self.response_logprobs = np.asarray(self.response_logprobs, dtype=np.float32)
        if len(self.response_logprobs) != len(self.response_ids):
            raise ValueError(
                f"Sample.response_logprobs has {len(self.response_logprobs)} entries for "
                f"{len(self.response_ids)} response tokens"
            )
        if self.loss_mask is not None:
            self.loss_mask = np.asarray(self.loss_mask, dtype=bool)
            if self.loss_mask.shape != (len(self.response_ids),):
                raise ValueError(
                    f"Sample.loss_mask has shape {self.loss_mask.shape} for {len(self.response_ids)} response "
                    "tokens"
                )
        if self.routed_experts is not None:
            expected = len(self.prompt_ids) + len(self.response_ids) - 1
            if self.routed_experts.ndim != 3 or self.routed_experts.shape[0] != expected:
                raise ValueError(
                    f"Sample.routed_experts has shape {tuple(self.routed_experts.shape)}, expected "
                    f"[{expected} (prompt + response - 1), num_layers, top_k]"
                )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def generated(self) -> np.ndarray:
        """The loss mask as a bool array of response length (all True without one)."""
        if self.loss_mask is None:
            return np.ones(len(self.response_ids), dtype=bool)
        return self.loss_mask

    @property
    def num_generated(self) -> int:
        """Response tokens the policy sampled: the response length every length metric reports."""
        return len(self.response_ids) if self.loss_mask is None else int(self.loss_mask.sum())

    def without_routing(self) -> Sample:
        """A copy that the trainer scores with its own (live) routing: no routed_experts, no routing_ref."""
        return replace(self, routed_experts=None, routing_ref=None)

    def payload_bytes(self) -> int:
        """The bytes moving this sample between processes carries: token ids (4 bytes each), log-probs,
        and the routing when held by value (a `routing_ref` is a few dozen bytes)."""
        n = 4 * self.num_tokens + self.response_logprobs.nbytes
        n += self.loss_mask.nbytes if self.loss_mask is not None else 0
        return n + (self.routed_experts.nbytes if self.routed_experts is not None else 0)


class RoutingLost(ValueError):
    """A sample's routing held by reference (`Sample.routing_ref`) is gone: the rollout worker that put it
    in its node's object store, or that node, was lost before a trainer rank fetched it. The batch can be
    generated again: its sampling seeds are the step's."""
