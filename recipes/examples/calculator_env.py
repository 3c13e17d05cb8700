"""The tool-use demo's environment (recipes/examples/calculator.yaml): a calculator the model calls.

Each turn, a `calc` tool call is answered with the tool's message (rl.data.arith_tool.tool_result: the
expression's value from an `ast` walk of integers and + - *, never eval); a block that did not parse as a
call gets the tool's error, so the model can try again; a turn without a call is the final answer, scored
on its "Answer:" line against the row's ground truth. Every step before that returns reward 0.0, so an
episode that runs out of turns while still calling scores 0 (the last reward returned wins). An episode
whose first turn hit the token limit was never stepped: `compute_score`, the recipe's reward function,
scores it the same way (0 without an answer), so that every episode's reward is 0 or 1.
"""

from __future__ import annotations

from rl.data.arith_tool import ARGUMENT, BAD_CALL, TOOL_NAME, answer_of, tool_result
from rollout.env import Environment, EnvStep


def _scored(pred: int | None, answer: int) -> dict:
    return {"score": float(pred == answer), "acc": pred == answer, "pred": "" if pred is None else str(pred)}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature: 1.0 when the last "Answer:" of the text is the ground truth, else 0.0."""
    return _scored(answer_of(solution_str), int(ground_truth))


class Calculator(Environment):
    # The tool as chat templates with a tool format (Qwen3's) render it into every prompt; the tiny model's
    # template has none, so its prompts are unchanged and it knows the tool from its warm-up.
    tools = [
        {
            "type": "function",
            "function": {
                "name": TOOL_NAME,
                "description": "The value of an integer expression of + - * and parentheses.",
                "parameters": {
                    "type": "object",
                    "properties": {ARGUMENT: {"type": "string", "description": "e.g. 41 - 15 + 84"}},
                    "required": [ARGUMENT],
                },
            },
        }
    ]

    def __init__(self, row, **env_kwargs):
        super().__init__(row, **env_kwargs)
        self.answer = int(row["ground_truth"])

    def step(self, assistant_text, tool_calls):
        if tool_calls:
            results = [tool_result(c.name, c.arguments) for c in tool_calls]
            return EnvStep([{"role": "tool", "content": r} for r in results], reward=0.0)
        if "<tool_call>" in assistant_text:  # a call that was not JSON (counted in rollout/tool_errors)
            return EnvStep([{"role": "tool", "content": BAD_CALL}], reward=0.0)
        return EnvStep(done=True, reward=_scored(answer_of(assistant_text), self.answer))
