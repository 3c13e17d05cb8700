"""Expert parallelism (`trainer.expert_parallel_size` = EP > 1): who holds which expert, how tokens reach
their experts, and how the expert shards become the whole model again for an export.

The ranks form a (dp, ep) mesh of num_ranks / EP x EP (trainer/parallelize.py, `make_meshes`): rank r is
ep index r % EP of EP group r // EP, so an EP group is EP consecutive ranks (one node: the trainer ranks are
placed node by node). In every MoE layer the EP rank e holds the experts [e * E / EP, (e + 1) * E / EP):
their frozen bank (BF16 or NVFP4-packed) and their LoRA A/B, laid out as PEFT lays out a layer of E / EP
experts. Those are FSDP-sharded over the dp sub-mesh (the ranks with the same ep index hold the same
experts; their gradients are summed there, never across EP); attention, the router, norms, latent
projections and embeddings are sharded over all ranks as without EP.

The MoE block calls its experts module as `experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`
(transformers' fused experts, with or without PEFT's wrappers). `shard_experts` gives that module a forward
that sends each (token, slot) pair, with its routing weight, to the rank that owns its expert (one
`all_to_all_single` over the EP group, differentiable: its backward is the reverse exchange), runs the
module's own forward on the received rows as tokens routed to one local expert each (weight times expert
output), sends the rows back and sums each token's k slots in expert order (the order in which the
one-rank loop over experts adds them). The routing is whatever the router returned, so R3's replayed ids
when replaying.

Exports (`ExpertShards.to_global`): the EP ranks' shards are gathered (only the LoRA; the frozen bank only
for a merged export) and put at their global expert ids, so an adapter or a checkpoint has PEFT's layout of
all E experts whatever EP was; `to_local` takes a rank's experts back out of such a file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from rl.core.model_info import num_experts as config_expert_count
from trainer.lora_experts import wrapper_chain

# What an expert-sharded parameter is, for putting its shards together: a bank or a LoRA A
# ([r * E, in], expert-major rows) joins on dim 0; a LoRA B ([out, r * E], expert-minor columns) interleaves.
ROWS, LORA_B = "rows", "lora_b"


def model_expert_count(model: nn.Module) -> int:
    """Routed experts per MoE layer of a transformers model (0 for a dense one)."""
    config = model.config.to_dict()
    return max(config_expert_count(config), config_expert_count(config.get("text_config") or {}))


def check_expert_parallel(ep_size: int, world_size: int, experts: int) -> None:
    """EP must divide the trainer ranks and the experts of a MoE model."""
    if ep_size == 1:
        return
    if world_size % ep_size:
        raise ValueError(f"trainer.expert_parallel_size={ep_size} must divide trainer.num_ranks={world_size}")
    if experts == 0:
        raise ValueError(
            f"trainer.expert_parallel_size={ep_size}: the model (model.path) is dense; expert parallelism "
            "needs a mixture-of-experts model (set trainer.expert_parallel_size=1)"
        )
    if experts % ep_size:
        raise ValueError(
            f"trainer.expert_parallel_size={ep_size} must divide the model's expert count ({experts} routed "
            "experts a layer, model.path)"
        )


class _AllToAll(torch.autograd.Function):
    """Rows exchanged over `group`: `send[i]` rows of each tensor to rank i, `recv[i]` rows from it; several
    tensors with the same rows go as one block of bytes (any dtype on any backend: gloo has no bf16 or
    float8 all-to-all). Backward exchanges the gradients of the floating-point ones back, zeros standing in
    for a gradient autograd does not have: one collective each way, on every rank alike."""

    @staticmethod
    def forward(ctx, send: list[int], recv: list[int], group, *tensors):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        ctx.meta = [(t.shape[1:], t.dtype) for t in tensors]
        ctx.device = tensors[0].device
        out = _exchange(tensors, send, recv, group)
        ctx.mark_non_differentiable(*[o for o in out if not o.is_floating_point()])
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        rows = sum(ctx.recv)
        floats = [i for i, (_, dtype) in enumerate(ctx.meta) if dtype.is_floating_point]
        sent = [
            grads[i]
            if grads[i] is not None
            else torch.zeros((rows, *ctx.meta[i][0]), dtype=ctx.meta[i][1], device=ctx.device)
            for i in floats
        ]
        back = _exchange(sent, ctx.recv, ctx.send, ctx.group)
        out = [None] * len(ctx.meta)
        for i, g in zip(floats, back):
            out[i] = g
        return (None, None, None, *out)


def _exchange(tensors, send: list[int], recv: list[int], group) -> list[torch.Tensor]:
    sent, received = sum(send), sum(recv)
    widths = [math.prod(t.shape[1:]) * t.element_size() for t in tensors]  # bytes a row
    block = torch.empty((sent, sum(widths)), dtype=torch.uint8, device=tensors[0].device)
    start = 0
    for t, w in zip(tensors, widths):
        if not t.is_contiguous() or t.stride(-1) != 1:  # (an expanded gradient of one row is "contiguous")
            t = torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)
        block[:, start : start + w] = t.view(torch.uint8).reshape(sent, w)
        start += w
    out = block.new_empty((received, sum(widths)))
    dist.all_to_all_single(out, block, recv, send, group=group)
    parts, start = [], 0
    for t, w in zip(tensors, widths):
        # a copy of its own: a view of the block may start at an offset the dtype's size does not divide
        part = torch.empty((received, w), dtype=torch.uint8, device=out.device).copy_(
            out[:, start : start + w]
        )
        parts.append(part.view(t.dtype).reshape(received, *t.shape[1:]))
        start += w
    return parts


def all_to_all(tensors, send: list[int], recv: list[int], group) -> list[torch.Tensor]:
    """The rows of `tensors` (same row count) exchanged over `group` (see _AllToAll); differentiable."""
    return list(_AllToAll.apply(send, recv, group, *tensors))


class _Tie(torch.autograd.Function):
    """y as it is, made to depend on `others` too (zero gradients): every rank of an EP group then runs the
    same exchanges in backward, and every trainable parameter gets a gradient for FSDP to reduce, whether
    or not any row reached this rank's experts."""

    @staticmethod
    def forward(ctx, y, *others):
        ctx.meta = [(o.shape, o.dtype, o.device) for o in others]
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        zeros = [
            torch.zeros(shape, dtype=dtype, device=device) if need else None
            for (shape, dtype, device), need in zip(ctx.meta, ctx.needs_input_grad[1:])
        ]
        return (grad, *zeros)


