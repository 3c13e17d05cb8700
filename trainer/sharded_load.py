"""Loading the frozen base weights shard by shard: every rank reads only the rows it keeps.

The trainer builds the model with its parameters on the meta device (accelerate's `init_empty_weights`,
buffers stay real), wraps it with PEFT and FSDP2 there, and only then allocates its own shard of every
parameter and fills it from the safetensors files (`get_slice`, memory-mapped). Peak host memory per rank
is its shard, not the model: an 816B checkpoint never sits whole in one process, and no rank broadcasts.

FSDP2 shards every parameter on dim 0 (torch.chunk's split: ceil(N / world) rows per rank, the last ranks
may get fewer or none). Fused MoE experts (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]
in transformers 5) are stored per expert on disk; dim 0 is the expert, so a rank reads only its experts'
`gate_proj`/`up_proj`/`down_proj` and fuses them as transformers' own conversion does (gate then up).

With `trainer.base_format=nvfp4` the weights an NVFP4 checkpoint holds packed stay packed
(`pack_frozen_weights` makes them trainer/nvfp4_tensor.py's `NVFP4Weight` before FSDP shards them): a rank
reads its rows of `weight_packed`, `weight_scale` and `weight_global_scale`, fused the same way.

With expert parallelism (trainer/expert_parallel.py) a rank's expert banks are its EP rank's experts only,
FSDP-sharded over the ranks holding the same experts: its rows are read at their global expert ids
(`experts`, the `ExpertShards` of the rank), and their LoRA, held aside already narrowed, as it is.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from trainer.expert_parallel import ExpertShards
from trainer.lora import base_name, unwrapped_name
from trainer.nvfp4_tensor import NVFP4Weight

_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.down_proj\.weight(_packed)?$")
_FUSED_EXPERTS = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<param>gate_up_proj|down_proj)$")
_PACKED_KEYS = ("weight_packed", "weight_scale", "weight_global_scale")


def build_empty_model(path: str, dtype: torch.dtype, trust_remote_code: bool = False) -> nn.Module:
    """The causal LM of `path` with every parameter on the meta device and real buffers (rotary tables)."""
    from accelerate import init_empty_weights

    from rl.models import auto_causal_lm, auto_config

    config = auto_config(path, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = auto_causal_lm().from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    return model


def checkpoint_name(name: str) -> str:
    """A wrapped model's parameter name -> the name transformers gives it (the checkpoint's)."""
    return base_name(unwrapped_name(name))


def hold_aside(model: nn.Module) -> dict[str, torch.Tensor]:
    """Moves `model` wholly to the meta device, returning the values it held that are not on meta (the
    LoRA weights, the buffers) by unwrapped name, for `materialize` to put back into the shards."""
    kept = {
        unwrapped_name(n): t.detach().clone()
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if not t.is_meta
    }
    model.to("meta")
    return kept


class CheckpointRows:
    """Row ranges of a safetensors checkpoint's tensors, read without loading whole files."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"{self.path}: no *.safetensors files and no index to load weights from"
                )
            weight_map = {}
            for f in files:
                with safe_open(f, "pt") as s:
                    weight_map.update(dict.fromkeys(s.keys(), f.name))
        self.weight_map: dict[str, str] = weight_map
        # Per-expert tensors on disk: how many experts each `...experts` prefix has (one pass over the keys).
        self._experts: dict[str, int] = {}
        for key in weight_map:
            m = _PER_EXPERT.match(key)
            if m:
                self._experts[m["prefix"]] = max(self._experts.get(m["prefix"], 0), int(m["expert"]) + 1)
        self._stack = ExitStack()
        self._open: dict[str, object] = {}
        self.bytes_read = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._stack.close()

    def _slice(self, name: str):
        file = self.weight_map[name]
        if file not in self._open:
            self._open[file] = self._stack.enter_context(safe_open(self.path / file, "pt"))
        return self._open[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        m = _FUSED_EXPERTS.match(name)
        if name in self.weight_map:
            return tuple(self._slice(name).get_shape())
        if m and f"{m['prefix']}.0.down_proj.weight" in self.weight_map:
            n = self._experts[m["prefix"]]
            if m["param"] == "down_proj":
                return (n, *self._slice(f"{m['prefix']}.0.down_proj.weight").get_shape())
            gate = self._slice(f"{m['prefix']}.0.gate_proj.weight").get_shape()
            return (n, 2 * gate[0], gate[1])
        raise self._missing(name)

    def _missing(self, name: str) -> KeyError:
        return KeyError(
            f"{self.path}: the checkpoint has no tensor for the model's parameter {name!r} "
            f"(and no per-expert tensors to fuse it from)"
        )

    def _packed_source(self, name: str) -> tuple[str, str] | None:
        """(module prefix of the packed triple, fused-expert param or '') for a model parameter name that
        the checkpoint holds in NVFP4; None for one it holds unquantized."""
        if name.endswith(".weight") and f"{name[: -len('.weight')]}.weight_packed" in self.weight_map:
            return name[: -len(".weight")], ""
        m = _FUSED_EXPERTS.match(name)
        if m and f"{m['prefix']}.0.down_proj.weight_packed" in self.weight_map:
            return m["prefix"], m["param"]
        return None

    def is_packed(self, name: str) -> bool:
        return self._packed_source(name) is not None

    def packed_shape(self, name: str) -> tuple[int, ...]:
        """The dequantized shape of a parameter the checkpoint holds packed."""
        module, param = self._packed_source(name)
        if not param:
            rows, half = self._slice(f"{module}.weight_packed").get_shape()
            return (rows, 2 * half)
        n = self._experts[module]
        if param == "down_proj":
            rows, half = self._slice(f"{module}.0.down_proj.weight_packed").get_shape()
            return (n, rows, 2 * half)
        rows, half = self._slice(f"{module}.0.gate_proj.weight_packed").get_shape()
        return (n, 2 * rows, 2 * half)

    def packed_rows(self, name: str, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Rows [start, stop) on dim 0 (experts for a fused bank) of the packed triple of parameter `name`:
        {"packed", "scale", "global_scale"}; a bank's global scale is one an expert (its gate and up
        projections share it: one fused group, trainer/nvfp4.py)."""
        module, param = self._packed_source(name)
        if not param:
            out = {
                "packed": self._slice(f"{module}.weight_packed")[start:stop],
                "scale": self._slice(f"{module}.weight_scale")[start:stop],
                "global_scale": self._slice(f"{module}.weight_global_scale")[:],
            }
        else:
            parts = ("down_proj",) if param == "down_proj" else ("gate_proj", "up_proj")
            packed, scale, global_scale = [], [], []
            for e in range(start, stop):
                triple = [{k: self._slice(f"{module}.{e}.{p}.{k}")[:] for k in _PACKED_KEYS} for p in parts]
                scales = [t["weight_global_scale"] for t in triple]
                if any(not torch.equal(scales[0], g) for g in scales[1:]):
                    raise ValueError(
                        f"{self.path}: {module}.{e}: gate_proj and up_proj have different "
                        "weight_global_scale; one fused weight needs one (requantize with sparkrl quantize)"
                    )
                packed.append(torch.cat([t["weight_packed"] for t in triple]))
                scale.append(torch.cat([t["weight_scale"] for t in triple]))
                global_scale.append(scales[0].reshape(1))
            out = {
                "packed": torch.stack(packed),
                "scale": torch.stack(scale),
                "global_scale": torch.cat(global_scale),
            }
        self.bytes_read += sum(t.numel() * t.element_size() for t in out.values())
        return out

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) on dim 0 of the model's tensor `name` (a transformers parameter name)."""
        out = self._rows(name, start, stop)
        self.bytes_read += out.numel() * out.element_size()
        return out

    def _rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        if name in self.weight_map:
            sl = self._slice(name)
            return sl[start:stop] if sl.get_shape() else sl[:]
        m = _FUSED_EXPERTS.match(name)
        if m is None:
            raise self._missing(name)
        prefix = m["prefix"]
        if m["param"] == "down_proj":
            experts = [self._slice(f"{prefix}.{e}.down_proj.weight")[:] for e in range(start, stop)]
        else:
            experts = [
                torch.cat(
                    [
                        self._slice(f"{prefix}.{e}.gate_proj.weight")[:],
                        self._slice(f"{prefix}.{e}.up_proj.weight")[:],
                    ]
                )
                for e in range(start, stop)
            ]
        if not experts:
            return torch.empty(
                (0, *self.shape(name)[1:]),
                dtype=self._slice(f"{prefix}.0.down_proj.weight").get_dtype_torch(),
            )
        return torch.stack(experts)


def pack_frozen_weights(
    model: nn.Module, path: str | Path, world_size: int, experts: ExpertShards | None = None
) -> list[str]:
    """Replaces every (meta, frozen) parameter that the NVFP4 checkpoint at `path` holds packed by an
    `NVFP4Weight` of the same shape and dtype, before FSDP shards it; returns their checkpoint names.
    FSDP's all-gather extension takes even shards only: a row count world_size does not divide fails here.
    experts: with expert parallelism, this rank's expert banks are sharded over world_size / EP ranks."""
    names = []
    with CheckpointRows(path) as ckpt:
        index = {id(m): n for n, m in model.named_modules()}
        for module in list(model.modules()):
            for pname, p in list(module.named_parameters(recurse=False)):
                full = f"{index[id(module)]}.{pname}".lstrip(".")
                source = checkpoint_name(full)
                if not ckpt.is_packed(source):
                    continue
                if p.requires_grad:
                    raise ValueError(f"{full}: a trainable parameter cannot stay packed in NVFP4")
                have, want = ckpt.packed_shape(source), tuple(p.shape)
                ranks = world_size
                if experts is not None and experts.is_expert(full):
                    want, ranks = experts.global_shape(full, want), world_size // experts.size
                if have != want:
                    raise ValueError(
                        f"{path}: {source} has shape {list(have)}, the model expects {list(want)}"
                    )
                if p.shape[0] % ranks:
                    raise ValueError(
                        f"trainer.base_format=nvfp4: {source} has {p.shape[0]} rows on dim 0, which "
                        f"{ranks} trainer ranks do not divide evenly (FSDP's all-gather extension "
                        "needs even shards); use trainer.base_format=bf16 or a rank count that divides it"
                    )
                packed = NVFP4Weight.empty(tuple(p.shape), p.dtype, p.device)
                module._parameters[pname] = nn.Parameter(packed, requires_grad=False)
                names.append(source)
    return names


def _local_rows(param: torch.Tensor) -> tuple[int, int]:
    """[start, stop) of the global dim-0 rows this rank holds of an FSDP2 (Shard(0)) parameter."""
    if not isinstance(param, DTensor):
        return 0, param.shape[0] if param.dim() else 0
    if any(not isinstance(p, Shard) or p.dim != 0 for p in param.placements):
        raise ValueError(f"sharded load expects FSDP2's Shard(0) placement, got {param.placements}")
    world, rank = param.device_mesh.size(), param.device_mesh.get_local_rank()
    n = param.shape[0]
    chunk = -(-n // world)
    start = min(rank * chunk, n)
    return start, min(start + chunk, n)


@torch.no_grad()
def materialize(
    model: nn.Module,
    path: str | Path,
    device: torch.device,
    kept: dict[str, torch.Tensor],
    experts: ExpertShards | None = None,
) -> int:
    """Allocates this rank's shard of every (meta) parameter on `device` and fills it: from `kept` (what
    `hold_aside` took: LoRA weights, buffers) or else from the checkpoint at `path`; experts: with expert
    parallelism, where this rank's experts sit among the checkpoint's.
    Returns the bytes this rank read from the checkpoint."""
    model.to_empty(device=device)
    with CheckpointRows(path) as ckpt:
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            start, stop = _local_rows(param)
            held = kept.get(unwrapped_name(name))
            want = tuple(param.shape)
            offset = 0  # a bank's first global expert on this rank (expert parallelism)
            if experts is not None and experts.is_expert(unwrapped_name(name)):
                want = experts.global_shape(unwrapped_name(name), want)
                offset = experts.first
            if isinstance(local, NVFP4Weight):
                if local.shape[0] != stop - start:
                    raise RuntimeError(f"{name}: local shard {tuple(local.shape)}, rows {start}:{stop}")
                triple = ckpt.packed_rows(checkpoint_name(name), offset + start, offset + stop)
                for key, t in triple.items():
                    getattr(local, key).copy_(t)
                continue
            if held is not None:
                value = held[start:stop] if param.dim() else held
            else:
                source = checkpoint_name(name)
                have = ckpt.shape(source)
                if have != want:
                    raise ValueError(
                        f"{path}: {source} has shape {list(have)}, the model expects {list(want)}"
                    )
                value = ckpt.rows(source, offset + start, offset + stop)
            if tuple(value.shape) != tuple(local.shape):
                raise RuntimeError(
                    f"{name}: local shard {tuple(local.shape)} but {tuple(value.shape)} was read"
                )
            local.copy_(value)
        for name, buf in model.named_buffers():
            source = checkpoint_name(name)
            held = kept.get(unwrapped_name(name))
            if source in ckpt.weight_map:  # a persistent buffer saved with the model
                buf.copy_(ckpt.rows(source, 0, buf.shape[0] if buf.dim() else 0))
            elif held is not None:
                buf.copy_(held)
            else:
                raise RuntimeError(f"buffer {name}: not in {path} and no value held aside")
        return ckpt.bytes_read


def frozen_base_bytes(model: nn.Module, nvfp4_path: str | Path) -> int:
    """This rank's resident bytes of the parameters that the checkpoint at `nvfp4_path` holds in NVFP4:
    their packed shards (`NVFP4Weight`), or their dequantized shards when the trainer holds the twin.
    0 when `nvfp4_path` is not an NVFP4 checkpoint."""
    from trainer.nvfp4 import is_nvfp4_checkpoint

    if not is_nvfp4_checkpoint(nvfp4_path):
        return 0
    total = 0
    with CheckpointRows(nvfp4_path) as ckpt:
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            if isinstance(local, NVFP4Weight):
                total += local.nbytes_packed()
            elif ckpt.is_packed(checkpoint_name(name)):
                total += local.numel() * local.element_size()
    return total
