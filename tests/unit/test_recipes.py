"""Every shipped recipe loads, lays out its GPUs through rl.placement and fits per `sparkrl plan`: the recipes
start as written (on the GPUs they name) and the plan and the placement agree on them."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl import plan as P
from rl.config import load_config
from rl.placement import plan_placement
from rl.sweep import load_sweep, point_config

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
SWEEPS = sorted((ROOT / "recipes" / "sweeps").glob("*.yaml"))
GiB = 2**30


def _configs():
    for path in RECIPES:
        yield path.name, load_config(path)
    for path in SWEEPS:
        sweep = load_sweep(path)
        for point in sweep.points:
            yield f"{path.name}:{point.name}", point_config(sweep, point)


def test_the_reference_recipes_are_shipped():
    assert {"muse_spark_open_dapo_lora.yaml", "qwen3_30b_a3b_dapo_lora.yaml", "demo_cpu.yaml"} <= {
        p.name for p in RECIPES
    }


@pytest.mark.parametrize("name,cfg", list(_configs()), ids=lambda v: v if isinstance(v, str) else "")
def test_recipe_places_and_fits(name, cfg):
    bundles, place = plan_placement(cfg)
    plan = P.make_plan(cfg)
    assert plan.fits, f"{name}:\n{P.format_plan(plan, name)}"
    if cfg.resources.num_gpus == 0:
        assert bundles == [] and plan.verdicts == []
        return
    assert ("placement", True) == next((n, ok) for n, ok, _ in plan.verdicts if n == "placement")
    ro = cfg.rollout
    engines = place.rollout_bundles
    assert len(engines) == ro.num_workers
    used = [b for engine in engines for b in engine]
    assert len(set(used)) == len(used)  # no bundle hosts two engines' ranks
    if ro.placement == "colocated":
        assert all(len(e) == ro.tensor_parallel_size for e in engines)
        assert len(bundles) == max(cfg.trainer.num_ranks, ro.num_workers * ro.tensor_parallel_size)
        per_node = cfg.resources.gpus_per_node
        # PACK fills nodes in turn: bundle b is on node b // gpus_per_node; an engine sits on one node
        assert all(len({b // per_node for b in e}) == 1 for e in engines)


def test_muse_fits_16_h200s_with_its_nvfp4_base():
    path = ROOT / "recipes" / "muse_spark_open_dapo_lora.yaml"
    cfg = load_config(path)
    assert (cfg.resources.num_gpus, cfg.resources.nodes, cfg.resources.gpu_memory_gib) == (16, 2, 140)
    p = P.make_plan(cfg)
    assert p.fits and p.base_format == "nvfp4" and p.logits_tokens == 4096
    assert p.margin / GiB == pytest.approx(11.0, abs=0.05)  # the margin the recipe's comment states
    assert p.t_peak / GiB == pytest.approx(79.7, abs=0.05)  # expert parallelism 8
    # The BF16 base does not fit an H200 and fits the reference run's GB300s (the recipe's example line).
    assert not P.make_plan(load_config(path, ["trainer.base_format=bf16"])).fits
    gb300 = ["trainer.base_format=bf16", "resources.gpu_memory_gib=288", "rollout.gpu_memory_utilization=0.5"]
    p = P.make_plan(load_config(path, gb300))
    assert p.fits and p.t_peak / GiB == pytest.approx(149.2, abs=0.05)
    assert " ".join(gb300) in path.read_text()


def test_qwen3_fits_8_h200s():
    cfg = load_config(ROOT / "recipes" / "qwen3_30b_a3b_dapo_lora.yaml")
    p = P.make_plan(cfg)
    assert p.fits and p.base_format == "bf16" and (p.tp, p.engines) == (2, 4)
    assert p.margin / GiB == pytest.approx(35.2, abs=0.05)
