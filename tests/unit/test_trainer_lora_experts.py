"""trainer/lora_experts.py: expert LoRA as grouped matmuls must be PEFT's expert LoRA (forward, gradients of
every LoRA weight, state-dict names) on the tiny Qwen3-MoE and Muse Spark models, in fp32 on CPU (real
transformers models, real PEFT, torch's grouped_mm; no fakes)."""

import numpy as np
import pytest
import torch
from peft.tuners.lora.layer import ParamWrapper

from rl.tiny import make_tiny
from trainer.config import LoraConfig
from trainer.lora import apply_lora
from trainer.lora_experts import GroupedLoraExperts, allow_on_cpu
from trainer.routing_replay import RoutingReplay

SPEC = LoraConfig(rank=8, alpha=16.0, target_experts=True, target_latent=True)


@pytest.fixture(autouse=True)
def grouped_on_cpu():
    """The trainer keeps PEFT's forward on CPU; these tests run the grouped one there on purpose."""
    allow_on_cpu(True)
    yield
    allow_on_cpu(False)


def _pair(arch: str, spec: LoraConfig = SPEC):
    from transformers import AutoModelForCausalLM

    path = make_tiny(arch)
    out = []
    for grouped in (False, True):
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        out.append(apply_lora(base, spec, seed=1, init_lora_weights=False, grouped_experts=grouped))
    return out


def _loss_and_grads(model, ids, routed=None):
    model.zero_grad(set_to_none=True)
    replay = RoutingReplay(model.base_model.model)
    ctx = replay.active(routed, torch.ones(len(routed), dtype=torch.bool)) if routed is not None else None
    try:
        if ctx:
            ctx.__enter__()
        logits = model(input_ids=ids, use_cache=False).logits.float()
        weights = torch.linspace(-1, 1, logits.shape[-1])  # not a plain sum: grad_output varies per element
        (logits * weights).mean().backward()
    finally:
        if ctx:
            ctx.__exit__(None, None, None)
        replay.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return logits.detach(), grads


