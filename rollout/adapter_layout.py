"""The one module that knows both the trainer's (PEFT / Hugging Face) names and vLLM's adapter layout.

Adapter: the trainer exports a PEFT LoRA adapter. Plain modules (`target_modules`: attention, dense MLPs)
keep their PEFT keys. Fused MoE experts are adapted through PEFT `target_parameters` on the 3D expert
parameters of a transformers-5 experts module, e.g. Qwen3-MoE's `mlp.experts.gate_up_proj`
`[E, 2I, H]` and `mlp.experts.down_proj` `[E, H, I]`. PEFT wraps each targeted parameter in a
`lora.ParamWrapper`, nesting one wrapper per parameter on the same module, so the keys of the
innermost parameter carry one `.base_layer` per wrapper above it:

    base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight   (gate_up_proj: inner wrapper)
    base_model.model.model.layers.0.mlp.experts.lora_A.weight              (down_proj: outer wrapper)

PEFT 0.21 `ParamWrapper` semantics (peft/tuners/lora/layer.py), with r the rank and E the experts:
`lora_A.weight` is `[r * E, in]`, expert-major rows (expert e owns rows e*r .. e*r + r - 1);
`lora_B.weight` is `[out, r * E]`, rank-major columns (expert e owns columns j*E + e); `in` / `out` are
the true input / output widths of the expert projection whatever the parameter's storage order;
the delta of expert e is `scaling * B_e @ A_e` (`[out, in]`).

vLLM 0.26 loads that 3D layout only with `enable_mixed_moe_lora_format=True` on the engine and
`is_3d_lora_weight=True` on the request (without them its engine dies in `lora/layers/fused_moe.py`); then
`LoRAModelManager._convert_3d_to_2d_moe_lora` splits it per expert, in a few tensor ops per layer. That is
`stacked_experts=True` below (`sync.expert_layout: stacked`, the default: it syncs in half the time of
`per_expert` on the H200, docs/benchmarks.md). Otherwise (`per_expert`) it loads per-expert 2D keys
`...mlp.experts.{e}.{gate_proj,up_proj,down_proj}.lora_{A,B}.weight` with A `[r, in]` and B `[out, r]`. `gate_up_proj` stacks gate then up along its output (see
transformers' `Qwen3MoeExperts.forward`: `linear(x, gate_up_proj[e]).chunk(2)`), so its B splits in
halves and both halves share A.

vLLM ignores `alpha_pattern` / `rank_pattern` and applies one scaling from `adapter_config.json`, so the
converted adapter has each module's own scaling folded into its B and declares `lora_alpha = r`
(scaling 1). The result is exact for any rank pattern.

Merged weights: the trainer's merged model uses Hugging Face names with fused 3D experts in memory;
vLLM's model loaders read checkpoint names, which for these models are per expert
(`...mlp.experts.{e}.gate_proj.weight`). `merged_to_checkpoint` converts.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class FusedExpertParam:
    """A fused 3D expert parameter `[E, out, in]` and the per-expert projections it stacks along `out`."""

    projections: tuple[str, ...]


# Parameter name on the experts module -> how it splits. Qwen3-MoE / Qwen2-MoE / Mixtral layout in
# transformers 5 (gate then up, not interleaved).
FUSED_EXPERT_PARAMS = {
    "gate_up_proj": FusedExpertParam(("gate_proj", "up_proj")),
    "down_proj": FusedExpertParam(("down_proj",)),
}

_LORA_KEY = re.compile(
    r"^(?P<module>.+?)(?P<wrappers>(?:\.base_layer)*)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)


class AdapterLayoutError(ValueError):
    """The adapter cannot be converted; the message names the key or config field at fault."""


def _to_torch(x) -> torch.Tensor:
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    raise AdapterLayoutError(f"adapter tensors must be torch.Tensor or numpy arrays, got {type(x).__name__}")


def _scaling(peft_config: dict, rank: int) -> float:
    alpha = peft_config.get("lora_alpha")
    if alpha is None:
        raise AdapterLayoutError("adapter_config.json has no lora_alpha")
    if peft_config.get("use_rslora"):
        return alpha / math.sqrt(rank)
    return alpha / rank


def _check_supported(peft_config: dict) -> None:
    if peft_config.get("peft_type", "LORA").upper() != "LORA":
        raise AdapterLayoutError(f"adapter_config.json peft_type is {peft_config['peft_type']!r}, need LORA")
    # A module-specific alpha needs PEFT's pattern matching to resolve; the trainer never sets one.
    if peft_config.get("alpha_pattern"):
        raise AdapterLayoutError(
            "adapter_config.json alpha_pattern is not supported by the rollout conversion"
        )
    for key in ("use_dora", "modules_to_save"):
        if peft_config.get(key):
            raise AdapterLayoutError(f"adapter_config.json {key}={peft_config[key]!r}: vLLM cannot serve it")
    if peft_config.get("bias", "none") != "none":
        raise AdapterLayoutError(f"adapter_config.json bias={peft_config['bias']!r}: vLLM needs 'none'")


def _fused_params_of(module: str, peft_config: dict) -> list[str]:
    """Names of the parameters of `module` (PEFT key path without prefix) that `target_parameters` names."""
    unwrapped = module[len(PEFT_PREFIX) :] if module.startswith(PEFT_PREFIX) else module
    found = []
    for target in peft_config.get("target_parameters") or []:
        target_module, _, param = target.rpartition(".")
        # PEFT matches a full name or a dotted suffix of it.
        if unwrapped == target_module or unwrapped.endswith("." + target_module) or not target_module:
            found.append(param)
    return sorted(set(found))


def _assign_fused(
    module: str, levels: dict[int, dict[str, torch.Tensor]], params: list[str]
) -> dict[int, str]:
    """Which fused parameter each wrapper depth holds (depth = number of `.base_layer` in the key)."""
    if len(levels) != len(params):
        raise AdapterLayoutError(
            f"{module}: the adapter has LoRA weights at {len(levels)} wrapper depth(s) but target_parameters "
            f"names {len(params)} parameter(s) of it ({params})"
        )
    unknown = [p for p in params if p not in FUSED_EXPERT_PARAMS]
    if unknown:
        raise AdapterLayoutError(
            f"{module}: fused expert parameter(s) {unknown} have no per-expert layout known to "
            f"rollout.adapter_layout (known: {sorted(FUSED_EXPERT_PARAMS)})"
        )
    depths = sorted(levels)
    if len(params) == 1:
        return {depths[0]: params[0]}
    if sorted(params) != ["down_proj", "gate_up_proj"]:
        raise AdapterLayoutError(f"{module}: cannot tell apart the wrappers of {params}")
    # PEFT nests in the module's parameter order, which the saved adapter does not record; the shapes do:
    # gate_up's input (hidden) is down's output, and gate_up's output (2 x intermediate) is twice down's input.
    a, b = (levels[d] for d in depths)

    def is_gate_up_then_down(gu, dn):
        return gu["A"].shape[1] == dn["B"].shape[0] and gu["B"].shape[0] == 2 * dn["A"].shape[1]

    if is_gate_up_then_down(a, b):
        return {depths[0]: "gate_up_proj", depths[1]: "down_proj"}
    if is_gate_up_then_down(b, a):
        return {depths[0]: "down_proj", depths[1]: "gate_up_proj"}
    raise AdapterLayoutError(
        f"{module}: LoRA shapes {[(tuple(levels[d]['A'].shape), tuple(levels[d]['B'].shape)) for d in depths]} "
        "do not fit a gate_up_proj / down_proj pair"
    )


def split_fused_lora(
    lora_a: torch.Tensor, lora_b: torch.Tensor, rank: int, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A PEFT ParamWrapper's A `[r*E, in]` and B `[out, r*E]` -> stacked per-expert A `[E, r, in]` and
    `scale * B` `[E, out, r]`, both contiguous. A is a view of `lora_a` when that is contiguous (its rows are
    expert-major already); B is one copy, scaled in place."""
    if lora_a.shape[0] % rank or lora_a.shape[0] != lora_b.shape[1]:
        raise AdapterLayoutError(
            f"fused LoRA shapes A {tuple(lora_a.shape)} / B {tuple(lora_b.shape)} do not fit rank {rank}"
        )
    num_experts, out_features = lora_a.shape[0] // rank, lora_b.shape[0]
    a = lora_a.reshape(num_experts, rank, lora_a.shape[1]).contiguous()
    # B's columns are rank-major (expert e owns columns j*E + e): seen as [out*r, E], B is the transpose of
    # the stacked [E, out*r] = [E, out, r]. A transposing copy, then an in-place multiply (reading memory
    # still in cache), is faster than one multiply reading the strided view: 2.5 ms against 4.9 ms for a
    # [2048, 2048] bf16 B on one thread of the CI machine.
    b = torch.empty((num_experts, out_features, rank), dtype=lora_b.dtype, device=lora_b.device)
    b.view(num_experts, out_features * rank).copy_(lora_b.reshape(out_features * rank, num_experts).t())
    return a, _scaled(b, scale, out=b)


