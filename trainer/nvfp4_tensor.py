"""A frozen NVFP4 weight held packed in the trainer, and sharded so by FSDP2 (`trainer.base_format=nvfp4`).

`NVFP4Weight` is a tensor subclass standing for the dequantized weight ([out, in] for a Linear, [E, out, in]
for a fused expert bank) while holding what the checkpoint holds: `packed` uint8 [..., in / 2] (two E2M1
codes a byte), `scale` float8_e4m3fn [..., in / 16] (one a block of 16 inputs) and `global_scale` float32
([1] for a Linear; [E] for an expert bank, one an expert, shared by its fused gate and up projections).

FSDP2 shards it on dim 0 (rows; experts for a bank) with the few view and copy ops its sharding needs
(below), and calls its all-gather extension: `fsdp_pre_all_gather` hands FSDP the packed bytes and scales
to gather (0.56 bytes a weight instead of BF16's 2), `fsdp_post_all_gather` dequantizes the gathered
layer to the compute dtype. FSDP frees that after the layer's forward and gathers and dequantizes again
for its backward, so one layer's dequantized weights at a time are resident, never the model's.

`dequantize` is compressed-tensors' NVFP4 decompression (`NVFP4PackedCompressor.decompress` then the cast
to BF16, what `sparkrl dequantize` writes) computed on a whole bank at once: the same elementwise operations
in the same dtypes (codes and block scales in BF16, the effective scale block / global in FP32, their
product rounded to BF16), so the same bits. Any other op on the packed weight raises, naming it.
"""

from __future__ import annotations

import math

import torch

from trainer.nvfp4 import GROUP_SIZE

# The dtype compressed-tensors decompresses NVFP4 in (its unpacking's default) and the twin's dtype.
DECOMPRESSED_DTYPE = torch.bfloat16
aten = torch.ops.aten


# "triton": the fused kernel where it applies (trainer.nvfp4_kernel), "torch": compressed-tensors' elementwise
# ops everywhere. Both give the same bits; bench.dequant and bench.base_format compare their speed.
_IMPLEMENTATION = "triton"


def use_implementation(name: str) -> None:
    global _IMPLEMENTATION
    if name not in ("triton", "torch"):
        raise ValueError(f"NVFP4 dequantization: 'triton' or 'torch', got {name!r}")
    _IMPLEMENTATION = name


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """packed uint8 [..., C / 2], scale fp8 [..., C / 16], global_scale fp32 ([1], or one per leading
    index of a 3-D bank) -> the weight [..., C] in `dtype` (BF16 first: the dequantized checkpoint's bits),
    written into `out` where given."""
    from trainer import nvfp4_kernel

    g = global_scale.reshape(-1, *([1] * (scale.dim() - 1))) if packed.dim() == 3 else global_scale
    effective = scale.to(DECOMPRESSED_DTYPE) / g  # BF16 / FP32 -> FP32, as compressed-tensors divides
    if _IMPLEMENTATION == "triton" and nvfp4_kernel.available(packed, dtype):
        if out is None:
            shape = (*packed.shape[:-1], packed.shape[-1] * 2)
            out = torch.empty(shape, dtype=dtype, device=packed.device)
        return nvfp4_kernel.dequantize_into(packed, effective, out)
    weight = reference_dequantize(packed, effective, dtype)
    if out is None:
        return weight
    return out.copy_(weight.view(out.shape))


