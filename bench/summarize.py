"""Turn benchmark JSON (one or more $OUT folders of bench.run_all) into the markdown for docs/benchmarks.md.

    python -m bench.summarize OUT_DIR|NAME.tgz [...] [--ref-response-len 2048] > block.md

Rows of same-named files in several folders are merged (e.g. one folder per remote call). The goals of
issue 11 come first, each with its measured figure and PASS / FAIL:
  R3 cost      1 - tok/s(NVFP4+LoRA+R3) / tok/s(NVFP4+LoRA) <= 3 %, at every batch size measured (where the
               engines ran in alternation, `--rollout-pair`, the pairs of every call pooled with a 95 %
               interval, bench/pairstats.pooled_cost: PASS when the interval is at most 3 %, FAIL when it is
               above, UNRESOLVED when it holds 3 %; adjusted for the host probe where every call has one,
               the unadjusted figure beside it);
  sync share   adapter sync / step time <= 2 %: in the GRPO run (perf/sync_s / perf/step_s, medians) and,
               for the recipe's step, the isolated sync (rank 32, all experts) over a modelled step (below);
  trainer MFU  6 N T / s / measured bf16 matmul rate >= 30 %, at the recipe's activation checkpointing
               (`--recipe-ac`: on, off or a memory budget; on, as the recipes have it, by default);
  KL           k3 with R3 <= 1e-4 and below k3 without R3 (where the rows carry per-sample k3 sums: the
               paired difference's 95 % interval, bench/pairstats.paired_mean_difference, PASS below 0,
               FAIL above, UNRESOLVED across); GRPO per-step k3 <= 1e-4 (mean and max).
Modelled step: the recipe's 32 prompts x 8 samples, each `--ref-prompt-len` + `--ref-response-len`
tokens; rollout at the batch-256 decode rate of NVFP4+LoRA+R3 (optimistic: decode slows with context,
so the modelled step is short and the sync share an upper bound), trainer log-probs + step at the measured
trainer rates.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tarfile
import tempfile
from pathlib import Path

from bench.paired import host_ops_delta
from bench.pairstats import paired_mean_difference, pooled_cost
from bench.trainer import ac_fields, parse_ac

BENCHES = ("rollout", "rollout_profile", "sync", "trainer", "kl", "grpo", "lora_experts")
CONFIGS = ("bf16", "bf16_lora", "nvfp4_lora", "nvfp4_lora_r3")
ROW_KEYS = ("model", "config", "row", "rank", "targets")  # what names a row in "Skipped or failed"
GOALS = {"r3_cost": 0.03, "sync_share": 0.02, "mfu": 0.30, "k3": 1e-4}


def _unpacked(paths: list[Path], tmp: Path) -> list[Path]:
    """Folders as they are; `NAME.tgz` archives (bench/gpu_calls.sh packs each call's folder) unpacked
    under tmp, one folder per archive member that holds JSON."""
    out = []
    for i, p in enumerate(paths):
        if p.is_file() and p.name.endswith((".tgz", ".tar.gz")):
            dest = tmp / str(i)  # two calls' archives may have the same name (the same call run twice)
            with tarfile.open(p) as tar:
                tar.extractall(dest, filter="data")
            out += sorted({f.parent for f in dest.rglob("*.json")})
        else:
            out.append(p)
    return out


def load(dirs: list[Path]) -> tuple[list[dict], dict[str, list[dict]]]:
    """(env.json of each folder or archive, rows per benchmark)."""
    with tempfile.TemporaryDirectory(prefix="sparkrl_summary_") as tmp:
        return _load(_unpacked(dirs, Path(tmp)))


def _load(dirs: list[Path]) -> tuple[list[dict], dict[str, list[dict]]]:
    envs, rows = [], {b: [] for b in BENCHES}
    for i, d in enumerate(dirs):
        if (d / "env.json").exists():
            envs.append(json.loads((d / "env.json").read_text()))
        for b in BENCHES:
            if (d / f"{b}.json").exists():
                # `source`: the call a row came from (rows of two calls of the same pair are two pairs)
                rows[b] += [
                    {"source": f"{i}:{d.name}", **r}
                    for r in json.loads((d / f"{b}.json").read_text())["rows"]
                ]
    return envs, rows


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


# ----------------------------------------------------------------------------------------------------
# Derived figures.


def _one_line(text) -> str:
    """nvidia-smi prints one line per GPU."""
    lines = [x.strip() for x in str(text).splitlines() if x.strip()]
    return lines[0] if len(set(lines)) == 1 else "; ".join(lines)


def tps(rows: list[dict], model: str, config: str) -> dict[int, float]:
    """Tokens/s by batch, the median over the calls that measured it (each row is one call's median); a row
    timed in alternation with an engine outside CONFIGS is left to paired_table (the base engine ran once
    per pair: its rows from the pair with a listed engine count)."""
    by_batch: dict[int, list[float]] = {}
    for r in ok(rows):
        if r["model"] == model and r["config"] == config and r.get("paired_with", config) in CONFIGS:
            by_batch.setdefault(r["batch"], []).append(r["tokens_per_s"])
    return {b: statistics.median(v) for b, v in by_batch.items()}


def ratios(rows: list[dict], model: str) -> dict[str, dict]:
    t = {c: tps(rows, model, c) for c in CONFIGS}

    def rel(a, b, f):
        return {k: f(t[a][k], t[b][k]) for k in t[a] if k in t[b]}

    # Where the two engines ran in alternation (bench/paired.py), the paired figure from the same prompts:
    # the pairs of all calls pooled, or a row's own figure where it has no per-pair list (older rows).
    paired = {
        r["batch"]: r["paired_cost"]
        for r in ok(rows)
        if r["model"] == model
        and r["config"] == "nvfp4_lora_r3"
        and r.get("paired_with") == "nvfp4_lora"
        and "paired_cost" in r
    }
    pooled = r3_pooled(rows, model)
    paired.update({b: p["cost"] for b, p in pooled.items()})
    return {
        "r3_pooled": pooled,  # the pooled figures with their intervals, for the goal's verdict
        "lora_overhead": rel("bf16_lora", "bf16", lambda x, y: 1 - x / y),
        "nvfp4_gain": rel("nvfp4_lora", "bf16_lora", lambda x, y: x / y),
        "r3_cost": {**rel("nvfp4_lora_r3", "nvfp4_lora", lambda x, y: 1 - x / y), **paired},
    }


def r3_pooled(rows: list[dict], model: str) -> dict[int, dict]:
    """{batch: bench.pairstats.pooled_cost of R3 against NVFP4+LoRA} over every call that paired the two.
    Calls that ran the engines at the same time on two GPUs (`--pair-concurrent`) are pooled apart from
    those in alternation and, where there are any, give the verdict's figure (decided before their first
    GPU call: the drift that left the alternating pairs' interval wide is shared within a concurrent pair),
    the alternating pool beside it as `alternating`. Alternating alone: adjusted by the host probe where
    every such call has one, the raw figure beside it as `raw`; the raw figure alone before the probe."""
    mine = [r for r in ok(rows) if r["model"] == model]
    batches = sorted({r["batch"] for r in mine if r.get("paired_costs_all")})
    pooled = {}
    for b in batches:
        raw = pooled_cost(mine, "nvfp4_lora", "nvfp4_lora_r3", b)
        adjusted = pooled_cost(mine, "nvfp4_lora", "nvfp4_lora_r3", b, adjust=True)
        alternating = {**adjusted, "raw": raw} if adjusted is not None and raw is not None else raw
        concurrent = pooled_cost(mine, "nvfp4_lora", "nvfp4_lora_r3", b, mode="concurrent")
        if concurrent is not None:
            pooled[b] = {**concurrent, "mode": "concurrent", "alternating": alternating}
        elif alternating is not None:
            pooled[b] = alternating
    return pooled


def interval_verdict(p: dict, goal: float) -> str:
    """PASS / FAIL / UNRESOLVED of a pooled cost against an upper goal (no interval: the figure alone)."""
    if p["lo"] is None:
        return verdict(p["cost"] <= goal)
    return "PASS" if p["hi"] <= goal else "FAIL" if p["lo"] > goal else "UNRESOLVED"


def pooled_text(p: dict) -> str:
    def interval(q: dict) -> str:
        return f"95 % interval {q['lo']:.1%} to {q['hi']:.1%}; " if q["lo"] is not None else ""

    first = "on the first GPU" if p.get("mode") == "concurrent" else "started first"
    text = f"{interval(p)}{p['pairs']} pairs in {p['calls']} calls, R3 {first} in {p['pairs_other_started_first']}"
    if p.get("mode") == "concurrent":
        text = "both engines at once, one GPU each: " + text
        if p.get("alternating"):
            alt = p["alternating"]
            text += f"; in alternation on one GPU {alt['cost']:.1%}, " + interval(alt).removesuffix("; ")
    if "raw" in p:
        raw = p["raw"]
        text += (
            f"; adjusted for the host probe, slope {p['host_slope']:.2f}; unadjusted {raw['cost']:.1%}, "
            + interval(raw).removesuffix("; ")
        )
    return text


def modelled_step(rows: dict, model: str, args) -> float | None:
    roll = tps(rows["rollout"], model, "nvfp4_lora_r3")
    tr = [r for r in ok(rows["trainer"]) if r["model"] == model]
    if not roll or not tr:
        return None
    seqs = args.ref_prompts * args.ref_n
    rollout_s = seqs * args.ref_response_len / roll[max(roll)]
    tokens = seqs * (args.ref_prompt_len + args.ref_response_len)
    recipe = [r for r in tr if ac_label(r) == recipe_ac(args)] or tr  # the recipe's setting
    best = max(recipe, key=lambda r: r["train_tokens_per_s"])
    return rollout_s + tokens / best["log_probs_tokens_per_s"] + tokens / best["train_tokens_per_s"]


def sync_total(r: dict) -> float:
    """Step 6 as a whole (export, transfer, load); older rows only have the pool's load time."""
    return r.get("sync_total_s") or r["sync_s"]


def grpo_share(rows: list[dict], model: str) -> tuple[float, float, float] | None:
    g = [r for r in ok(rows) if r["model"] == model and r.get("step_s")]
    if not g:
        return None
    sync, step = statistics.median(sync_total(r) for r in g), statistics.median(r["step_s"] for r in g)
    return sync, step, sync / step


# ----------------------------------------------------------------------------------------------------
# Sections.


def environment(envs: list[dict]) -> list[str]:
    if not envs:
        return ["(no env.json)"]
    e = envs[0]
    v = e.get("versions", {})
    dev = e.get("device", {})
    # measured by the calls that ran the trainer (any of them, not necessarily the first folder read)
    rates = ", ".join(
        sorted({f"{x['matmul']['tflops']:.0f}" for x in envs if (x.get("matmul") or {}).get("tflops")})
    )
    lines = [
        f"- Date: {', '.join(sorted({x['date_utc'] for x in envs}))}",
        f"- GPU: {_one_line(e.get('gpu') or dev.get('device'))} (torch CUDA {dev.get('torch_cuda')}); "
        f"bf16 matmul {rates or '—'} TFLOP/s measured",
        "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
        f"- Commit: {e.get('git_commit') or '—'}",
    ]
    lines += ["- Commands:"] + [f"  - `{x['command']}`" for x in envs]
    return lines


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def models_section(envs: list[dict]) -> list[str]:
    seen, body = set(), []
    for e in envs:
        for name, m in (e.get("models") or {}).items():
            if name in seen:
                continue
            seen.add(name)
            s, sft, p = m["spec"], m["sft"], m["params"]
            shape = (
                f"{s['layers']} layers, hidden {s['hidden']}, "
                f"{s['heads']}/{s['kv_heads']} heads x {s['head_dim']}, "
                f"{s['experts']} experts top-{s['top_k']} x {s['moe_intermediate']}"
                + (f", latent {s['latent']}" if s.get("latent") else "")
            )
            body.append(
                [
                    name,
                    shape,
                    _count(p["total"]),
                    _count(p["active"]),
                    f"{sft['steps']} steps, loss {sft['final_loss']:.3f}",
                    fmt(sft["heldout_acc"], ".2f"),
                    fmt(sft["response_entropy"], ".3f"),
                    f"{m['bytes']['bf16'] / 1e9:.2f} / {m['bytes']['nvfp4'] / 1e9:.2f}",
                ]
            )
    return table(
        [
            "model",
            "shape",
            "params",
            "active",
            "SFT",
            "held-out acc",
            "entropy (nats/tok)",
            "GB bf16 / nvfp4",
        ],
        body,
    )


def r3_profile_delta(rows: list[dict], model: str) -> str:
    """R3 against no R3 in one profiled batch each (--rollout-profile): the device's extra time per decode
    step and the host ops' extra seconds, which the host's noise in wall-clock pairs does not blur."""
    by = {(r["config"], r["batch"]): r for r in ok(rows) if r["model"] == model and r.get("device_s")}
    for (config, batch), r3 in sorted(by.items(), key=lambda kv: -kv[0][1]):
        base = by.get(("nvfp4_lora", batch))
        if config != "nvfp4_lora_r3" or base is None:
            continue
        device = r3["device_ms_per_step"] / base["device_ms_per_step"] - 1
        host = (r3.get("host_ops_s") or 0) - (base.get("host_ops_s") or 0)
        text = (
            f"; profiled batch {batch}: device {r3['device_ms_per_step'] - base['device_ms_per_step']:+.2f} "
            f"ms/step ({device:+.1%}), host ops {host:+.3f} s of {base['seconds']:.2f} s"
        )
        if r3.get("host_ops") and base.get("host_ops"):
            added, slower = host_ops_delta(base["host_ops"], r3["host_ops"])
            text += f" (R3's added calls {added:.3f} s = {added / base['seconds']:.1%} of the batch"
            text += f"; the same calls {slower:.2f}x the time in the R3 engine's process)" if slower else ")"
        return text
    return ""


def control_pair(rows: list[dict], model: str) -> str:
    """The A/A pair (nvfp4_lora against its twin, the same engine in another process): the cost the pairs
    read where there is none, the yardstick for the R3 pair's."""
    control = [
        r for r in ok(rows) if r["model"] == model and r["config"] == "nvfp4_lora_twin" and "paired_cost" in r
    ]
    return "".join(
        f"; A/A control at batch {r['batch']}: {r['paired_cost']:.1%}"
        + (
            f" (pairs {min(r['paired_costs_all']):.0%} to {max(r['paired_costs_all']):.0%})"
            if r.get("paired_costs_all")
            else ""
        )
        for r in sorted(control, key=lambda r: -r["batch"])
    )


def goals(rows: dict, rats: dict[str, dict], args) -> list[str]:
    body = []
    for m, rat in rats.items():
        r3 = rat["r3_cost"]
        graphs = {
            c: {r["graphs"] for r in ok(rows["rollout"]) if r["model"] == m and r["config"] == c}
            for c in ("nvfp4_lora", "nvfp4_lora_r3")
        }
        if r3:
            worst = max(r3.values())
            same = graphs["nvfp4_lora"] == graphs["nvfp4_lora_r3"]
            pooled = rat["r3_pooled"]
            verdicts = {b: interval_verdict(pooled[b], GOALS["r3_cost"]) for b in pooled}
            verdicts.update({b: verdict(c <= GOALS["r3_cost"]) for b, c in r3.items() if b not in pooled})
            overall = next((v for v in ("FAIL", "UNRESOLVED") if v in verdicts.values()), "PASS")
            big = max(r3)
            body.append(
                [
                    m,
                    "R3 cost of rollout tok/s <= 3 % (every batch)",
                    f"worst {worst:.1%} (batch {max(r3, key=r3.get)}), {r3[big]:.1%} at batch {big}"
                    + (f" ({pooled_text(pooled[big])})" if big in pooled else "")
                    + ("" if same else f"; NOT COMPARABLE: CUDA graphs {graphs}")
                    + r3_profile_delta(rows["rollout_profile"], m)
                    + control_pair(rows["rollout"], m),
                    overall if same else "—",
                ]
            )
        g = grpo_share(rows["grpo"], m)
        if g:
            body.append(
                [
                    m,
                    "adapter sync <= 2 % of step (GRPO run)",
                    f"{g[2]:.1%} ({g[0]:.2f} s of {g[1]:.2f} s)",
                    verdict(g[2] <= GOALS["sync_share"]),
                ]
            )
        step = modelled_step(rows, m, args)
        sync = [
            r
            for r in ok(rows["sync"])
            if r["model"] == m and r["rank"] == 32 and r["targets"] == "all" and r.get("total_s")
        ]
        if step and sync:
            best = min(sync, key=lambda r: r["total_s"])  # over the adapter layouts measured
            share = best["total_s"] / step
            body.append(
                [
                    m,
                    "adapter sync <= 2 % of step (recipe step, modelled)",
                    f"{share:.1%} ({best['total_s']:.2f} s of {step:.0f} s, {best.get('engine')})",
                    verdict(share <= GOALS["sync_share"]),
                ]
            )
        trained = [r for r in ok(rows["trainer"]) if r["model"] == m]
        # The recipe's setting (activation checkpointing on, unless --recipe-ac says otherwise) is held to
        # the goal, at the best micro-batch size of the sweep (what a recipe would pick); the best row of
        # each other setting is quoted beside it.
        ac = recipe_ac(args)
        recipe = [r for r in trained if ac_label(r) == ac]
        if recipe:
            r = max(recipe, key=lambda r: r["mfu_6n"])
            others: dict[str, float] = {}
            for x in trained:
                if ac_label(x) != ac:
                    others[ac_label(x)] = max(others.get(ac_label(x), 0.0), x["mfu_6n"])
            extra = "".join(f"; AC {label}: {mfu:.1%}" for label, mfu in sorted(others.items()))
            body.append(
                [
                    m,
                    f"trainer MFU (6N) >= 30 % (AC {ac})",
                    f"{r['mfu_6n']:.1%} (4N: {r['mfu_4n']:.1%}; micro-batch {r.get('micro_batch_tokens')} tokens"
                    f"{extra})",
                    verdict(r["mfu_6n"] >= GOALS["mfu"]),
                ]
            )
        kl = kl_goal(rows["kl"], m)
        if kl:
            body.append([m, "k3 KL with R3 <= 1e-4 and < R3 off", *kl])
        g = [r["k3_kl"] for r in ok(rows["grpo"]) if r["model"] == m]
        if g:
            body.append(
                [
                    m,
                    f"GRPO per-step k3 <= 1e-4 ({len(g)} steps)",
                    f"mean {statistics.mean(g):.2e}, max {max(g):.2e}",
                    verdict(max(g) <= GOALS["k3"]),
                ]
            )
    return table(["model", "goal", "measured", "verdict"], body)


def rollout_section(rows: list[dict], rats: dict[str, dict]) -> list[str]:
    out = []
    for m, rat in rats.items():
        t = {c: tps(rows, m, c) for c in CONFIGS}
        batches = sorted({b for v in t.values() for b in v})
        if not batches:
            continue
        body = [
            [b]
            + [fmt(t[c].get(b), ".0f") for c in CONFIGS]
            + [
                fmt(rat["lora_overhead"].get(b), ".1%"),
                fmt(rat["nvfp4_gain"].get(b), ".2f"),
                fmt(rat["r3_cost"].get(b), ".1%"),
            ]
            for b in batches
        ]
        mine = [r for r in ok(rows) if r["model"] == m and "output_len" in r]
        shapes = " or ".join(  # calls of different lengths pooled (their ratios, not their tok/s, compare)
            f"{p} + {n}" for p, n in sorted({(r["prompt_len"], r["output_len"]) for r in mine})
        )
        graphs = sorted(
            {
                f"{r['config']}: {r['graphs']}"
                + (f" ({r['cudagraph_mode']})" if r.get("cudagraph_mode") else "")
                for r in ok(rows)
                if r["model"] == m
            }
        )
        out += [
            f"**{m}**: output tokens/s, prompt + generated tokens a request {shapes}; CUDA graphs "
            f"{', '.join(graphs)}",
            "",
        ]
        out += table(["batch", *CONFIGS, "LoRA overhead", "NVFP4 gain (x)", "R3 cost"], body) + [""]
        out += paired_table(rows, m)
    return out


def profile_table(rows: list[dict]) -> list[str]:
    """One batch per engine under vLLM's profiler (bench/paired.py --rollout-profile): a cost that shows in
    device seconds is the device's; one that shows only in wall seconds is the host's."""
    body = [
        [
            r["model"],
            r["config"],
            r["batch"],
            r["output_len"],
            fmt(r["seconds"], ".3f"),
            fmt(r.get("device_s"), ".3f"),
            fmt(r.get("device_ms_per_step"), ".2f"),
            fmt(r.get("device_busy"), ".0%"),
            fmt(r.get("host_ops_s"), ".3f"),
        ]
        for r in ok(rows)
    ]
    if not body:
        return []
    head = [
        "model",
        "engine",
        "batch",
        "tokens",
        "wall s",
        "device s",
        "device ms/step",
        "busy",
        "host ops s",
    ]
    return ["One batch under vLLM's profiler (engine process):", "", *table(head, body), ""]


def paired_table(rows: list[dict], model: str) -> list[str]:
    """Every pair of engines run in pairs (bench/paired.py), whatever the configurations."""
    paired = [r for r in ok(rows) if r["model"] == model and "paired_cost" in r and "paired_with" in r]
    if not paired:
        return []
    base = {
        (r.get("source"), r["config"], r["paired_with"], r["batch"]): r
        for r in ok(rows)
        if r["model"] == model and "paired_with" in r
    }
    body = []
    for r in sorted(paired, key=lambda r: (r["config"], r["batch"], r.get("source") or "")):
        b = base.get((r.get("source"), r["paired_with"], r["config"], r["batch"]), {})
        body.append(
            [
                r["paired_with"],
                r["config"],
                r["batch"],
                fmt(b.get("tokens_per_s"), ".0f"),
                fmt(r["tokens_per_s"], ".0f"),
                fmt(r["paired_cost"], ".1%"),
                ", ".join(f"{x:.1%}" for x in r.get("paired_costs_all", [])),
                _cpu_pair(b, r, "cpu_s", ".2f"),
                _cpu_pair(b, r, "cpu_per_wall", ".2f"),
                _cpu_pair(b, r, "steal_s", ".2f"),
                _cpu_pair(b, r, "probe_ms", ".2f"),
                r.get("cpus", "—") + (" (pinned)" if r.get("pinned") else ""),
                (f"at once, GPUs {b.get('gpu')} / {r.get('gpu')}" if r.get("gpu") else "at once")
                if r.get("paired_mode") == "concurrent"
                else "in turn",
            ]
        )
    head = [
        "base",
        "other",
        "batch",
        "base tok/s",
        "other tok/s",
        "cost",
        "per pair",
        "CPU s",
        "CPU/wall",
        "stolen s",
        "probe ms",
        "cores",
        "runs",
    ]
    return [
        "Run in pairs (same prompts and seeds; runs: in turn on one GPU, order alternating, or at once on two",
        "GPUs, base's / other's; cost from the per-pair ratios; CPU s:",
        "the engine process tree's median CPU seconds a run, base / other; CPU/wall: per wall second;",
        "stolen s: the machine's CPU seconds taken by the hypervisor during a run, median; probe ms: the host",
        "probe around each run, bench/pairstats.py, median):",
        "",
        *table(head, body),
        "",
    ]


def _cpu_pair(base: dict, other: dict, key: str, spec: str) -> str:
    if key not in other:  # rows from before the CPU accounting (eighth session) or the probe (ninth)
        return "—"
    return f"{fmt(base.get(key), spec)} / {fmt(other[key], spec)}"


def sync_section(rows: list[dict], shares: dict[str, float | None]) -> list[str]:
    body = []
    for r in ok(rows):
        step = shares.get(r["model"])
        body.append(
            [
                r["model"],
                r.get("engine") or "—",
                r["rank"],
                r["targets"],
                fmt(r.get("bytes", r["raw_bytes"]) / 1e6, ".1f"),
                fmt(r["export_s"], ".3f"),
                fmt(r.get("load_s"), ".3f"),
                fmt(r.get("load_stage_s"), ".3f"),
                fmt(r.get("load_engine_s"), ".3f"),
                fmt(r.get("first_token_s"), ".3f"),
                fmt(r.get("baseline_first_token_s"), ".3f"),
                fmt(r.get("total_s"), ".3f"),
                fmt(r.get("gb_per_s"), ".2f"),
                fmt(r["total_s"] / step if step and r.get("total_s") else None, ".1%"),
            ]
        )
    return table(
        [
            "model",
            "engine",
            "rank",
            "targets",
            "MB",
            "export s",
            "load s",
            "of which ours",
            "of which vLLM",
            "first token s",
            "(no-sync token s)",
            "total s",
            "GB/s",
            "of modelled step",
        ],
        body,
    )


def trainer_section(rows: list[dict]) -> list[str]:
    body = [
        [
            r["model"],
            f"{r['samples']} x {r['seq_len']}",
            fmt(r.get("micro_batch_tokens"), "d"),
            ac_label(r),
            "on" if r.get("compile") else "off",
            fmt(r["train_tokens_per_s"], ".0f"),
            fmt(r["mfu_6n"], ".1%"),
            fmt(r["mfu_4n"], ".1%"),
            fmt(r["log_probs_tokens_per_s"], ".0f"),
            fmt(r["log_probs_mfu_2n"], ".1%"),
            fmt(r.get("peak_allocated_gib"), ".1f"),
            fmt(r["matmul_tflops"], ".0f"),
        ]
        for r in ok(rows)
    ]
    return table(
        [
            "model",
            "batch",
            "micro-batch tokens",
            "AC",
            "compile",
            "train tok/s",
            "MFU 6N",
            "MFU 4N",
            "log-probs tok/s",
            "log-probs MFU",
            "peak GiB",
            "matmul TFLOP/s",
        ],
        body,
    )


def kl_goal(rows: list[dict], model: str) -> tuple[str, str] | None:
    """(measured, verdict) of the KL goal: R3-on k3 at most 1e-4, and below R3 off. Where both rows carry
    per-sample k3 sums of the same samples (bench/kl.py), "below" is read from the paired difference's 95 %
    interval: PASS below 0, FAIL above, UNRESOLVED across it (both rows at the kernels' floor read so);
    older rows compare the two figures alone."""
    k = {r["row"]: r for r in ok(rows) if r["model"] == model}
    if "nvfp4_r3_on" not in k:
        return None
    on, off = k["nvfp4_r3_on"], k.get("nvfp4_r3_off")
    text = f"{on['k3_kl']:.2e} (off {fmt(off and off['k3_kl'], '.2e')}"
    if on["k3_kl"] > GOALS["k3"]:
        return text + ")", "FAIL"
    if off is None:
        return text + ")", verdict(True)
    paired = None
    if on.get("k3_seq_sums") and on.get("seq_tokens") == off.get("seq_tokens") and off.get("k3_seq_sums"):
        paired = paired_mean_difference(on["k3_seq_sums"], off["k3_seq_sums"], on["seq_tokens"])
    if paired is None:
        return text + ")", verdict(on["k3_kl"] < off["k3_kl"])
    text += (
        f"; on - off {paired['diff']:+.2e}, 95 % interval {paired['lo']:+.2e} to {paired['hi']:+.2e}, "
        f"paired over {paired['units']} samples)"
    )
    return text, "PASS" if paired["hi"] < 0 else "FAIL" if paired["lo"] > 0 else "UNRESOLVED"


def kl_section(rows: list[dict]) -> list[str]:
    body = [
        [
            r["model"],
            r["row"],
            fmt(r["k3_kl"], ".2e"),
            fmt(r["abs_logp_diff_p50"], ".2e"),
            fmt(r["abs_logp_diff_p99"], ".2e"),
            r["response_tokens"],
            fmt(r.get("trainer_entropy"), ".3f"),
            fmt(r.get("r3_replayed_fraction"), ".2f"),
            fmt(r.get("adapter_mean_abs_logp_change"), ".2e"),
            r.get("note") or "",
        ]
        for r in ok(rows)
    ]
    return table(
        [
            "model",
            "row",
            "k3 KL",
            "abs dlogp p50",
            "abs dlogp p99",
            "tokens",
            "entropy",
            "replayed",
            "adapter effect",
            "note",
        ],
        body,
    )


def grpo_section(rows: list[dict]) -> list[str]:
    body = [
        [
            r["model"],
            r["step"],
            fmt(r["k3_kl"], ".2e"),
            fmt(r["reward_mean"], ".3f"),
            fmt(r["entropy"], ".3f"),
            fmt(r["step_s"], ".2f"),
            fmt(r["rollout_s"], ".2f"),
            fmt(r["train_s"], ".2f"),
            fmt(sync_total(r), ".3f"),
            fmt(sync_total(r) / r["step_s"] if r.get("step_s") else None, ".1%"),
        ]
        for r in ok(rows)
    ]
    return table(
        [
            "model",
            "step",
            "k3 KL",
            "reward",
            "entropy",
            "step s",
            "rollout s",
            "train s",
            "sync s",
            "sync share",
        ],
        body,
    )


def lora_experts_section(rows: list[dict]) -> list[str]:
    """bench.lora_experts: one micro-batch through the trainer's modules alone (no GRPO loss, no Ray)."""
    body = [
        [
            r["model"],
            r["path"],
            ac_label(r),
            r.get("compile", "none"),
            fmt(r["micro_batch_tokens"], "d"),
            fmt(r["tokens_per_s"], ".0f"),
            fmt(r["mfu_6n"], ".1%"),
            fmt(r["mfu_4n"], ".1%"),
            fmt(r.get("peak_allocated_gib"), ".1f"),
            fmt(r.get("first_step_s"), ".0f"),
        ]
        for r in ok(rows)
    ]
    header = ["model", "expert LoRA", "AC", "compile", "tokens", "tok/s", "MFU 6N", "MFU 4N", "peak GiB"]
    return table(header + ["warm-up s"], body)


def not_run(rows: dict) -> list[str]:
    out = []
    for b, rs in rows.items():
        for r in rs:
            if r.get("status") != "ok":
                if r.get("status") == "skipped" and _measured_elsewhere(r, rs):
                    continue  # a later call (another folder) measured it
                what = ", ".join(f"{k}={r[k]}" for k in ROW_KEYS if k in r)
                out.append(f"- {b} ({what}): {r['status']}: {r.get('reason', '')[:300]}")
    return out or ["- none"]


def _measured_elsewhere(skipped: dict, rows: list[dict]) -> bool:
    keys = [k for k in ROW_KEYS if k in skipped]
    return any(r.get("status") == "ok" and all(r.get(k) == skipped[k] for k in keys) for r in rows)


def render(dirs: list[Path], args) -> str:
    envs, rows = load(dirs)
    models = sorted({r["model"] for rs in rows.values() for r in rs if "model" in r})
    shares = {m: modelled_step(rows, m, args) for m in models}
    # once per model: the pooled R3 figures bootstrap (the goals and the throughput table both read them)
    rats = {m: ratios(rows["rollout"], m) for m in models}
    parts = [
        "### Environment",
        *environment(envs),
        "",
        "### Models",
        *models_section(envs),
        "",
        "### Goals",
        *goals(rows, rats, args),
        "",
        "### Rollout throughput",
        *rollout_section(rows["rollout"], rats),
        *profile_table(rows["rollout_profile"]),
        "### Adapter sync",
        *sync_section(rows["sync"], shares),
        "",
        "### Trainer",
        *trainer_section(rows["trainer"]),
        "",
        *(
            [
                "### Trainer compute alone (bench.lora_experts)",
                *lora_experts_section(rows["lora_experts"]),
                "",
            ]
            if rows["lora_experts"]
            else []
        ),
        "### Rollout-trainer KL (k3)",
        *kl_section(rows["kl"]),
        "",
        "### GRPO run, per step",
        *grpo_section(rows["grpo"]),
        "",
        "### Skipped or failed",
        *not_run(rows),
        "",
    ]
    return "\n".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", type=Path)
    p.add_argument("--ref-prompts", type=int, default=32)
    p.add_argument("--ref-n", type=int, default=8)
    p.add_argument("--ref-prompt-len", type=int, default=256)
    p.add_argument("--ref-response-len", type=int, default=2048)
    p.add_argument(
        "--recipe-ac",
        type=ac_setting,
        default="on",
        help="the recipe's activation checkpointing, held to the MFU goal: on, off, or a memory budget "
        "(trainer.activation_memory_budget, e.g. 0.5)",
    )
    args = p.parse_args(argv)
    print(render(args.dirs, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
