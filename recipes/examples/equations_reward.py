"""The equations example's reward: verl's signature, partial credit, a dict with extra metrics.

The response should write the problem's equation with its value and repeat the value on an "Answer:"
line ("7 - 3 = 4.\nAnswer: 4"). Credit adds up to 1:

    0.1  an equation "x op y = v" in the response
    0.1  it is this problem's (x, op, y as in the ground truth "a op b")
    0.5  and it is true (v = a op b)
    0.3  and the Answer: line gives that same value

Parsed with regular expressions and integer arithmetic, never eval().
"""

from __future__ import annotations

import re

EQUATION = re.compile(r"(-?\d+)\s*([+-])\s*(-?\d+)\s*=\s*(-?\d+)")
ANSWER = re.compile(r"Answer:\s*(-?\d+)\s*$")
EXPRESSION = re.compile(r"^\s*(-?\d+)\s*([+-])\s*(-?\d+)\s*$")


def _value(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def compute_score(data_source, solution_str, ground_truth, extra_info=None, answer_weight=0.3):
    """-> {"score", "acc", "pred", "equation", "equation_true"}; the last two become reward/<key> metrics."""
    problem = EXPRESSION.match(ground_truth)
    if problem is None:
        raise ValueError(f"ground truth {ground_truth!r} is not an expression 'a op b'")
    a, op, b = int(problem[1]), problem[2], int(problem[3])
    want = _value(a, op, b)
    found = EQUATION.search(solution_str)
    answer = ANSWER.search(solution_str.strip())
    pred = answer[1] if answer else ""
    if found is None:
        return {"score": 0.0, "acc": False, "pred": pred, "equation": 0.0, "equation_true": 0.0}
    x, o, y, v = int(found[1]), found[2], int(found[3]), int(found[4])
    ours = (x, o, y) == (a, op, b)
    true = ours and v == want
    repeated = true and answer is not None and int(answer[1]) == v
    score = 0.1 + 0.1 * ours + 0.5 * true + answer_weight * repeated
    return {
        "score": round(score, 6),
        "acc": bool(repeated),
        "pred": pred,
        "equation": 1.0,
        "equation_true": float(true),
    }
