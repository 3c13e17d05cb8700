"""The pieces of bench.summarize's markdown that the goals and the tables share: which rows count, how a figure
is written, a table, a verdict word, a trainer row's activation checkpointing, tokens/s by batch."""

from __future__ import annotations

import argparse
import statistics

from bench.trainer import ac_fields, parse_ac

CONFIGS = ("bf16", "bf16_lora", "nvfp4_lora", "nvfp4_lora_r3")  # the rollout table's engines, in its order
GOALS = {"r3_cost": 0.03, "sync_share": 0.02, "mfu": 0.30, "k3": 1e-4}  # issue 11


def ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok"]


def fmt(v, spec: str = ".3g") -> str:
    if v is None:
        return "—"
    if isinstance(v, float) and spec.endswith("%"):
        return f"{v:{spec}}"
    return f"{v:{spec}}" if isinstance(v, int | float) else str(v)


def table(header: list[str], body: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return out + ["| " + " | ".join(str(c) for c in row) + " |" for row in body]


def verdict(passed: bool | None) -> str:
    return "—" if passed is None else ("PASS" if passed else "FAIL")


def ac_label(r: dict) -> str:
    """A trainer row's activation checkpointing: on, off, or `budget B` (compiled layers whose partitioner
    recomputes within memory budget B instead of whole-layer checkpointing). Older rows have no budget,
    the oldest no flag either (on)."""
    budget = r.get("activation_memory_budget") or 0
    if budget:
        return f"budget {budget:g}"
    return "on" if r.get("activation_checkpointing", True) else "off"


def ac_setting(text: str) -> str:
    """--recipe-ac (on, off or a budget, as bench.trainer.parse_ac reads --train-ac) as ac_label writes it."""
    try:
        (ac,) = parse_ac(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"expected on, off or a memory budget in (0, 1], got {text!r}"
        ) from e
    return ac_label(ac_fields(ac))


def recipe_ac(args) -> str:
    return getattr(args, "recipe_ac", "on")


def tps(rows: list[dict], model: str, config: str) -> dict[int, float]:
    """Tokens/s by batch, the median over the calls that measured it (each row is one call's median); a row
    timed in alternation with an engine outside CONFIGS is left to paired_table (the base engine ran once
    per pair: its rows from the pair with a listed engine count)."""
    by_batch: dict[int, list[float]] = {}
    for r in ok(rows):
        if r["model"] == model and r["config"] == config and r.get("paired_with", config) in CONFIGS:
            by_batch.setdefault(r["batch"], []).append(r["tokens_per_s"])
    return {b: statistics.median(v) for b, v in by_batch.items()}
