"""The LoRA adapter: which modules get one, wrapping the model with PEFT, and PEFT <-> trainer key names.

Fused MoE experts (3D parameters such as Qwen3-MoE's `mlp.experts.gate_up_proj` [E, 2I, H]) are adapted
with PEFT's `target_parameters`: per parameter one lora_A [r * E, in] (expert-major rows) and one lora_B
[out, r * E] (expert-minor columns), see `expert_slices`. Routers and norms are never targets.
"""

from __future__ import annotations

import json
import re

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn

from rl.core.model_info import is_moe
from trainer.config import LoraConfig
from trainer.lora_experts import use_grouped_expert_lora

ADAPTER_NAME = "default"
LATENT_MODULES = ("pooler", "unpooler")  # Muse Spark Open's latent MoE projections
FROZEN_MODULES = ("gate", "router")  # routers: their logits feed the routing weights but stay frozen


def _module_names(model: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}


def expert_parameter_targets(model: nn.Module) -> list[str]:
    """`<module>.experts.<param>` suffixes of the 3D (fused, per-expert stacked) expert parameters."""
    out = []
    for name, p in model.named_parameters():
        parts = name.split(".")
        if p.dim() == 3 and len(parts) >= 2 and parts[-2] == "experts":
            suffix = ".".join(parts[-3:])
            if suffix not in out:
                out.append(suffix)
    return out


def _extra_modules(model: nn.Module, pattern: str) -> list[str]:
    """Full names of the modules `pattern` matches in full (re.fullmatch, as lora.extra documents)."""
    names = [name for name, _ in model.named_modules() if name and re.fullmatch(pattern, name)]
    if not names:
        raise ValueError(f"lora.extra: {pattern!r} matches no module name of {type(model).__name__}")
    routers = [n for n in names if n.rsplit(".", 1)[-1] in FROZEN_MODULES]
    if routers:
        raise ValueError(f"lora.extra: {pattern!r} matches the router {routers[0]!r}; routers stay frozen")
    return names


def lora_config(model: nn.Module, lora: LoraConfig, init_lora_weights: bool = True) -> PeftLoraConfig:
    """PEFT's config for exactly the `lora:` section's targets: each of target_modules (a last path
    component) wherever the model has it, the latent projections, the full names `extra` matches, and the
    fused experts.
    init_lora_weights=False draws B at random too (PEFT's meaning): tests use it so that gradients
    reach A; training starts from PEFT's default, B = 0 (the adapter is a no-op at step 0)."""
    present = _module_names(model)
    modules: list[str] = []
    for m in lora.target_modules:
        if m in FROZEN_MODULES:
            raise ValueError(f"lora.target_modules: {m!r} is a router; routers stay frozen")
        if m not in present:
            raise ValueError(f"lora.target_modules: the model has no module named {m!r}")
        if m not in modules:
            modules.append(m)
    if lora.target_latent:
        modules += [m for m in LATENT_MODULES if m in present and m not in modules]
    if lora.extra:
        # Full names: PEFT matches a listed name as the whole module name or its last components.
        modules += [m for m in _extra_modules(model, lora.extra) if m not in modules]
    params = expert_parameter_targets(model) if lora.target_experts else []
    # A dense model has no experts to target (nothing to do); a MoE model whose experts are not found is an error.
    if lora.target_experts and not params and is_moe(model.config.to_dict()):
        raise ValueError(
            f"lora.target_experts: true, but {type(model).__name__} has no fused expert parameters"
        )
    if params and lora.dropout:
        raise ValueError("lora.dropout must be 0 with expert targets (PEFT cannot apply dropout to them)")
    if not modules and not params:
        raise ValueError(
            "lora: no target modules or parameters; set target_modules, target_experts, target_latent or extra"
        )
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=modules or None,
        target_parameters=params or None,
        init_lora_weights=init_lora_weights,
        bias="none",
    )


def apply_lora(
    model: nn.Module,
    lora: LoraConfig,
    seed: int,
    init_lora_weights: bool = True,
    grouped_experts: bool = True,
) -> nn.Module:
    """PEFT-wrap `model` (every base weight frozen). The LoRA weights are drawn from `seed` (every rank
    and a single-process reference draw the same ones) and held in fp32 whatever the base dtype.
    grouped_experts: run expert LoRA as grouped matmuls beside the frozen experts (trainer/lora_experts.py)
    instead of PEFT's re-parametrised weights; same function and parameters, cheaper to train."""
    config = lora_config(model, lora, init_lora_weights)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, config, adapter_name=ADAPTER_NAME)
        # Draw the LoRA weights once more, on CPU and in module order, with PEFT's own initialiser: the
        # values then do not depend on where the base weights are. On the meta device (the sharded
        # trainer, trainer/sharded_load.py) PEFT's first draw followed the base weights to meta and was lost.
        torch.manual_seed(seed)
        for module in peft_model.modules():
            if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A:
                for part in (module.lora_A[ADAPTER_NAME], module.lora_B[ADAPTER_NAME]):
                    if any(p.is_meta for p in part.parameters()):
                        part.to_empty(device="cpu")
                    part.reset_parameters()  # nn.Linear's init: what init_lora_weights=False keeps
                module.reset_lora_parameters(ADAPTER_NAME, init_lora_weights)
    for p in peft_model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    if grouped_experts:
        use_grouped_expert_lora(peft_model)
    return peft_model


