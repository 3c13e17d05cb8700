"""Expert LoRA as grouped matmuls beside the frozen experts, instead of PEFT's W + s * B @ A.

PEFT adapts a fused expert parameter (`target_parameters`, `ParamWrapper`) by re-parametrising it: every
forward forms the whole [E, out, in] stack W + s * B_e @ A_e and runs the experts on it. For training that
costs, per MoE layer and pass, a copy of every expert's weights, a weight gradient for the full stack in
backward (the sum needs one to reach A and B), and a parametrisation registered and removed in Python. Here
the routed tokens take the frozen stack as they are (input gradients only), and beside it each token takes
its expert's own low-rank pair, x @ A_e^T @ B_e^T, as two more grouped matmuls of width `rank`:

    y = x @ W_e^T + s * (x @ A_e^T) @ B_e^T          for the tokens routed to expert e

Same function, same parameters and state-dict names as PEFT's (the module keeps its class's methods for
merging and saving; only `forward` changes), so adapter files, merging and vLLM's layout are untouched;
tests/unit/test_trainer_lora_experts.py holds it to PEFT's own forward and gradients.

Used for experts that look like transformers' fused SwiGLU experts (`gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I], `_apply_gate`, no bias, not transposed: Qwen3-MoE, Muse Spark) and whose shapes the grouped
kernel takes; anything else keeps PEFT's forward, run eagerly inside a compiled layer: PEFT registers its
parametrisation as a new class every forward, so dynamo would recompile it at each call and, under
activation checkpointing, recompute with a different graph than the forward saved for (a CheckpointError
at the first backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import ParamWrapper
from torch import nn

ADAPTED = ("gate_up_proj", "down_proj")


def wrapper_chain(outer: ParamWrapper) -> tuple[list[ParamWrapper], nn.Module]:
    """PEFT nests one ParamWrapper per adapted parameter: outermost first, then the experts module."""
    chain, m = [], outer
    while isinstance(m, ParamWrapper):
        chain.append(m)
        m = m.base_layer
    return chain, m


def _fits_grouped_mm(experts: nn.Module, rank: int) -> bool:
    """The grouped kernel wants 16-byte-aligned rows (bf16: widths that are multiples of 8)."""
    if not all(isinstance(getattr(experts, p, None), torch.Tensor) for p in ADAPTED):
        return False
    if getattr(experts, "is_transposed", True) or getattr(experts, "has_bias", True):
        return False
    if not getattr(experts, "has_gate", False) or not hasattr(experts, "_apply_gate"):
        return False
    if experts.gate_up_proj.dim() != 3 or experts.down_proj.dim() != 3:
        return False
    widths = (rank, *experts.gate_up_proj.shape[1:], *experts.down_proj.shape[1:])
    return all(w % 8 == 0 for w in widths)


@torch.library.custom_op("sparkrl::expert_lora_b", mutates_args=())
def expert_lora_b(lora_b: torch.Tensor, num_experts: int) -> torch.Tensor:
    """PEFT's lora_B [out, r * E] (expert-minor columns) as a contiguous [E, out, r] stack.

    A custom op so that torch.compile keeps it opaque: inductor lays out an op's output as its fake function
    says (contiguous here), where for the plain permute-and-copy it picked the source's stride order (expert
    axis innermost), which grouped_mm rejects. With it the whole MoE layer traces as one graph."""
    out, columns = lora_b.shape
    return lora_b.reshape(out, columns // num_experts, num_experts).permute(2, 0, 1).contiguous()


@expert_lora_b.register_fake
def _(lora_b, num_experts):
    out, columns = lora_b.shape
    return lora_b.new_empty((num_experts, out, columns // num_experts))


def _expert_lora_b_backward(ctx, grad):
    experts, out, rank = grad.shape
    return grad.permute(1, 2, 0).reshape(out, rank * experts), None


expert_lora_b.register_autograd(_expert_lora_b_backward)


def _factors(wrapper: ParamWrapper, adapter: str, dtype: torch.dtype):
    """(A [E, r, in], B [E, out, r], scaling) from PEFT's lora_A [r * E, in] (expert-major rows) and
    lora_B [out, r * E] (expert-minor columns)."""
    E = wrapper.num_experts
    A = wrapper.lora_A[adapter].weight
    B = wrapper.lora_B[adapter].weight
    A = A.reshape(E, -1, A.shape[-1]).to(dtype)
    return A, expert_lora_b(B.to(dtype), E), wrapper.scaling[adapter]


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [S, in] sorted by expert, weight [E, out, in] -> [S, out] (row block e through weight[e])."""
    return F.grouped_mm(x, weight.transpose(-2, -1), offs=offsets)


