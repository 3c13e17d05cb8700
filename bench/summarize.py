"""Turn benchmark JSON (one or more $OUT folders of bench.run_all) into the markdown for docs/benchmarks.md.

    python -m bench.summarize OUT_DIR|NAME.tgz [...] [--ref-response-len 2048] > block.md

Rows of same-named files in several folders are merged (e.g. one folder per remote call). The goals of
issue 11 come first (bench/goals.py), each with its measured figure and PASS / FAIL:
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
import tarfile
import tempfile
from pathlib import Path

from bench.goals import goals, modelled_step, ratios, sync_total
from bench.report import CONFIGS, ac_label, ac_setting, fmt, ok, table, tps

BENCHES = ("rollout", "rollout_profile", "sync", "trainer", "kl", "grpo", "lora_experts")
ROW_KEYS = ("model", "config", "row", "rank", "targets")  # what names a row in "Skipped or failed"


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


def _one_line(text) -> str:
    """nvidia-smi prints one line per GPU."""
    lines = [x.strip() for x in str(text).splitlines() if x.strip()]
    return lines[0] if len(set(lines)) == 1 else "; ".join(lines)


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
