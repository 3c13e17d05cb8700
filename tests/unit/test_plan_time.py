"""The planner's step-time estimate (rl/plan_time.py): its shape (more tokens, more time; EP gathers fewer
bytes; the link across nodes is InfiniBand), the rates file (every measured figure dated, with its command),
and the estimate against measured CPU steps (rl/rates.yaml `runs`, within 30 %)."""

from __future__ import annotations

import copy

import pytest

from rl import plan_time
from rl.config import load_config
from rl.plan import make_plan

MUSE = "recipes/muse_spark_open_dapo_lora.yaml"


def _est(recipe: str, *overrides: str, **kw):
    cfg = load_config(recipe, list(overrides))
    return plan_time.estimate_step(cfg, make_plan(cfg, advise=False), **kw)


def test_rates_file_schema():
    rates = plan_time.load_rates()
    for kind in plan_time.DEVICE_KINDS:
        table = rates["devices"][kind]["rates"]
        for name, f in [(n, g) for n, e in table.items() for g in (e, *e.get("by_size", []))]:
            assert f["kind"] in ("measured", "assumed"), (kind, name)
            assert isinstance(f["value"], (int, float)) and f["value"] >= 0, (kind, name)
            if f["kind"] == "measured":
                assert str(f["date"])[:2] == "20" and f["command"], (kind, name)
            else:
                assert f["source"], (kind, name)
        for name, f in table.items():
            for g in f.get("by_size", []):  # taken by hidden size; the size noted
                assert g["hidden_size"] > 0 and g["active_params"] > 0 and f.get("hidden_size"), (kind, name)
    for run in rates["runs"]:
        assert run["date"] and run["command"] and run["step_s"] > 0


@pytest.mark.parametrize("kind", plan_time.DEVICE_KINDS)
def test_every_kind_has_every_rate(kind):
    cfg = load_config(MUSE, [f"resources.device={kind}"])
    est = plan_time.estimate_step(cfg, make_plan(cfg, advise=False))
    assert est.step_s > 0 and est.kind == kind


def test_monotonic_in_tokens():
    short = _est(MUSE, response_len=1024)
    long = _est(MUSE, response_len=4096)
    assert long.step_s > short.step_s
    for phase in ("rollout decode", "train passes", "all-gather"):
        assert long.phases[phase] > short.phases[phase]
    bigger = _est(MUSE, "data.train_batch_size=64", response_len=1024)
    assert bigger.step_s > short.step_s


def test_expert_parallelism_gathers_fewer_bytes():
    ep1 = _est(MUSE, "trainer.expert_parallel_size=1")
    ep8 = _est(MUSE, "trainer.expert_parallel_size=8")
    assert ep8.bytes["all-gather (experts)"] < ep1.bytes["all-gather (experts)"] / 8
    assert ep8.bytes["dequantized"] < ep1.bytes["dequantized"]
    assert "all-to-all" not in ep1.phases and ep8.phases["all-to-all"] > 0
    assert ep8.links["all-to-all"] == "intra-node"  # an EP group of 8 lies in one node of 8


# The Muse recipe's trainer on the 8 GPUs of one node
ONE_NODE = ("trainer.num_ranks=8", "resources.num_gpus=8", "resources.nodes=1", "rollout.num_workers=1")


def test_link_across_nodes_is_infiniband():
    two_nodes = _est(MUSE, "trainer.expert_parallel_size=1")  # 16 ranks on 2 nodes of 8
    assert two_nodes.links["all-gather (experts)"] == "inter-node"
    one_node = _est(MUSE, "trainer.expert_parallel_size=1", *ONE_NODE)
    assert one_node.links["all-gather (experts)"] == "intra-node"
    # the link's bandwidth sets the gather's time: a slower InfiniBand, a slower gather
    slow = _est(MUSE, "trainer.expert_parallel_size=1", "resources.inter_node_gbps=25")
    assert slow.phases["all-gather"] == pytest.approx(2 * two_nodes.phases["all-gather"], rel=0.02)
    fast_nvlink = _est(MUSE, "trainer.expert_parallel_size=1", *ONE_NODE, "resources.intra_node_gbps=900")
    assert fast_nvlink.phases["all-gather"] < one_node.phases["all-gather"]


