"""Expert parallelism without ranks: the config and preflight refuse a size that does not divide the ranks
or the experts, or a group that would span nodes, naming the keys; a rank's shard of the adapter sits at
its global expert ids (PEFT's layout), and `shard_experts` narrows banks and LoRA alike. The multi-rank
comparison with EP 1 is tests/integration/test_trainer_expert_parallel.py."""

from __future__ import annotations

import pytest
import torch

from rl.config import ConfigError, load_config
from rl.preflight import PreflightError, check_model
from trainer.expert_parallel import LORA_B, ROWS, ExpertParallel, ExpertShards, shard_experts
from trainer.lora import expert_slices


def _cfg(*overrides):
    return load_config("demo_cpu", ["logging.tensorboard=false", *overrides])


def _problem(*overrides) -> str:
    """The config's error for `overrides`, '' when it loads."""
    try:
        _cfg(*overrides)
    except ConfigError as e:
        return str(e)
    return ""


def test_the_size_must_divide_the_trainer_ranks():
    assert _problem("trainer.num_ranks=4", "trainer.expert_parallel_size=2") == ""
    problem = _problem("trainer.num_ranks=4", "trainer.expert_parallel_size=3")
    assert "trainer.expert_parallel_size: must divide trainer.num_ranks (4), got 3" in problem


def test_a_group_that_would_span_nodes_is_refused_naming_the_keys():
    gpus = ["resources.num_gpus=16", "resources.nodes=2", "resources.gpus_per_node=8", "sync.mode=adapter"]
    assert _problem(*gpus, "trainer.num_ranks=16", "trainer.expert_parallel_size=8") == ""
    # 12 ranks in groups of 6: ranks 6..11 sit on nodes 0 and 1
    bad = _problem(*gpus, "trainer.num_ranks=12", "trainer.expert_parallel_size=6")
    assert "trainer.expert_parallel_size: 6 consecutive trainer ranks would span nodes" in bad
    assert "resources.gpus_per_node=8" in bad
    # all ranks on one node: any divisor of the ranks
    assert _problem(*gpus, "trainer.num_ranks=6", "trainer.expert_parallel_size=3") == ""


def test_preflight_refuses_a_size_that_does_not_divide_the_experts():
    problems: list[str] = []
    check_model(_cfg("trainer.num_ranks=6", "trainer.expert_parallel_size=3"), problems)
    assert len(problems) == 1 and problems[0].startswith("trainer.expert_parallel_size: 3 does not divide")
    assert "(8 routed experts a layer)" in problems[0]
    problems = []
    check_model(_cfg("trainer.num_ranks=4", "trainer.expert_parallel_size=4"), problems)
    assert problems == []


def test_preflight_refuses_expert_parallelism_on_a_dense_model(tiny_dense_path):
    cfg = _cfg(
        "model.make_tiny.arch=",
        f"model.path={tiny_dense_path}",
        "lora.target_experts=false",
        "r3.enabled=false",
        "trainer.expert_parallel_size=2",
    )
    problems: list[str] = []
    check_model(cfg, problems)
    assert len(problems) == 1 and problems[0].startswith("trainer.expert_parallel_size: 2, but")
    with pytest.raises(PreflightError):
        from rl.preflight import preflight

        preflight(cfg)


def _shards(rank: int, size: int = 4, experts: int = 8) -> ExpertShards:
    return ExpertShards(size=size, rank=rank, num_experts=experts, kinds={"a": ROWS, "b": LORA_B})


def test_a_ranks_lora_is_its_experts_at_their_global_ids():
    r, experts = 3, 8
    A, B = torch.randn(r * experts, 5), torch.randn(6, r * experts)
    for rank in range(4):
        s = _shards(rank)
        a, b = s.to_local("a", A), s.to_local("b", B)
        assert a.shape == (r * s.local, 5) and b.shape == (6, r * s.local)
        for e in range(s.local):
            g = s.first + e
            assert torch.equal(
                a[expert_slices("x.lora_A.w", s.local, r, e)], A[expert_slices("x.lora_A.w", experts, r, g)]
            )
            assert torch.equal(
                b[expert_slices("x.lora_B.w", s.local, r, e)], B[expert_slices("x.lora_B.w", experts, r, g)]
            )
        assert s.global_shape("a", tuple(a.shape)) == tuple(A.shape)
        assert s.global_shape("b", tuple(b.shape)) == tuple(B.shape)
    assert torch.equal(_shards(0).to_local("other", A), A)


def test_shard_experts_narrows_banks_and_lora_of_a_peft_model(tiny_moe_path):
    from transformers import AutoModelForCausalLM

    from trainer.config import LoraConfig
    from trainer.lora import apply_lora

    base = AutoModelForCausalLM.from_pretrained(tiny_moe_path, dtype=torch.float32)
    full = {
        n: p.detach().clone() for n, p in apply_lora(base, LoraConfig(rank=4), 0, False).named_parameters()
    }
    base = AutoModelForCausalLM.from_pretrained(tiny_moe_path, dtype=torch.float32)
    model = apply_lora(base, LoraConfig(rank=4), 0, False)
    shards = _shards(2)
    shards.kinds = {}
    units = shard_experts(model, shards)
    assert len(units) == base.config.num_hidden_layers
    assert all(isinstance(u, ExpertParallel) for u in units)
    names = dict(model.named_parameters())
    banks = [n for n in shards.kinds if n.endswith(("gate_up_proj", "down_proj"))]
    loras = [n for n in shards.kinds if ".lora_" in n]
    assert len(banks) == 2 * len(units) and len(loras) == 4 * len(units)
    for n in shards.kinds:
        local = names[n].detach()
        assert torch.equal(local, shards.to_local(n, full[n])), n
        assert shards.global_shape(n, tuple(local.shape)) == tuple(full[n].shape), n
    assert not any(".self_attn." in n for n in shards.kinds)


def test_the_exchange_carries_any_dtype_and_no_rows_both_ways(tmp_path):
    """One gloo rank sending to itself: rows of mixed dtypes (whose byte widths leave the next tensor
    misaligned in the block), one row, and none; the backward returns the gradients of the float ones."""
    import torch.distributed as dist

    from trainer.expert_parallel import all_to_all

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for rows in (3, 1, 0):
            x = torch.randn(rows, 5, requires_grad=True)
            w = torch.randn(rows, 1, dtype=torch.float64, requires_grad=True)
            ids = torch.arange(rows)[:, None]
            got = all_to_all((x, w, ids), [rows], [rows], dist.group.WORLD)
            assert [g.dtype for g in got] == [torch.float32, torch.float64, torch.int64]
            for g, want in zip(got, (x, w, ids)):
                assert torch.equal(g, want)
            (got[0].sum() * 2 + got[1].sum()).backward()
            assert torch.equal(x.grad, torch.full_like(x, 2.0)) and torch.equal(w.grad, torch.ones_like(w))
    finally:
        dist.destroy_process_group()