def _lora_linear(x, weight, offsets, factors) -> torch.Tensor:
    out = _grouped_linear(x, weight, offsets)
    if factors is not None:
        A, B, scaling = factors
        # Scale the small B, not the [S, out] product, and add in place (grouped_mm's backward does not need
        # its output): one pass over the widest activation instead of three.
        out.add_(_grouped_linear(_grouped_linear(x, A, offsets), B * scaling, offsets))
    return out


def grouped_lora_experts_forward(
    experts: nn.Module,
    factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """transformers' fused-experts forward (sum over the k routed experts of weight * SwiGLU expert) with
    each adapted projection's LoRA pair added. hidden_states [T, H]; top_k_index / top_k_weights [T, k]."""
    num_tokens, k = top_k_index.shape
    expert_ids, order = torch.sort(top_k_index.reshape(-1))
    x = hidden_states[order // k]  # [T * k, H], grouped by expert
    # Group ends from the sorted ids: fixed size [E], computed on the device. (bincount's output size
    # depends on the largest id, so it waited for the device in every layer and broke the compiled graph.)
    bounds = torch.arange(experts.num_experts, device=expert_ids.device, dtype=expert_ids.dtype)
    offsets = torch.searchsorted(expert_ids, bounds, right=True, out_int32=True)

    h = _lora_linear(x, experts.gate_up_proj, offsets, factors.get("gate_up_proj"))
    h = experts._apply_gate(h)
    y = _lora_linear(h, experts.down_proj, offsets, factors.get("down_proj"))
    y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)

    # Back to (token, slot) order, then sum the k slots (a reshape and sum: deterministic, unlike index_add_).
    unsorted = torch.empty_like(y)
    unsorted[order] = y
    return unsorted.view(num_tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


_forward = grouped_lora_experts_forward
# CPU: PEFT's forward unless a test asks (torch's CPU grouped_mm is a reference loop, and a trainer rank died
# of heap corruption in one of three CI runs of the CPU demo once it ran there).
_ON_CPU = False


def allow_on_cpu(enabled: bool = True) -> None:
    global _ON_CPU
    _ON_CPU = enabled


def compile_experts(enabled: bool = True) -> None:
    """Run the grouped expert forward through torch.compile (dynamic shapes: the token count varies), which
    fuses the element-wise work around the grouped matmuls; off again with enabled=False."""
    global _forward
    _forward = (
        torch.compile(grouped_lora_experts_forward, dynamic=True) if enabled else grouped_lora_experts_forward
    )


# PEFT's own forward of an expert chain, eager under torch.compile (the module docstring says why)
_peft_forward = torch._dynamo.disable(ParamWrapper.forward)


class GroupedLoraExperts(ParamWrapper):
    """The outermost of PEFT's nested ParamWrappers around a fused experts module, with a grouped forward.
    Installed by `use_grouped_expert_lora` (class swap: parameters, names and PEFT's methods unchanged)."""

    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        chain, experts = wrapper_chain(self)
        adapters = [a for a in self.active_adapters if a in self.lora_A]
        dtype = experts.gate_up_proj.dtype
        # torch.compile traces grouped_mm for bf16 only (its meta function rejects other dtypes)
        traced_other = torch.compiler.is_compiling() and dtype != torch.bfloat16
        off_gpu = not hidden_states.is_cuda and not _ON_CPU
        if (
            self.disable_adapters
            or self.merged
            or len(adapters) != 1
            or args
            or kwargs
            or traced_other
            or off_gpu
        ):
            return _peft_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        factors = {w.parameter_name: _factors(w, adapters[0], dtype) for w in chain}
        return _forward(experts, factors, hidden_states, top_k_index, top_k_weights)


class EagerLoraExperts(ParamWrapper):
    """The outermost ParamWrapper of a chain the grouped kernel cannot take: PEFT's forward, never traced."""

    forward = _peft_forward


def use_grouped_expert_lora(model: nn.Module) -> int:
    """Swap every suitable expert ParamWrapper chain of a PEFT model to GroupedLoraExperts; returns how many.
    Chains that target anything but gate_up_proj / down_proj, or whose shapes do not fit the grouped
    kernel, keep PEFT's forward as EagerLoraExperts."""
    inner = {id(m.base_layer) for m in model.modules() if isinstance(m, ParamWrapper)}
    count = 0
    for module in model.modules():
        if type(module) is not ParamWrapper or id(module) in inner:
            continue  # inner wrappers belong to their outer one's chain
        chain, experts = wrapper_chain(module)
        fits = all(w.parameter_name in ADAPTED for w in chain) and all(
            _fits_grouped_mm(experts, r) for w in chain for r in w.r.values()
        )
        module.__class__ = GroupedLoraExperts if fits else EagerLoraExperts
        count += fits
    return count
