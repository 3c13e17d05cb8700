"""trainer.parallelize with compile=True: each decoder layer through torch.compile, inside activation
checkpointing, under FSDP2, gives the eager trainer's log-probs and LoRA gradients, with R3 replay active
and across two sequence lengths (dynamic shapes). Tiny Muse Spark in bf16 (the GPU compute dtype: compiled
grouped matmuls take bf16 only) on CPU, one gloo rank; the worker compiles on GPU only, this pins the layering
it uses, through inductor's graphs and partitioner run eagerly (BACKEND). Decomposed ops round differently
from eager ones (and inductor's fused kernels on the GPU more so), so both the compiled and the eager
bf16 trainer are held to an fp32 eager reference (same bf16-rounded weights): compiling may not add more than
bf16's own error; a layer left out of the recomputation or a LoRA term lost would.

With an activation memory budget the compiled layers take no checkpoint wrapper: the partitioner's
recomputation is held to the same tolerance, and must save less for backward than at budget 1.0 (its
default split), counted by saved-tensor hooks around the forward (AOTAutograd saves through
save_for_backward, which they see)."""

import pytest
import torch
import torch._functorch.config as functorch_config
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import init_device_mesh

from rl.tiny import make_tiny
from trainer.config import LoraConfig
from trainer.gloo import cpu_backend
from trainer.lora import apply_lora
from trainer.lora_experts import EagerLoraExperts, GroupedLoraExperts
from trainer.parallelize import parallelize
from trainer.rendezvous import free_port
from trainer.routing_replay import RoutingReplay

pytestmark = pytest.mark.slow

# AOTAutograd with inductor's decompositions and its partitioner (the activation memory budget included),
# run eagerly instead of through generated code: the graphs, their sharing across layers and the
# recomputation split are inductor's, without its C++ compile, which the CPU trainer never runs.
BACKEND = "aot_eager_decomp_partition"


@pytest.fixture(autouse=True)
def grouped_on_cpu():
    from trainer.lora_experts import allow_on_cpu

    allow_on_cpu(True)  # the trainer keeps PEFT's expert forward on CPU; the compiled GPU path is grouped
    yield
    allow_on_cpu(False)