def test_measured_and_assumed_labels():
    est = _est(MUSE)
    assert est.rates["decode_step_s"].measured and not est.rates["inter_node_gbps"].measured
    assert not est.rates["train_tflops"].measured  # the H100's full-width figure, assumed for the H200
    text = "\n".join(plan_time.format_time(est))
    assert "measured: " in text and "assumed: " in text and "bottleneck:" in text


def test_muse_ep_comparison():
    cfg = load_config(MUSE, ["trainer.expert_parallel_size=1"])
    rows = {
        ep: (verdict, est)
        for ep, verdict, est, _ in plan_time.compare_ep(cfg, lambda c: make_plan(c, advise=False), (1, 8, 16))
    }
    assert rows[16][0].startswith("refused") and "expert_parallel_size" in rows[16][0]
    assert rows[8][0] == "fits" and rows[8][1].step_s < rows[1][1].step_s
    # the recipe takes the faster layout that fits
    assert load_config(MUSE, []).trainer.expert_parallel_size == 8


def test_a_decode_step_reads_the_experts_its_wave_routes_to():
    """A decode step reads the engine's weights, of the routed experts the share a wave's tokens route to,
    and adds that read to the FLOPs (the sum fitted one H100's full-width decode at three batch sizes)."""
    cfg = load_config(MUSE)
    p = make_plan(cfg, advise=False)
    s = p.shape
    everything = p.r_weights + p.r_lora
    experts = s.params["experts"] * (0.5 + 1 / 16) / p.tp  # NVFP4 experts on each of the engine's TP GPUs
    one = p.decode_read_bytes(1)
    assert one == pytest.approx(everything - experts * (1 - s.top_k / s.num_experts))
    assert p.decode_read_bytes(16) < p.decode_read_bytes(128) < everything
    assert p.decode_read_bytes(4096) == pytest.approx(everything)
    # the read adds to the step: a memory twice as fast takes half the read off every decode step
    est = plan_time.estimate_step(cfg, p)
    rates = copy.deepcopy(plan_time.load_rates())
    rates["devices"][est.kind]["rates"]["hbm_gbps"]["value"] *= 2
    faster = plan_time.estimate_step(cfg, p, rates=rates)
    wave = 128  # 2 engines of the 256 sequences, one wave each (the KV cache holds 198)
    read_s = p.decode_read_bytes(wave) / (est.rates["hbm_gbps"].value * 1e9)
    steps = cfg.rollout.max_response_len
    assert est.phases["rollout decode"] - faster.phases["rollout decode"] == pytest.approx(steps * read_s / 2)


def test_bench_rates_decode_line_is_what_the_plan_adds_to_the_read():
    """bench.rates fits its decode line to each measured step less the weights' read (the plan adds the
    read on its own), so a step made of a host time, the read and a cost a sequence gives those back. The
    engine is a fake that returns such steps: the GPU timing it stands for does not run here."""
    from argparse import Namespace

    from bench import rates as bench_rates

    cfg = load_config("recipes/demo_cpu.yaml")
    p = make_plan(cfg, advise=False)
    gbps, host, per_seq = 10.0, 0.004, 2e-5

    def step(batch: int) -> float:
        return host + p.decode_read_bytes(batch) / (gbps * 1e9) + per_seq * batch

    class Engine:
        @staticmethod
        def timed(s, batch, prompt_len, tokens, seed):
            return step(batch) * tokens, batch * tokens  # seconds, tokens generated: `tokens` steps

    a, b, steps = bench_rates._decode_line(Namespace(cfg=cfg), Engine, gbps)
    assert a == pytest.approx(host) and b == pytest.approx(per_seq)
    assert steps[64] == pytest.approx(step(64)) and steps[512] == pytest.approx(step(512))