@pytest.mark.parametrize("arch", ["qwen3_moe", "muse"])
def test_grouped_expert_lora_matches_peft_forward_and_gradients(arch):
    peft_model, grouped = _pair(arch)
    swapped = [m for m in grouped.modules() if isinstance(m, GroupedLoraExperts)]
    layers = grouped.base_model.model.config.num_hidden_layers
    assert len(swapped) == layers  # one per MoE layer: the outer wrapper of gate_up_proj + down_proj
    assert not any(isinstance(m, GroupedLoraExperts) for m in peft_model.modules())
    assert grouped.state_dict().keys() == peft_model.state_dict().keys()

    ids = torch.randint(5, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    ref_logits, ref_grads = _loss_and_grads(peft_model, ids)
    logits, grads = _loss_and_grads(grouped, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    expert_grads = [n for n in grads if ".experts." in n]
    assert expert_grads and all(ref_grads[n].abs().max() > 0 for n in expert_grads)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_experts_without_tokens_get_zero_gradients_as_with_peft():
    """R3 sends every token to experts 0 and 1: the other six run on empty groups."""
    peft_model, grouped = _pair("qwen3_moe")
    ids = torch.randint(5, 300, (1, 10), generator=torch.Generator().manual_seed(2))
    routed = torch.zeros((10, 4, 2), dtype=torch.long)
    routed[..., 1] = 1
    ref_logits, ref_grads = _loss_and_grads(peft_model, ids, routed)
    logits, grads = _loss_and_grads(grouped, ids, routed)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    name = next(n for n in grads if n.endswith("experts.base_layer.lora_A.default.weight"))
    per_expert = grads[name].reshape(8, 8, -1).abs().amax(dim=(1, 2))  # experts x rank x in
    assert np.all(per_expert[:2].numpy() > 0) and np.all(per_expert[2:].numpy() == 0)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)


def test_ranks_the_grouped_kernel_cannot_take_keep_peft():
    """Widths must be multiples of 8 (16-byte rows in bf16): rank 4 stays on PEFT's own forward."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(make_tiny("qwen3_moe"), dtype=torch.float32)
    model = apply_lora(base, LoraConfig(rank=4, alpha=8.0), seed=0)
    wrappers = [m for m in model.modules() if isinstance(m, ParamWrapper)]
    assert wrappers and not any(isinstance(m, GroupedLoraExperts) for m in wrappers)


def test_expert_function_traces_as_one_graph_without_data_dependent_shapes():
    """The expert function must not wait for the device: an op whose output size depends on the routed ids
    (bincount did) is a host sync in every MoE layer on the GPU and a graph break under torch.compile. dynamo's
    explain on the real function, in bf16 (grouped_mm traces bf16 only), counts the breaks."""
    import torch._dynamo

    from trainer.lora_experts import grouped_lora_experts_forward

    base = _pair("qwen3_moe")[1].base_model.model
    experts_module = next(m for m in base.modules() if isinstance(m, GroupedLoraExperts))
    experts = experts_module.base_layer.base_layer.to(torch.bfloat16)
    tokens, hidden, k = 12, experts.gate_up_proj.shape[-1], 2
    r, e = 8, experts.num_experts
    g = torch.Generator().manual_seed(0)
    factors = {
        "gate_up_proj": (
            torch.randn(e, r, hidden, generator=g).bfloat16(),
            torch.randn(e, experts.gate_up_proj.shape[1], r, generator=g).bfloat16(),
            2.0,
        ),
        "down_proj": (
            torch.randn(e, r, experts.down_proj.shape[-1], generator=g).bfloat16(),
            torch.randn(e, hidden, r, generator=g).bfloat16(),
            2.0,
        ),
    }
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g).bfloat16()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(grouped_lora_experts_forward)(experts, factors, x, idx, weights)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_expert_lora_b_op_is_consistent_for_the_compiler():
    """The custom op's fake (shape, layout), autograd and eager agree (torch.library.opcheck), and its
    gradient is right (gradcheck in float64)."""
    from trainer.lora_experts import expert_lora_b

    g = torch.Generator().manual_seed(0)
    b = torch.randn(6, 4 * 3, generator=g, dtype=torch.float64, requires_grad=True)  # out 6, rank 4, E 3
    torch.library.opcheck(expert_lora_b, (b, 3))
    assert torch.autograd.gradcheck(lambda t: expert_lora_b(t, 3), (b,))
    stacked = expert_lora_b(b, 3)
    assert stacked.shape == (3, 6, 4) and stacked.is_contiguous()
    assert torch.equal(stacked[2, 5, 1], b[5, 1 * 3 + 2])  # expert e, row o, rank j <- column j*E + e


def test_compiled_moe_block_is_one_graph_and_matches_eager():
    """A whole experts module under torch.compile(fullgraph=True) in bf16: no graph break (the B layout is
    the custom op's), same forward and LoRA gradients as eager within bf16 rounding."""
    model = _pair("qwen3_moe")[1]
    experts = next(m for m in model.modules() if isinstance(m, GroupedLoraExperts)).to(torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    hidden = experts.base_layer.base_layer.gate_up_proj.shape[-1]
    x = torch.randn(24, hidden, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(24)])
    w = torch.rand(24, 2, generator=g).bfloat16()
    params = [p for p in experts.parameters() if p.requires_grad]

    def run(fn):
        for p in params:
            p.grad = None
        y = fn(x, idx, w)
        (y.float() * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
        return y.detach().float(), [p.grad.float().clone() for p in params]

    y_ref, g_ref = run(experts)
    torch._dynamo.reset()
    y, grads = run(torch.compile(experts, fullgraph=True, dynamic=True))
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2)
    for a, b in zip(grads, g_ref):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))
