"""The goals of issue 11, each with its measured figure and verdict (bench.summarize's first table), and the
derived figures they rest on: the R3 cost pooled over calls, the modelled step of the sync share, the KL
pair. What each goal is and how its verdict is read: bench/summarize.py's docstring."""

from __future__ import annotations

import statistics

from bench.paired import host_ops_delta
from bench.pairstats import paired_mean_difference, pooled_cost
from bench.report import CONFIGS, GOALS, ac_label, fmt, ok, recipe_ac, table, tps, verdict


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