def _scaled(b: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """`scale * b` in b's dtype, rounded once. For bfloat16 / float16 torch computes in float32 with the
    scalar as a float32 (its reduced-precision CPU kernels), so this equals `(b.float() * scale).to(dtype)`
    bit for bit (tests/unit/test_rollout_adapter_layout.py) in one pass instead of three."""
    return torch.mul(b, scale, out=out)


@contextmanager
def _one_thread():
    """The conversion is a few kernels per layer, each short (a few ms at most); with more threads each opens
    an OpenMP parallel region whose barrier waits for every thread, and a rollout host's cores are busy
    (vLLM's engine processes). On the 2-core CI machine the conversion takes 0.11 s on one thread; on two,
    the same when idle and 0.07 to 0.9 s while another process held one core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def peft_to_vllm(
    tensors: dict, peft_config: dict, stacked_experts: bool = False
) -> tuple[dict[str, torch.Tensor], dict]:
    """Convert a PEFT LoRA adapter to the layout vLLM loads: (tensors, adapter_config).

    `stacked_experts`: fused expert parameters keep PEFT's 3D layout and keys (two A/B pairs per experts
    module, B scaled), for an engine that converts them itself (see the module docstring): 4 tensors per MoE
    layer instead of 6 per expert.

    Keys may carry PEFT's in-memory adapter name (`lora_A.default.weight`); the output uses saved names.
    Each B gets its module's scaling folded in (computed in float32 or wider, rounded once to the input
    dtype).

    The per-expert tensors are views: of one stacked B per fused parameter, and of the input's A (gate_proj
    and up_proj of an expert share one A). Write them with `rollout.safetensors_io.write_safetensors`
    (`safetensors.torch.save_file` refuses tensors that share memory), and clone before changing one in place.
    """
    with _one_thread():
        return _peft_to_vllm(tensors, peft_config, stacked_experts)


def _peft_to_vllm(
    tensors: dict, peft_config: dict, stacked_experts: bool
) -> tuple[dict[str, torch.Tensor], dict]:
    _check_supported(peft_config)
    groups: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, value in tensors.items():
        m = _LORA_KEY.match(key)
        if m is None:
            raise AdapterLayoutError(
                f"adapter key {key!r} is not a LoRA A/B weight (embedding LoRA, biases and modules_to_save "
                "are not supported)"
            )
        depth = m["wrappers"].count(".base_layer")
        slot = groups.setdefault(m["module"], {}).setdefault(depth, {})
        slot[m["ab"]] = _to_torch(value)

    out: dict[str, torch.Tensor] = {}
    target_modules: set[str] = set()
    max_rank = 0
    for module, levels in groups.items():
        for depth, ab in levels.items():
            if set(ab) != {"A", "B"}:
                raise AdapterLayoutError(f"{module} (wrapper depth {depth}) has lora_{set(ab).pop()} only")
        fused = _fused_params_of(module, peft_config)
        if not fused:
            if len(levels) != 1 or 0 not in levels:
                raise AdapterLayoutError(
                    f"{module}: nested LoRA wrappers but target_parameters names none of it"
                )
            a, b = levels[0]["A"], levels[0]["B"]
            rank = a.shape[0]
            if b.shape[1] != rank:
                raise AdapterLayoutError(
                    f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} disagree"
                )
            out[f"{module}.lora_A.weight"] = a.contiguous()
            out[f"{module}.lora_B.weight"] = _scaled(b, _scaling(peft_config, rank))
            target_modules.add(module.rsplit(".", 1)[-1])
            max_rank = max(max_rank, rank)
            continue
        assigned = _assign_fused(module, levels, fused)
        if stacked_experts and sorted(assigned.values()) != ["down_proj", "gate_up_proj"]:
            # vLLM's 3D reader finds the pair by position (`experts.base_layer` = gate_up_proj, `experts` =
            # down_proj) and does not convert a module that has only one of them.
            raise AdapterLayoutError(
                f"{module}: the stacked expert layout needs LoRA on both gate_up_proj and down_proj, the "
                f"adapter has {sorted(assigned.values())}; ship it per expert (sync.expert_layout=per_expert)"
            )
        for depth, param in assigned.items():
            a, b = levels[depth]["A"], levels[depth]["B"]
            rank = _fused_rank(module, param, a, peft_config)
            scale = _scaling(peft_config, rank)
            if stacked_experts:
                key = f"{module}.base_layer" if param == "gate_up_proj" else module
                out[f"{key}.lora_A.weight"] = a.contiguous()
                out[f"{key}.lora_B.weight"] = _scaled(b, scale)
                target_modules.add(module.rsplit(".", 1)[-1])
                max_rank = max(max_rank, rank)
                continue
            projections = FUSED_EXPERT_PARAMS[param].projections
            if b.shape[0] % len(projections):
                raise AdapterLayoutError(
                    f"{module}.{param}: lora_B rows {b.shape[0]} do not split into {projections}"
                )
            a3, b3 = split_fused_lora(a, b, rank, scale)
            _add_expert_views(out, module, projections, a3, b3)
            target_modules.update(projections)
            max_rank = max(max_rank, rank)
    if not out:
        raise AdapterLayoutError("the adapter has no LoRA weights")
    config = {
        "peft_type": "LORA",
        "task_type": peft_config.get("task_type", "CAUSAL_LM"),
        "base_model_name_or_path": peft_config.get("base_model_name_or_path"),
        "r": max_rank,
        "lora_alpha": max_rank,  # scaling 1: each module's scaling is folded into its B
        "use_rslora": False,
        "bias": "none",
        "lora_dropout": 0.0,
        "target_modules": sorted(target_modules),
    }
    return out, config


def _add_expert_views(
    out: dict, module: str, projections: tuple[str, ...], a3: torch.Tensor, b3: torch.Tensor
) -> None:
    """Per-expert keys as views of the stacked A `[E, r, in]` and B `[E, out, r]`, no copies: expert e's A is
    a3[e] (gate and up share it), its B for projection i the i-th block of rows of b3[e].

    Insertion order follows memory: all B's (expert-major, as b3 lies), then the A's once per projection;
    `write_safetensors` then writes each stacked tensor as one buffer."""
    experts, n = a3.shape[0], len(projections)
    b_views = b3.reshape(experts * n, b3.shape[1] // n, b3.shape[2]).unbind(0)
    for e in range(experts):
        for i, proj in enumerate(projections):
            out[f"{module}.{e}.{proj}.lora_B.weight"] = b_views[e * n + i]
    a_views = a3.unbind(0)
    for proj in projections:
        for e in range(experts):
            out[f"{module}.{e}.{proj}.lora_A.weight"] = a_views[e]


def _fused_rank(module: str, param: str, lora_a: torch.Tensor, peft_config: dict) -> int:
    """The rank of a fused parameter's LoRA: `r` unless rank_pattern names it (A has r * E rows)."""
    rank = peft_config.get("r")
    unwrapped = module[len(PEFT_PREFIX) :] if module.startswith(PEFT_PREFIX) else module
    full = f"{unwrapped}.{param}"
    for pattern, r in (peft_config.get("rank_pattern") or {}).items():
        if full == pattern or full.endswith("." + pattern) or re.fullmatch(pattern, full):
            rank = r
    if not rank or lora_a.shape[0] % rank:
        raise AdapterLayoutError(f"{full}: lora_A has {lora_a.shape[0]} rows, not a multiple of rank {rank}")
    return rank


