"""Write the tool-use demo's dataset (recipes/examples/calculator.yaml): JSON lines in verl's schema.

    python recipes/examples/make_calculator.py    # -> recipes/examples/data/calculator_{train,test}.jsonl

Each row is a three-operand problem ("What is 41 - 15 - 84?" in the DAPO instruction, rl.data.arith_tool)
with its value as `reward_model.ground_truth`; the split strings keep the training, test and warm-up
(`make-tiny --sft arith_tool`) problems apart.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rl.data.arith_tool import make_tool_rows


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
    parser.add_argument("--train-rows", type=int, default=4096)
    parser.add_argument("--test-rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for split, n in (("train", args.train_rows), ("test", args.test_rows)):
        path = write(args.out / f"calculator_{split}.jsonl", make_tool_rows(n, args.seed, split))
        print(f"wrote {path} ({n} rows)")


if __name__ == "__main__":
    main()