def test_logprob_pass_only_when_it_runs():
    assert "log-prob pass" not in _est("recipes/demo_cpu.yaml").phases  # one on-policy step: fused
    assert "log-prob pass" in _est("recipes/demo_cpu.yaml", "algorithm.rollout_correction.tis_cap=2").phases


def _runs():
    return plan_time.load_rates()["runs"]


# How far the plan may be from a measured step: 30 % on the shared CPU cores, 25 % on a GPU
TOLERANCE = {"cpu-2core-dev": 1.3, "h100-80gb": 1.25, "h200": 1.25}


@pytest.mark.parametrize("run", _runs(), ids=lambda r: r["name"])
def test_plan_within_tolerance_of_measured_steps(run):
    est = _est(
        run["recipe"], *run["overrides"], prompt_len=run["prompt_len"], response_len=run["response_len"]
    )
    assert est.kind == run.get("device", "cpu-2core-dev")
    ratio, tol = est.step_s / run["step_s"], TOLERANCE[est.kind]
    assert 1 / tol <= ratio <= tol, (run["name"], est.step_s, run["step_s"], est.phases)


def test_per_call_costs_count_where_measured():
    """A device kind with per-call figures adds them (eager decode a layer, a micro-batch's layer pass, the
    colocated sleep and wake); one without them is timed by its FLOP and byte rates alone."""
    import copy

    cfg = load_config("recipes/gpu_demo.yaml", [])
    plan = make_plan(cfg, advise=False)
    rates = copy.deepcopy(plan_time.load_rates())
    table = rates["devices"]["h100-80gb"]["rates"]
    for name in (
        "decode_layer_step_eager_s",
        "decode_seq_eager_s",
        "colocate_switch_s",
        "train_layer_pass_eager_s",
    ):
        table.pop(name, None)
    bare = plan_time.estimate_step(cfg, plan, rates=rates)
    assert "sleep and wake" not in bare.phases
    table.update(
        decode_layer_step_eager_s={"value": 0.001, "kind": "assumed", "source": "t"},
        colocate_switch_s={"value": 0.5, "kind": "assumed", "source": "t"},
        train_layer_pass_eager_s={"value": 0.002, "kind": "assumed", "source": "t"},
    )
    full = plan_time.estimate_step(cfg, plan, rates=rates)
    table["decode_layer_step_eager_s"]["value"] = 0.002
    slower = plan_time.estimate_step(cfg, plan, rates=rates)
    layers, R = plan.shape.num_layers, cfg.rollout.max_response_len
    assert full.phases["sleep and wake"] >= 0.5
    # one wave of the 512 sequences: R decode steps, each `layers` eager layers
    extra_decode = slower.phases["rollout decode"] - full.phases["rollout decode"]
    assert extra_decode == pytest.approx(0.001 * layers * R, rel=1e-6)
    micro = -(-64 * 8 * (256 + 32) // cfg.trainer.micro_batch_tokens)
    extra = full.phases["train passes"] - bare.phases["train passes"]
    assert extra == pytest.approx(0.002 * layers * micro, rel=1e-6)  # the demo's layers run uncompiled
    # compiled layers (trainer.compile, on GPUs) do not launch kernel by kernel: the eager figure is not theirs
    compiled_cfg = load_config("recipes/gpu_demo.yaml", ["trainer.compile=true"])
    compiled = plan_time.estimate_step(compiled_cfg, make_plan(compiled_cfg, advise=False), rates=rates)
    assert compiled.phases["train passes"] == pytest.approx(bare.phases["train passes"], rel=1e-9)
    table["train_layer_pass_s"] = {"value": 0.0005, "kind": "assumed", "source": "t"}
    compiled = plan_time.estimate_step(compiled_cfg, make_plan(compiled_cfg, advise=False), rates=rates)
    extra = compiled.phases["train passes"] - bare.phases["train passes"]
    assert extra == pytest.approx(0.0005 * layers * micro, rel=1e-6)


def test_trainer_fixed_costs_recovered_from_two_batch_sizes():
    """bench.rates' GPU trainer figures: the line through S and S / 2 sequences in micro-batches gives back a
    per-call and a per-layer-and-micro-batch cost. The trainer here is a stand-in whose times follow that
    line exactly (the real one needs a GPU to show these costs), so the recovered figures must match."""
    from argparse import Namespace

    from bench import rates as bench_rates

    call_s, layer_s, layers, N = 0.09, 0.012, 4, 1e6
    cfg = load_config("recipes/gpu_demo.yaml", [])
    rate = {"train_tflops": 265.0, "logprob_tflops": 228.0}

    class Trainer:
        @staticmethod
        def measure(s, args):
            tokens = args.samples * args.seq_len
            micro = -(-tokens // s.cfg.trainer.micro_batch_tokens)
            fixed = call_s + micro * layers * layer_s
            return [
                {
                    "train_step_s": fixed + 6 * N * tokens / (rate["train_tflops"] * 1e12),
                    "log_probs_s": fixed / 2 + 2 * N * tokens / (rate["logprob_tflops"] * 1e12),
                }
            ]

    m = lambda value, note="": {"value": value}  # noqa: E731
    out = bench_rates._trainer_fixed_costs(Namespace(cfg=cfg), 512, N, layers, rate.get, m, Trainer)
    assert out["train_call_s"]["value"] == pytest.approx(call_s, rel=1e-6)
    # the GPU demo's layers run uncompiled (trainer.compile false): the figures of eager layers
    assert out["train_layer_pass_eager_s"]["value"] == pytest.approx(layer_s, rel=1e-6)
    assert out["logprob_call_s"]["value"] == pytest.approx(call_s / 2, rel=1e-6)
    assert out["logprob_layer_pass_eager_s"]["value"] == pytest.approx(layer_s / 2, rel=1e-6)
    compiled = load_config("recipes/gpu_demo.yaml", ["trainer.compile=true"])
    out = bench_rates._trainer_fixed_costs(Namespace(cfg=compiled), 512, N, layers, rate.get, m, Trainer)
    assert "train_layer_pass_s" in out and "train_layer_pass_eager_s" not in out


def test_merge_keeps_the_figures_not_measured(tmp_path):
    from bench import rates as bench_rates

    path = tmp_path / "rates.yaml"
    path.write_text(plan_time.RATES_FILE.read_text())
    before = plan_time.load_rates(str(path))["devices"]["h100-80gb"]["rates"]
    new = {"colocate_switch_s": {"value": 0.3, "kind": "measured", "date": "2026-12-06", "command": "x"}}
    bench_rates.merge("h100-80gb", new, path)
    after = plan_time.load_rates.__wrapped__(str(path))["devices"]["h100-80gb"]["rates"]
    assert after["colocate_switch_s"]["value"] == 0.3
    assert {k: v for k, v in after.items() if k != "colocate_switch_s"} == {
        k: v for k, v in before.items() if k != "colocate_switch_s"
    }
    assert path.read_text().startswith("# Rates")  # the header comment kept


def test_a_flop_rate_measured_on_another_model_size_is_noted():
    """The plan says when a FLOP rate comes from layers of another width (the rates file records it): the
    GPU demo's 128-wide model on the bench model's 2,048-wide rates, but not Muse Spark Open on the rates
    measured at its own width, nor the CPU demo on its own rates."""
    gpu_demo = "\n".join(_est("recipes/gpu_demo.yaml").notes)
    assert "decode_tflops was measured on layers of hidden size 2,048, this model's are 128" in gpu_demo
    muse = "\n".join(_est(MUSE).notes)
    assert "tflops" not in muse  # measured on Muse Spark Open's own layer width
    demo = _est("recipes/demo_cpu.yaml")
    assert not any("was measured on a model of" in n for n in demo.notes)
    assert demo.rates["train_tflops@2"].active_params > 0


def test_record_takes_a_runs_own_overrides_in_place_of_the_defaults(tmp_path):
    """`bench.rates --record`: a run made with the evaluation on (its .overrides file says so) is recorded
    with those values, not the defaults' eval.every=0, and its step time is the median from --first-step
    (rows written as the driver writes them: the evaluation's metrics merged into a step's row)."""
    import json

    from bench import rates as bench_rates

    runs = tmp_path / "runs"
    run = runs / "gpu_demo_h200"
    run.mkdir(parents=True)
    rows = [{"step": 0, "val-core/arith/acc/mean@8": 0.4}]
    for step, step_s in enumerate([9.0, 8.0, 1.7, 1.9, 1.8, 5.0], start=1):
        rows.append(
            {
                "step": step,
                "perf/step_s": step_s,
                "perf/rollout_s": step_s / 2,
                "perf/logprob_s": 0.0,
                "perf/train_s": step_s / 3,
                "perf/sync_s": 0.1,
                "perf/train_tokens": 512 * 84,
                "batch/samples": 512,
                "response_length/mean": 15.0,
            }
        )
    run.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs.joinpath("gpu_demo_h200.overrides").write_text(
        "trainer.total_steps=20 eval.every=5 resources.device=h200\n"
    )
    rates = tmp_path / "rates.yaml"
    rates.write_text(plan_time.RATES_FILE.read_text())
    args = ["--recipe", "gpu_demo", "--record", str(run), "--first-step", "3", "--file", str(rates)]
    assert bench_rates.main(args) == 0
    recorded = plan_time.load_rates.__wrapped__(str(rates))["runs"][-1]
    assert recorded["overrides"] == [
        "trainer.total_steps=20",
        "eval.every=5",
        "eval.at_start=false",
        "trainer.checkpoint_every=0",
        "resources.device=h200",
    ]
    assert recorded["device"] == "h200" and recorded["steps"] == [3, 4, 5, 6]
    assert recorded["step_s"] == pytest.approx(1.85) and recorded["prompt_len"] == pytest.approx(69.0)
    runs.joinpath("gpu_demo_h200.overrides").write_text("resources.device\n")
    with pytest.raises(SystemExit, match="expected key=value"):
        bench_rates.main(args)


def test_a_flop_rate_measured_at_several_widths_is_taken_nearest_the_planned_model():
    """train_tflops on the h100 was measured on the 2,048-wide bench model and on Muse Spark Open's 8,192-wide
    layer: each model is timed with the figure measured nearest its layers' width, by ratio (the matmuls'
    shapes set the rate); Qwen3-30B-A3B (2,048 wide, 3B active) takes the bench model's."""
    near = lambda hidden: plan_time.rate("h100-80gb", "train_tflops", hidden=hidden)  # noqa: E731
    assert near(256).value == near(2048).value == near(3000).value == 265
    assert near(5000).value == near(8192).value == 346 and near(8192).measured
    assert near(8192).hidden_size == 8192 and near(8192).active_params == 690782592.0
    assert plan_time.rate("h100-80gb", "train_tflops").value == 265  # no model given: the table's own
    muse = _est(MUSE)  # the reference recipe on the h200: the full-width figure, assumed from the H100's
    assert muse.rates["train_tflops"].hidden_size == 8192 and not muse.rates["train_tflops"].measured
    assert _est("recipes/qwen3_30b_a3b_1gpu.yaml").rates["train_tflops"].hidden_size == 2048
    cfg = load_config(MUSE)
    slower = plan_time.estimate_step(cfg, make_plan(cfg, advise=False), rates=_without_by_size())
    assert muse.phases["train passes"] < slower.phases["train passes"]


def _without_by_size() -> dict:
    import copy

    rates = copy.deepcopy(plan_time.load_rates())
    for device in rates["devices"].values():
        for f in device["rates"].values():
            f.pop("by_size", None)
    return rates