def lora_delta(tensors: dict[str, torch.Tensor], module: str, projection: str | None = None) -> torch.Tensor:
    """`B @ A` of one module of a converted (vLLM-layout) adapter: the weight delta, scaling included."""
    name = f"{module}.{projection}" if projection else module
    return tensors[f"{name}.lora_B.weight"].float() @ tensors[f"{name}.lora_A.weight"].float()


def merged_to_checkpoint(named: dict) -> dict[str, torch.Tensor]:
    """Checkpoint names for merged Hugging Face weights: fused 3D experts become per-expert 2D tensors.

    Accepts a plain state dict (`model.layers.0...`) or one still prefixed by PEFT (`base_model.model.`);
    a name with `.base_layer.` or `lora_` means the adapter was not merged, which is an error.
    """
    out: dict[str, torch.Tensor] = {}
    for name, value in named.items():
        value = _to_torch(value)
        if name.startswith(PEFT_PREFIX):
            name = name[len(PEFT_PREFIX) :]
        if ".base_layer." in name or ".lora_" in name:
            raise AdapterLayoutError(f"merged weights contain {name!r}: merge the adapter first")
        module, _, param = name.rpartition(".")
        if param in FUSED_EXPERT_PARAMS and value.ndim == 3:
            projections = FUSED_EXPERT_PARAMS[param].projections
            if value.shape[1] % len(projections):
                raise AdapterLayoutError(f"{name} {tuple(value.shape)} does not split into {projections}")
            width = value.shape[1] // len(projections)
            for e in range(value.shape[0]):
                for i, proj in enumerate(projections):
                    out[f"{module}.{e}.{proj}.weight"] = value[e, i * width : (i + 1) * width].contiguous()
        else:
            out[name] = value
    return out


def sibling_prefix(name: str) -> str:
    """The block of decoder layer a checkpoint name belongs to (`model.layers.3.self_attn.`), else itself.

    vLLM fuses a block's projections into one layer (q/k/v, gate/up, all experts) and processes that
    layer once every part has arrived; a merged update that sends only some parts must be completed with
    the others from the base checkpoint.
    """
    m = re.match(r"^(.*?\.layers\.\d+\.[^.]+\.)", name)
    return m.group(1) if m else name