class ExpertParallel:
    """Mixed into the class of the module a MoE block calls as its experts (`shard_experts`): dispatch to the
    experts' owners, the module's own forward on the local experts, combine."""

    sparkrl_ep: ExpertShards

    # Eager inside a compiled decoder layer: the exchange sizes are data (a host sync) and the collectives
    # take Python lists; the layer's graph breaks here instead of tracing them.
    @torch.compiler.disable
    def forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        ep = self.sparkrl_ep
        tokens, k = top_k_index.shape
        ids = top_k_index.reshape(-1)
        # (token, slot) pairs grouped by expert, so by the rank that owns it (ranks hold consecutive experts)
        order = torch.sort(ids, stable=True).indices
        send_counts = torch.bincount(ids // ep.local, minlength=ep.size)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=ep.group)
        send, recv = send_counts.tolist(), recv_counts.tolist()

        x, w, expert = all_to_all(
            (hidden_states[order // k], top_k_weights.reshape(-1, 1)[order], ids[order, None]),
            send,
            recv,
            ep.group,
        )
        # each received row as a token routed to one local expert: weight * expert(row)
        y = super().forward(x, expert - ep.first, w, *args, **kwargs)
        if torch.is_grad_enabled():
            trainable = [p for p in self.parameters() if p.requires_grad]
            y = _Tie.apply(y, x, w, *trainable)
        (y,) = all_to_all((y,), recv, send, ep.group)  # back, in `order`

        slots = torch.empty_like(order)
        slots[order] = torch.arange(order.numel(), device=order.device)
        y = y[slots].view(tokens, k, -1)  # (token, slot) order
        by_expert = torch.sort(top_k_index, dim=1, stable=True).indices
        y = y.gather(1, by_expert[..., None].expand(-1, -1, y.shape[-1]))
        out = y[:, 0]
        for j in range(1, k):
            out = out + y[:, j]
        return out.to(hidden_states.dtype)


def _ep_class(cls: type) -> type:
    if issubclass(cls, ExpertParallel):
        return cls
    return type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {"__module__": __name__})


def expert_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each module a MoE block calls as its experts: the outermost module at a path
    ending in `.experts` (PEFT's outer wrapper where the experts are adapted) that holds 3-D parameters."""
    out = []
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] == "experts" and any(p.dim() == 3 for p in m.parameters()):
            out.append((name, m))
    return out


@dataclass
class ExpertShards:
    """This rank's place in expert parallelism and what `shard_experts` sharded: `kinds` maps each
    expert-sharded parameter (its name as the state-dict API spells it) to ROWS or LORA_B."""

    size: int  # EP
    rank: int  # this rank's index in its EP group
    num_experts: int  # routed experts a layer, in the whole model
    group: object = None  # the EP group (a ProcessGroup)
    kinds: dict[str, str] = field(default_factory=dict)

    @property
    def local(self) -> int:
        return self.num_experts // self.size

    @property
    def first(self) -> int:
        """The global id of this rank's first expert."""
        return self.rank * self.local

    def is_expert(self, name: str) -> bool:
        return name in self.kinds

    def global_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The whole model's shape of a parameter of (unsharded-by-FSDP) local `shape`."""
        kind = self.kinds.get(name)
        if kind is None:
            return tuple(shape)
        if kind == LORA_B:
            return (shape[0], shape[1] * self.size, *shape[2:])
        return (shape[0] * self.size, *shape[1:])

    def to_local(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a whole-model tensor (a parameter's or its optimizer state's)."""
        kind = self.kinds.get(name)
        if kind is None:
            return full
        if kind == LORA_B:
            out, cols = full.shape
            r = cols // self.num_experts
            local = full.reshape(out, r, self.num_experts)[:, :, self.first : self.first + self.local]
            return local.reshape(out, r * self.local).contiguous()
        per_expert = full.shape[0] // self.num_experts  # LoRA A: rank rows an expert; a bank: 1
        return full[self.first * per_expert : (self.first + self.local) * per_expert].contiguous()

    def to_global(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The whole model's tensor from every EP rank's `local` (FSDP-unsharded) tensor. Collective over
        the EP group: every rank calls it for the same names in the same order."""
        kind = self.kinds.get(name)
        if kind is None:
            return local
        flat = local.detach().contiguous().view(torch.uint8).reshape(-1)
        gathered = flat.new_empty((self.size * flat.numel(),))
        dist.all_gather_into_tensor(gathered, flat, group=self.group)
        parts = [g.view(local.dtype).reshape(local.shape) for g in gathered.view(self.size, -1)]
        if kind == LORA_B:
            out, cols = local.shape
            r = cols // self.local
            return torch.cat([p.reshape(out, r, self.local) for p in parts], dim=2).reshape(out, -1)
        return torch.cat(parts, dim=0)

    def globalize(self, state: dict[str, torch.Tensor], keep: bool) -> dict[str, torch.Tensor]:
        """to_global of every entry of a (FSDP-full) state dict, in sorted name order; CPU copies where
        `keep`, else {}. Collective over the EP group."""
        out = {}
        for name in sorted(state):
            t = self.to_global(name, state[name])
            if keep:
                out[name] = t.cpu() if t.device.type != "cpu" else t.clone()
        return out

    def globalize_optimizer(self, optim: dict, keep: bool) -> dict:
        """A full optimizer state dict (get_optimizer_state_dict's, FSDP-unsharded) with each expert-sharded
        parameter's state (shaped like it) put together as `to_global` does; on `keep` ranks, else {}.
        Collective over the EP group."""
        state = {}
        for name in sorted(optim["state"]):
            entry = {}
            for key in sorted(optim["state"][name]):
                v = optim["state"][name][key]
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    v = self.to_global(name, v)
                if keep:
                    entry[key] = v.cpu() if isinstance(v, torch.Tensor) and v.device.type != "cpu" else v
            state[name] = entry
        return {"state": state, "param_groups": optim["param_groups"]} if keep else {}

    def localize_optimizer(self, optim: dict) -> dict:
        """This rank's experts of a whole-model optimizer state dict (`globalize_optimizer`'s)."""
        state = {
            name: {
                k: self.to_local(name, v) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                for k, v in entry.items()
            }
            for name, entry in optim["state"].items()
        }
        return {"state": state, "param_groups": optim["param_groups"]}

    def global_layout(self, layout: list[dict]) -> list[dict]:
        """lora.lora_layout entries with the whole model's expert count (a merge of the whole model)."""
        return [
            {**e, "experts": self.num_experts} if e.get("experts") == self.local and "param" in e else e
            for e in layout
        ]


def _narrow_parameter(module: nn.Module, name: str, index) -> None:
    """module.<name> replaced by a parameter holding p[index] (real values kept; meta stays meta)."""
    p = module._parameters[name]
    value = p.detach()[index]
    value = torch.empty_like(value) if value.is_meta else value.clone().contiguous()
    module._parameters[name] = nn.Parameter(value, requires_grad=p.requires_grad)


def shard_experts(model: nn.Module, shards: ExpertShards) -> list[nn.Module]:
    """Keep this rank's experts of every MoE layer: each unit's 3-D bank parameters and its LoRA A/B narrowed
    to `shards.first` .. + `shards.local` (PEFT's layout of a layer of that many experts), the experts
    count set to match, and the dispatch/combine forward installed. Fills `shards.kinds` (names as
    `model.named_parameters()` gives them: call before activation checkpointing wraps the layers)."""
    from trainer.lora import unwrapped_name

    E, L, first = shards.num_experts, shards.local, shards.first
    units = expert_units(model)
    if not units:
        raise ValueError(
            f"trainer.expert_parallel_size={shards.size}: {type(model).__name__} has no fused experts "
            "module (a `.experts` module with 3-D parameters) to shard"
        )
    for unit_name, unit in units:
        chain, experts = wrapper_chain(unit)
        for wrapper in chain:
            for adapter in list(wrapper.lora_A):
                a, b = wrapper.lora_A[adapter], wrapper.lora_B[adapter]
                r = a.weight.shape[0] // E
                _narrow_parameter(a, "weight", slice(first * r, (first + L) * r))
                out = b.weight.shape[0]
                cols = torch.arange(r * E).reshape(r, E)[:, first : first + L].reshape(-1)
                _narrow_parameter(b, "weight", (slice(None), cols))
                if b.weight.shape != (out, r * L):
                    raise RuntimeError(f"{unit_name}: LoRA B narrowed to {tuple(b.weight.shape)}")
                a.out_features, b.in_features = r * L, r * L
            wrapper.num_experts = L
        for pname, p in list(experts.named_parameters(recurse=False)):
            if p.dim() == 3:
                if p.shape[0] != E:
                    raise ValueError(f"{unit_name}.{pname}: {p.shape[0]} experts, the config says {E}")
                _narrow_parameter(experts, pname, slice(first, first + L))
        if hasattr(experts, "num_experts"):
            experts.num_experts = L
        for pname, p in unit.named_parameters(prefix=unit_name):
            kind = LORA_B if ".lora_B." in pname else ROWS
            if p.dim() == 3 or p.requires_grad:
                shards.kinds[unwrapped_name(pname)] = kind
        unit.sparkrl_ep = shards
        unit.__class__ = _ep_class(type(unit))
    return [u for _, u in units]


def ep_units(module: nn.Module) -> list[nn.Module]:
    """The expert-parallel units under `module` (after `shard_experts`)."""
    return [m for m in module.modules() if isinstance(m, ExpertParallel)]
