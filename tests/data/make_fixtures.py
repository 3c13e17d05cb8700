"""Write the small prompt-set fixtures in each real schema: `python tests/data/make_fixtures.py`.

- dapo_math_17k.parquet: BytedTsinghua-SIA/DAPO-Math-17k (verl schema), 12 rows holding 5 prompts.
- bytedtsinghua_aime_2024.parquet: BytedTsinghua-SIA/AIME-2024 (verl schema), 3 problems repeated 4 times.
- h4_aime_2024.parquet: HuggingFaceH4/aime_2024 (id int64, problem, solution, answer str, url, year str).
- maxwell_aime_2024.jsonl: Maxwell-Jia/AIME_2024 (ID, Problem, Solution, Answer int64).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent

# Keep in step with rl.data.prompts (the fixtures must not import the package they test).
DAPO_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    "form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

AIME = [
    (
        "2024-I-1",
        60,
        "Every morning Aya goes for a $9$-kilometer-long walk and stops at a coffee shop afterwards. When "
        "she walks at a constant speed of $s$ kilometers per hour, the walk takes her 4 hours, including "
        "$t$ minutes spent in the coffee shop. When she walks $s+2$ kilometers per hour, the walk takes her "
        "2 hours and 24 minutes, including $t$ minutes spent in the coffee shop. Suppose Aya walks at "
        "$s+\\frac{1}{2}$ kilometers per hour. Find the number of minutes the walk takes her, including the "
        "$t$ minutes spent in the coffee shop.",
        "204",
    ),
    (
        "2024-I-2",
        61,
        "There exist real numbers $x$ and $y$, both greater than 1, such that "
        "$\\log_x\\left(y^x\\right)=\\log_y\\left(x^{4y}\\right)=10$. Find $xy$.",
        "25",
    ),
    (
        "2024-I-3",
        62,
        "Alice and Bob play the following game. A stack of $n$ tokens lies before them. The players take "
        "turns with Alice going first. On each turn, the player removes either $1$ token or $4$ tokens from "
        "the stack. Whoever removes the last token wins. Find the number of positive integers $n$ less than "
        "or equal to $2024$ for which there exists a strategy for Bob that guarantees that Bob will win the "
        "game regardless of Alice's play.",
        "809",
    ),
]

DAPO = [
    ("In triangle $ABC$, $AB = 13$, $BC = 14$, $CA = 15$. Find the area of the triangle.", "84"),
    ("Find the number of positive divisors of $2^{10} \\cdot 3^{5}$.", "66"),
    ("Let $f(x) = x^2 - 3x + 2$. Compute $f(f(3))$.", "0"),
    ("What is the remainder when $7^{2024}$ is divided by $100$?", "1"),
    ("The sum of two numbers is $1,000$ and their difference is $200$. Find the larger number.", "600"),
]
# Duplicates interleaved as in the real file: first occurrences are rows 0, 1, 3, 6, 8.
DAPO_ORDER = [0, 1, 0, 2, 1, 0, 3, 2, 4, 0, 3, 1]


def verl_row(problem: str, answer: str, index: str) -> dict:
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": f"{DAPO_PREFIX}{problem}{DAPO_SUFFIX}", "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index},
    }


def row_id(name: str, i: int) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"sparkrl-fixture/{name}/{i}"))


def main() -> None:
    dapo = [verl_row(*DAPO[p], row_id("dapo", i)) for i, p in enumerate(DAPO_ORDER)]
    pq.write_table(pa.Table.from_pylist(dapo), HERE / "dapo_math_17k.parquet")

    aime = [
        verl_row(problem, answer, row_id("aime", r * 3 + j))
        for r in range(4)
        for j, (_, _, problem, answer) in enumerate(AIME)
    ]
    pq.write_table(pa.Table.from_pylist(aime), HERE / "bytedtsinghua_aime_2024.parquet")

    h4 = pa.table(
        {
            "id": pa.array([num for _, num, _, _ in AIME], pa.int64()),
            "problem": [p for _, _, p, _ in AIME],
            "solution": [f"A worked solution ending in $\\boxed{{{a}}}$." for *_, a in AIME],
            "answer": [a for *_, a in AIME],
            "url": [
                f"https://artofproblemsolving.com/wiki/index.php/2024_AIME_I_Problems/Problem_{i + 1}"
                for i in range(3)
            ],
            "year": ["2024"] * 3,
        }
    )
    pq.write_table(h4, HERE / "h4_aime_2024.parquet")

    with open(HERE / "maxwell_aime_2024.jsonl", "w", encoding="utf-8") as f:
        for key, _, problem, answer in AIME:
            row = {"ID": key, "Problem": problem, "Solution": "A worked solution.", "Answer": int(answer)}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