@pytest.fixture(scope="module")
def mesh():
    if dist.is_initialized():
        pytest.fail("a process group is already up in this process")
    dist.init_process_group(cpu_backend(), init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.fixture
def restore_memory_budget():
    before = functorch_config.activation_memory_budget
    yield
    functorch_config.activation_memory_budget = before
    torch._dynamo.reset()  # no graph compiled under this test's budget is left for later tests


def _model(mesh, compile: bool, dtype=torch.bfloat16, budget: float = 0.0, rank: int = 8):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(make_tiny("muse"), dtype=torch.bfloat16).to(dtype)
    spec = LoraConfig(rank=rank, alpha=2.0 * rank, target_experts=True, target_latent=True)
    model = apply_lora(base, spec, seed=2, init_lora_weights=False)
    replay = RoutingReplay(base)
    parallelize(
        base,
        base.model.layers,
        mesh,
        compute_dtype=dtype,
        activation_checkpointing=True,
        compile=compile,
        activation_memory_budget=budget,
        compile_backend=BACKEND,
    )
    return model, replay


def _run(model, replay, ids):
    model.zero_grad(set_to_none=True)
    n = ids.numel()
    routed = (torch.arange(n)[:, None, None] + torch.arange(2)) % 8  # [N, 1, k] -> every layer
    routed = routed.expand(n, replay.num_layers, 2).contiguous()
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with replay.active(routed, torch.ones(n, dtype=torch.bool)):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(input_ids=ids, use_cache=False).logits.float()
            logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        (-logp.mean()).backward()
    params = [(n.replace("._checkpoint_wrapped_module", ""), p) for n, p in model.named_parameters()]
    grads = {n: p.grad.full_tensor().clone() for n, p in params if p.requires_grad}
    return logp.detach(), grads, saved[0]  # the last: bytes the forward kept for backward


def _assert_close_to_reference(ref, eager, got):
    """_run's results: `got` may not be further from the fp32 reference than 1.5 x eager bf16's error."""
    (ref_logp, ref, _), (eager_logp, eager_grads, _), (logp, grads, _) = ref, eager, got
    floor = (eager_logp - ref_logp).abs().mean()
    assert (logp - ref_logp).abs().mean() <= 1.5 * floor + 1e-3
    assert grads.keys() == ref.keys()
    assert all(ref[n].abs().max() > 0 for n in ref if ".experts." in n)
    for n in ref:
        floor = (eager_grads[n] - ref[n]).norm() / ref[n].norm()
        err = (grads[n] - ref[n]).norm() / ref[n].norm()
        assert err <= 1.5 * floor + 0.01, (n, float(err), float(floor))


def test_compiled_layers_match_eager(mesh):
    torch._dynamo.reset()
    reference, reference_replay = _model(mesh, compile=False, dtype=torch.float32)
    eager, eager_replay = _model(mesh, compile=False)
    compiled, compiled_replay = _model(mesh, compile=True)
    assert any(isinstance(m, GroupedLoraExperts) for m in compiled.modules())
    layer = compiled.base_model.model.model.layers[0]
    assert layer._checkpoint_wrapped_module._compiled_call_impl is not None  # compiled, inside the AC wrapper
    code = type(layer._checkpoint_wrapped_module).forward.__code__
    g = torch.Generator().manual_seed(0)
    # Both lengths inside the sliding window (16), where no layer takes a mask: the second runs the first's
    # graphs (a layer with a sliding mask is other graphs: the memory budget test's 64 tokens compile them).
    for length in (12, 15):
        ids = torch.randint(5, 300, (2, length), generator=g)
        _assert_close_to_reference(
            _run(reference, reference_replay, ids),
            _run(eager, eager_replay, ids),
            _run(compiled, compiled_replay, ids),
        )
        # The 8 layers share their compiled graphs (3: the first layer's frozen input, the others, their
        # recomputation): nothing layer-specific may be a constant in them. R3's replay hook once closed
        # over the layer index; dynamo guarded on it and compiled every layer anew (15 graphs here, on the
        # GPU minutes per step). A new length is no new graph either: the layers compile with dynamic shapes.
        assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code)) <= 3


def test_compiled_layers_with_peft_expert_lora_match_eager(mesh):
    """Rank 4 does not fit the grouped kernel: the experts keep PEFT's forward, which re-registers its
    parametrisation (a new class) every call. Traced, every call recompiled and the checkpoint's
    recomputation saved different tensors than the forward (CheckpointError at the first backward); it
    runs eagerly between the layer's compiled graphs."""
    torch._dynamo.reset()
    reference, reference_replay = _model(mesh, compile=False, dtype=torch.float32, rank=4)
    eager, eager_replay = _model(mesh, compile=False, rank=4)
    compiled, compiled_replay = _model(mesh, compile=True, rank=4)
    assert any(isinstance(m, EagerLoraExperts) for m in compiled.modules())
    assert not any(isinstance(m, GroupedLoraExperts) for m in compiled.modules())
    ids = torch.randint(5, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    _assert_close_to_reference(
        _run(reference, reference_replay, ids),
        _run(eager, eager_replay, ids),
        _run(compiled, compiled_replay, ids),
    )


def test_memory_budget_recomputes_instead_of_the_checkpoint_wrapper(mesh, restore_memory_budget):
    torch._dynamo.reset()
    ids = torch.randint(5, 300, (2, 64), generator=torch.Generator().manual_seed(1))
    ref = _run(*_model(mesh, compile=False, dtype=torch.float32), ids)
    eager = _run(*_model(mesh, compile=False), ids)
    saved = {}
    # No dynamo reset between the two: parallelize must not hand budget 1.0's cached graphs to 0.05.
    for budget in (1.0, 0.05):
        model, replay = _model(mesh, compile=True, budget=budget)  # activation_checkpointing=True too
        assert not any(isinstance(m, CheckpointWrapper) for m in model.modules())
        assert functorch_config.activation_memory_budget == budget
        got = _run(model, replay, ids)
        _assert_close_to_reference(ref, eager, got)
        saved[budget] = got[2]
    # 128 tokens, so that the activations outweigh the base weights both save: 8.8 MB vs 5.5 MB seen
    assert saved[0.05] < 0.75 * saved[1.0], saved
