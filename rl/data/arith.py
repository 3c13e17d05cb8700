"""A synthetic arithmetic source in verl's schema: the embedded default for the demo and the tests.

Deterministic for a seed and needs no network. Each row is a dict with `data_source`, `prompt` (chat
messages), `reward_model` ({"style": "rule", "ground_truth": str}) and `extra_info`, exactly as verl's
parquet files hold them, so everything downstream treats it like DAPO-Math-17K.

`sft_response` gives the supervised target used to build the demo's starting policy: a one-line working
and the DAPO "Answer:" line. With `noise > 0` the stated result is wrong for that fraction of rows, so a
model fit to it samples the right answer only about (1 - noise) of the time: a policy that RL can improve.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rl.data.prompts import dapo_prompt

DATA_SOURCE = "synthetic/arith"


@dataclass(frozen=True)
class ArithSpec:
    """Difficulty knobs. Operands are drawn uniformly from [0, max_operand]."""

    num_terms: int = 2
    max_operand: int = 9
    ops: str = "+-"

    def __post_init__(self):
        if self.num_terms < 2:
            raise ValueError(f"ArithSpec.num_terms must be >= 2, got {self.num_terms}")
        if self.max_operand < 1:
            raise ValueError(f"ArithSpec.max_operand must be >= 1, got {self.max_operand}")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"ArithSpec.ops must be a non-empty string of '+', '-', '*', got {self.ops!r}")


def _expression(rng: random.Random, spec: ArithSpec) -> tuple[str, int]:
    terms = [rng.randint(0, spec.max_operand) for _ in range(spec.num_terms)]
    ops = [rng.choice(spec.ops) for _ in range(spec.num_terms - 1)]
    text = str(terms[0]) + "".join(f" {op} {t}" for op, t in zip(ops, terms[1:]))
    # Left to right with * binding tighter: evaluate by hand, never with eval().
    stack = [terms[0]]
    for op, t in zip(ops, terms[1:]):
        if op == "*":
            stack[-1] = stack[-1] * t
        else:
            stack.append(t if op == "+" else -t)
    value = sum(stack)
    return text, value


def make_rows(n: int, seed: int, spec: ArithSpec = ArithSpec(), split: str = "train") -> list[dict]:
    """`n` problems in verl's schema. Different `split` strings give disjoint random streams."""
    if n <= 0:
        raise ValueError(f"make_rows: n must be positive, got {n}")
    rng = random.Random(f"{seed}/{split}/{spec}")
    rows = []
    for i in range(n):
        text, value = _expression(rng, spec)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": dapo_prompt(f"What is {text}?")}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(value)},
                "extra_info": {"split": split, "index": i, "expression": text},
            }
        )
    return rows


def sft_response(row: dict, rng: random.Random, noise: float = 0.0) -> str:
    """The supervised target for `row`: "<expr> = <v>." then "Answer: <v>"; wrong by 1 to 3 with p=noise."""
    value = int(row["reward_model"]["ground_truth"])
    if noise > 0 and rng.random() < noise:
        value += rng.choice([-3, -2, -1, 1, 2, 3])
    return f"{row['extra_info']['expression']} = {value}.\nAnswer: {value}"