def peft_config_dict(model: nn.Module, base_model_path: str) -> dict:
    """adapter_config.json contents (JSON types only: PEFT keeps target sets as Python sets)."""
    cfg = model.peft_config[ADAPTER_NAME].to_dict()
    cfg["base_model_name_or_path"] = base_model_path
    return json.loads(json.dumps(cfg, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


# The segment activation checkpointing's wrapper adds to every name below it (trainer/parallelize.py).
CHECKPOINT_WRAPPER = "._checkpoint_wrapped_module"


def unwrapped_name(name: str) -> str:
    """A parameter's name without activation checkpointing's wrapper segment (the PEFT model's name)."""
    return name.replace(CHECKPOINT_WRAPPER, "")


def base_name(fqn: str) -> str:
    """A PEFT model's parameter name -> the wrapped model's own (PEFT's prefix and base_layer hops off)."""
    return fqn.removeprefix("base_model.model.").replace(".base_layer", "")


def peft_key(fqn: str) -> str:
    """Trainer parameter name -> the adapter file's key (PEFT drops the adapter name)."""
    return fqn.replace(f".{ADAPTER_NAME}.", ".")


def expert_slices(name: str, num_experts: int, rank: int, expert: int):
    """Index of expert `expert`'s rows (lora_A [r * E, in]) or columns (lora_B [out, r * E])."""
    if ".lora_A." in name:
        return (slice(expert * rank, (expert + 1) * rank),)
    if ".lora_B." in name:
        return (slice(None), slice(expert, None, num_experts))
    raise ValueError(f"{name} is not a LoRA A/B weight")


def check_adapter(expected: dict[str, tuple[int, ...]], given: dict[str, torch.Tensor], where: str) -> None:
    """An adapter file must have exactly the model's LoRA keys with the same shapes."""
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    wrong = sorted(k for k in set(expected) & set(given) if tuple(given[k].shape) != tuple(expected[k]))
    if missing or unexpected or wrong:
        lines = [f"{where}: the adapter does not match the model"]
        if missing:
            lines.append(f"  missing {len(missing)} keys, e.g. {missing[:3]}")
        if unexpected:
            lines.append(f"  {len(unexpected)} unexpected keys, e.g. {unexpected[:3]}")
        for k in wrong[:3]:
            lines.append(f"  {k}: shape {tuple(given[k].shape)}, the model has {tuple(expected[k])}")
        raise ValueError("\n".join(lines))


# ----------------------------------------------------------------------------------------------------
# Merging (sync.mode merged): W + scaling * B @ A, per expert for the fused expert parameters.


def lora_layout(model: nn.Module) -> list[dict]:
    """Where each LoRA layer of a PEFT model sits and how to merge it (names as the state-dict API
    spells them: no activation-checkpointing wrapper prefix)."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    out = []
    for name, m in model.named_modules():
        if not isinstance(m, LoraLayer) or ADAPTER_NAME not in m.lora_A:
            continue
        entry = {"prefix": unwrapped_name(name), "scaling": m.scaling[ADAPTER_NAME]}
        if isinstance(m, ParamWrapper):
            # Several parameters of one module nest their wrappers: count the base_layer hops.
            depth, base = 1, m.base_layer
            while isinstance(base, ParamWrapper):
                depth, base = depth + 1, base.base_layer
            entry.update(
                param=m.parameter_name,
                experts=m.num_experts,
                swapped=m._did_swap_in_out_features,
                depth=depth,
            )
        out.append(entry)
    return out


def merge_lora(full: dict[str, torch.Tensor], layout: list[dict]) -> dict[str, torch.Tensor]:
    """A PEFT model's full state dict -> the base model's state dict (in-memory names) with every LoRA
    update merged, in the base weights' dtype (the sum is formed in fp64)."""
    full = dict(full)
    for layer in layout:
        pre = layer["prefix"]
        A = full.pop(f"{pre}.lora_A.{ADAPTER_NAME}.weight").double()
        B = full.pop(f"{pre}.lora_B.{ADAPTER_NAME}.weight").double()
        if "param" not in layer:
            key, delta = f"{pre}.base_layer.weight", B @ A
        else:
            key = pre + ".base_layer" * layer["depth"] + "." + layer["param"]
            E = layer["experts"]
            A3 = A.reshape(E, -1, A.shape[-1])  # experts, rank, in
            B3 = B.reshape(B.shape[0], -1, E)  # out, rank, experts (PEFT's expert-minor columns)
            delta = torch.einsum("ore,eri->eoi" if layer["swapped"] else "ore,eri->eio", B3, A3)
        w = full[key]
        full[key] = (w.double() + layer["scaling"] * delta).to(w.dtype)
    return {base_name(k): v for k, v in full.items()}
