"""The calculator task of the tool-use demo: the tool (a safe evaluator of integer arithmetic), its call
and result format, and the noisy transcripts that `make-tiny --sft arith_tool` (rl.tiny_tool_sft) fits.

A problem (`make_tool_rows`, verl's schema) is three operands of 0..99 (SPEC), too long for the tiny model
to add up in one turn, asked with the DAPO instruction the `arith` model was fit on (rl.data.prompts: its
familiar context; the warm-up learns the calls much faster there than after a new, shorter prompt).
A clean transcript has two assistant turns after it:

    assistant: <tool_call>{"name": "calc", "arguments": {"expr": "41 - 15 - 84"}}</tool_call>
    tool:      -58
    assistant: Answer: -58

recipes/examples/calculator_env.py answers the calls with `tool_result` (the same text the transcripts
show) and scores the final "Answer:" line.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re

from rl.data.arith import ArithSpec, make_rows

TOOL_NAME = "calc"
ARGUMENT = "expr"
SPEC = ArithSpec(num_terms=3, max_operand=99, ops="+-")
DATA_SOURCE = "calculator"
# The tool's answer to a block that did not parse as a call, and to a call it cannot evaluate.
BAD_CALL = "error: bad call"
MAX_EXPRESSION_CHARS = 64  # bounds the parse and the size of any product
ANSWER = re.compile(r"Answer:\s*(-?\d+)")

# Kinds of transcript and their shares: the warm-up's deliberate mistakes, which GRPO then removes (the
# model's own slips at temperature 1, mostly in copying the expression, add to them). `malformed` recovers
# (the tool's error, then a clean call): it shows as tool_errors and a third turn, not as a wrong answer.
NOISE = {
    "guess": 0.15,  # no call: a wrong "Answer:" straight away
    "wrong_call": 0.1,  # one operand mis-copied into the call; the tool's (wrong) result is answered
    "miscopy": 0.1,  # a right call, its result mis-copied into the answer
    "malformed": 0.05,  # a call that is not JSON, the tool's error, then a right call
}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> int:
    """The value of an integer expression of + - * (parentheses and unary minus allowed). The text is
    parsed with `ast` and only those nodes are walked: model output is never evaluated by Python.
    Raises ValueError on anything else (names, calls, division, powers, floats, over-long text)."""
    if not isinstance(expression, str):
        raise ValueError(f"an expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"an expression of at most {MAX_EXPRESSION_CHARS} characters, got {len(expression)}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {expression!r}") from e

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:  # bool is an int subclass: excluded
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"not allowed in an expression: {type(node).__name__}")

    return walk(tree.body)


def tool_result(name: str, arguments: dict) -> str:
    """The tool message's content for one call: the value, or an error the model can read."""
    if name != TOOL_NAME or set(arguments) != {ARGUMENT}:
        return BAD_CALL
    try:
        return str(calculate(arguments[ARGUMENT]))
    except ValueError as e:
        return f"error: {e}"


def make_tool_rows(n: int, seed: int, split: str) -> list[dict]:
    """`n` problems of SPEC in verl's schema (rl.data.arith's rows, data source DATA_SOURCE); different
    `split` strings give disjoint streams."""
    rows = make_rows(n, seed, SPEC, split=split)
    for row in rows:
        row["data_source"] = DATA_SOURCE
    return rows


def tool_call(expression: str) -> str:
    """The assistant's text of a call (the json_tool_call format of rollout.env)."""
    return (
        "<tool_call>" + json.dumps({"name": TOOL_NAME, "arguments": {ARGUMENT: expression}}) + "</tool_call>"
    )


def answer_of(text: str) -> int | None:
    """The integer of the last "Answer:" in `text`, None without one."""
    found = ANSWER.findall(text)
    return int(found[-1]) if found else None


def _off(rng: random.Random, low: int, high: int) -> int:
    return rng.choice([-1, 1]) * rng.randint(low, high)


def _miscopied(expression: str, rng: random.Random) -> str:
    """`expression` with one operand changed by 1 to 9 (kept non-negative)."""
    parts = expression.split(" ")
    i = 2 * rng.randrange((len(parts) + 1) // 2)
    value = int(parts[i])
    parts[i] = str(value + rng.randint(1, 9) if value < 10 else value + _off(rng, 1, 9))
    return " ".join(parts)


def transcript(row: dict, rng: random.Random, noise: dict[str, float] = NOISE) -> tuple[str, list[dict]]:
    """(kind, messages): the assistant and tool messages after `row`'s prompt, clean or one of the `noise`
    kinds drawn with its share."""
    expression = row["extra_info"]["expression"]
    value = int(row["reward_model"]["ground_truth"])
    draw, kind = rng.random(), "clean"
    for name, share in noise.items():
        if draw < share:
            kind = name
            break
        draw -= share

    def call(expr: str) -> list[dict]:
        return [
            {"role": "assistant", "content": tool_call(expr)},
            {"role": "tool", "content": tool_result(TOOL_NAME, {ARGUMENT: expr})},
        ]

    if kind == "guess":
        return kind, [{"role": "assistant", "content": f"Answer: {value + _off(rng, 1, 30)}"}]
    if kind == "wrong_call":
        wrong = _miscopied(expression, rng)
        return kind, [*call(wrong), {"role": "assistant", "content": f"Answer: {calculate(wrong)}"}]
    if kind == "miscopy":
        return kind, [
            *call(expression),
            {"role": "assistant", "content": f"Answer: {value + _off(rng, 1, 9)}"},
        ]
    messages = []
    if kind == "malformed":
        broken = tool_call(expression).replace("}}", "}", 1)  # an unclosed object: not JSON
        messages = [{"role": "assistant", "content": broken}, {"role": "tool", "content": BAD_CALL}]
    return kind, [*messages, *call(expression), {"role": "assistant", "content": f"Answer: {value}"}]
