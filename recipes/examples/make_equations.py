"""Write the equations example's dataset: JSON lines in verl's schema, two data sources in one file.

    python recipes/examples/make_equations.py            # -> recipes/examples/data/{train,test}.jsonl

Each row is a two-number problem "What is a - b?" (the prompt the CPU demo's tiny model was warmed up on)
with one of two data sources, scored by its own checker (recipes/examples/equations.yaml):

- `equations`: the response must write the problem's equation and its value ("7 - 3 = 4.") and end with
  the value on an "Answer:" line; `reward_model.ground_truth` is the expression ("7 - 3"), which
  equations_reward.py parses and scores with partial credit;
- `arith`: the plain answer, `reward_model.ground_truth` the value ("4"), scored by math_dapo.

`extra_info` carries the operands, which the reward reads to check the equation's numbers.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{question}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
SOURCES = ("equations", "arith")


def make_rows(n: int, seed: int, split: str) -> list[dict]:
    """n rows alternating between the two sources; operands 0..9, + or -."""
    rng = random.Random(f"equations/{seed}/{split}")
    rows = []
    for i in range(n):
        a, b, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+-")
        value = a + b if op == "+" else a - b
        source = SOURCES[i % 2]
        rows.append(
            {
                "data_source": source,
                "prompt": [
                    {"role": "user", "content": INSTRUCTION.format(question=f"What is {a} {op} {b}?")}
                ],
                "ability": "math",
                "reward_model": {
                    "style": "rule",
                    "ground_truth": f"{a} {op} {b}" if source == "equations" else str(value),
                },
                "extra_info": {"split": split, "index": i, "operands": [a, b], "op": op},
            }
        )
    return rows


def write(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "data")
    parser.add_argument("--train-rows", type=int, default=2048)
    parser.add_argument("--test-rows", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for split, n in (("train", args.train_rows), ("test", args.test_rows)):
        print(f"wrote {write(args.out / f'{split}.jsonl', make_rows(n, args.seed, split))} ({n} rows)")


if __name__ == "__main__":
    main()