def reference_dequantize(packed: torch.Tensor, effective: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """compressed-tensors' unpacking, then the FP32 scale multiply rounded to BF16, then `dtype`."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    rows = packed.reshape(-1, packed.shape[-1])
    codes = unpack_fp4_from_uint8(rows, rows.shape[0], rows.shape[1] * 2, dtype=DECOMPRESSED_DTYPE)
    codes = codes.reshape(*packed.shape[:-1], -1, GROUP_SIZE)  # [..., groups, 16]
    weight = (codes.to(effective.dtype) * effective.unsqueeze(-1)).flatten(-2).to(DECOMPRESSED_DTYPE)
    return weight.to(dtype)


class NVFP4Weight(torch.Tensor):
    """The packed NVFP4 form of a frozen weight of logical `shape` and `dtype` (see the module docstring)."""

    packed: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor

    @staticmethod
    def __new__(cls, packed, scale, global_scale, shape, dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(shape), dtype=dtype, device=packed.device, requires_grad=False
        )

    def __init__(self, packed, scale, global_scale, shape, dtype):
        self.packed, self.scale, self.global_scale = packed, scale, global_scale

    @classmethod
    def empty(cls, shape, dtype, device) -> NVFP4Weight:
        """Uninitialised storage for a weight of `shape` ([out, in] or [E, out, in]) on `device`."""
        *lead, cols = shape
        if cols % GROUP_SIZE:
            raise ValueError(f"NVFP4 weight {list(shape)}: {cols} inputs, not a multiple of {GROUP_SIZE}")
        return cls(
            torch.empty((*lead, cols // 2), dtype=torch.uint8, device=device),
            torch.empty((*lead, cols // GROUP_SIZE), dtype=torch.float8_e4m3fn, device=device),
            torch.empty((shape[0] if len(shape) == 3 else 1,), dtype=torch.float32, device=device),
            shape,
            dtype,
        )

    @property
    def is_bank(self) -> bool:
        """A 3-D expert bank: its global scales are per expert and shard with it."""
        return self.packed.dim() == 3

    def nbytes_packed(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.global_scale))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.packed, self.scale, self.global_scale, dtype or self.dtype)

    def __repr__(self):
        return f"NVFP4Weight(shape={list(self.shape)}, dtype={self.dtype}, device={self.device})"

    # -- torch.compile / FSDP2 flattening ----------------------------------------------------------------

    def __tensor_flatten__(self):
        return ["packed", "scale", "global_scale"], (tuple(self.shape), self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        shape, dtype = ctx
        return NVFP4Weight(inner["packed"], inner["scale"], inner["global_scale"], shape, dtype)

    # -- FSDP2's all-gather extension ----------------------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """One gathered input: each row's packed codes, block scales (and a bank's per-expert global scale)
        as bytes side by side, [rows, bytes a row] uint8. One input, not three: FSDP2's one-rank path
        (torch 2.11 and 2.13, `FSDPParamGroup.wait_for_unshard`) copies only an extension's first input.
        A Linear's one global scale is the same on every rank and travels as metadata."""
        return (self._row_bytes(),), (None if self.is_bank else self.global_scale)

    def _row_bytes(self) -> torch.Tensor:
        rows = self.packed.shape[0]
        parts = [self.packed.reshape(rows, -1), self.scale.view(torch.uint8).reshape(rows, -1)]
        if self.is_bank:
            parts.append(self.global_scale.reshape(rows, -1).view(torch.uint8))
        return torch.cat(parts, dim=1)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The whole layer's gathered bytes -> its dequantized weight in `param_dtype` (into `out` from the
        second gather on: FSDP keeps the unsharded parameter's storage and refills it)."""
        (gathered,) = outputs
        rows = gathered.shape[0]
        packed_w, scale_w = math.prod(self.packed.shape[1:]), math.prod(self.scale.shape[1:])
        packed = gathered[:, :packed_w].reshape(rows, *self.packed.shape[1:])
        scale = gathered[:, packed_w : packed_w + scale_w].contiguous().view(self.scale.dtype)
        scale = scale.reshape(rows, *self.scale.shape[1:])
        if self.is_bank:
            global_scale = gathered[:, packed_w + scale_w :].contiguous().view(self.global_scale.dtype)
            global_scale = global_scale.reshape(rows, *self.global_scale.shape[1:])
        else:
            global_scale = metadata
        if out is not None:
            # A refill of the same parameter (backward's gather): keep its version, as FSDP2 does for its
            # own copy-out, or autograd reads the refill as an in-place change of a saved tensor.
            with torch.autograd._unsafe_preserve_version_counter(out):
                dequantize(packed, scale, global_scale, param_dtype, out=out)
            return None
        weight = dequantize(packed, scale, global_scale, param_dtype)
        return weight, (weight,)

    # -- the ops FSDP2's sharding and `Module.to_empty` use ------------------------------------------------

    def _rows(self, fn) -> NVFP4Weight:
        """fn applied to every inner tensor along dim 0 (a bank's global scales too)."""
        packed, scale = fn(self.packed), fn(self.scale)
        global_scale = fn(self.global_scale) if self.is_bank else self.global_scale
        return NVFP4Weight(packed, scale, global_scale, (packed.shape[0], *self.shape[1:]), self.dtype)

    def _each(self, fn) -> NVFP4Weight:
        return NVFP4Weight(fn(self.packed), fn(self.scale), fn(self.global_scale), self.shape, self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _OPS.get(func)
        if handler is None:
            raise NotImplementedError(
                f"NVFP4Weight (a packed frozen base weight, trainer.base_format=nvfp4) does not support "
                f"{func}; the weight is used dequantized after FSDP's all-gather"
            )
        return handler(*args, **kwargs)


def _dim0(dim: int, op: str) -> None:
    if dim != 0:
        raise NotImplementedError(f"NVFP4Weight: {op} along dim {dim}; only dim 0 (FSDP's shard dim)")


def _split(x: NVFP4Weight, split_size, dim=0):
    _dim0(dim, "split")
    sizes = [split_size] * (x.shape[0] // split_size) if isinstance(split_size, int) else list(split_size)
    if isinstance(split_size, int) and x.shape[0] % split_size:
        sizes.append(x.shape[0] % split_size)
    out, start = [], 0
    for n in sizes:
        out.append(x._rows(lambda t, s=start, n=n: t.narrow(0, s, n)))
        start += n
    return out


def _slice(x: NVFP4Weight, dim=0, start=None, end=None, step=1):
    _dim0(dim, "slice")
    if step != 1:
        raise NotImplementedError("NVFP4Weight: a strided slice")
    start, end, _ = slice(start, end).indices(x.shape[0])
    return x._rows(lambda t: t[start:end])


def _new_zeros(x: NVFP4Weight, size, dtype=None, layout=None, device=None, pin_memory=None):
    if tuple(size[1:]) != tuple(x.shape[1:]):
        raise NotImplementedError(f"NVFP4Weight.new_zeros {list(size)} from {list(x.shape)}: rows only")
    device = device or x.device
    return x._rows(lambda t: t.new_zeros((size[0], *t.shape[1:]), device=device))


def _copy(dst: NVFP4Weight, src: NVFP4Weight, non_blocking=False):
    if not isinstance(src, NVFP4Weight) or dst.shape != src.shape:
        raise NotImplementedError("NVFP4Weight.copy_ takes another NVFP4Weight of the same shape")
    for name in ("packed", "scale", "global_scale"):
        getattr(dst, name).copy_(getattr(src, name), non_blocking=non_blocking)
    return dst


def _view(x: NVFP4Weight, size):
    # FSDP2 keeps a flat 1-D view of every sharded parameter (`_sharded_param_data`); for a tensor with an
    # all-gather extension it only holds it. The flat alias shares the inner tensors.
    if list(size) in ([-1], [x.numel()]):
        return NVFP4Weight(x.packed, x.scale, x.global_scale, (x.numel(),), x.dtype)
    if list(size) == list(x.shape):  # DTensor.to_local() with autograd on: an alias
        return _alias(x)
    raise NotImplementedError(f"NVFP4Weight.view {list(size)}")


def _empty_like(x: NVFP4Weight, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    device = device or x.device
    return x._each(lambda t: torch.empty_like(t, device=device))


def _to_copy(
    x: NVFP4Weight,
    dtype=None,
    layout=None,
    device=None,
    pin_memory=None,
    non_blocking=False,
    memory_format=None,
):
    if dtype is not None and dtype != x.dtype:
        raise NotImplementedError(f"NVFP4Weight: a cast to {dtype} (dequantize() gives the weight)")
    return x._each(lambda t: t.to(device=device or t.device, non_blocking=non_blocking))


def _alias(x: NVFP4Weight):
    return x._each(lambda t: t)


_OPS = {
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.clone.default: lambda x, memory_format=None: x._each(torch.clone),
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split,
    aten.slice.Tensor: _slice,
    aten.narrow.default: lambda x, dim, start, length: _slice(x, dim, start, start + length),
    aten.new_zeros.default: _new_zeros,
    aten.copy_.default: _copy,
    aten.view.default: _view,
    aten.empty_like.default: _empty_like,
    aten._to_copy.default: _to_copy,
}


def _gather_rows(t: torch.Tensor, group) -> torch.Tensor:
    """All ranks' (equal) dim-0 shards of t, concatenated; moved as bytes (gloo has no float8)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    flat = t.contiguous().view(torch.uint8).reshape(-1)
    out = flat.new_empty((flat.numel() * world,))
    dist.all_gather_into_tensor(out, flat, group=group)
    return out.view(t.dtype).reshape(t.shape[0] * world, *t.shape[1:])


@torch.no_grad()
def gather_frozen(model: torch.nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """Every frozen parameter whole, by state-dict name, on CPU where `keep` (else {}): FSDP's shards
    gathered; packed ones gathered packed and dequantized to their dtype. Collective: every rank calls it."""
    from torch.distributed.tensor import DTensor

    from trainer.lora import unwrapped_name

    out = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            continue
        local = param.to_local() if isinstance(param, DTensor) else param
        if isinstance(local, NVFP4Weight):
            group = param.device_mesh.get_group()
            g = _gather_rows(local.global_scale, group) if local.is_bank else local.global_scale
            full = dequantize(
                _gather_rows(local.packed, group), _gather_rows(local.scale, group), g, local.dtype
            )
        else:
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        if keep:
            out[unwrapped_name(name)] = full.cpu() if full.device.type != "cpu" else full.clone()
    return out
