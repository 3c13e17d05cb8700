"""NVFP4 dequantization as one Triton kernel (CUDA), bit-for-bit what compressed-tensors' path computes.

compressed-tensors' `unpack_fp4_from_uint8` and the scale multiply run as a dozen elementwise ops through
int64 lookup indices and FP32 temporaries: for one Qwen3-30B-A3B expert bank (604 M weights) that is
several GB of transient memory and traffic per dequantization, and the trainer dequantizes every layer's
bank for each micro-batch's forward and again for its backward. The kernel reads each packed byte once and
writes its two BF16 weights once.

Same bits: the per-block effective scale (block scale in BF16 / global scale in FP32, an FP32 division) is
computed by the same torch expression as the reference path; the kernel then takes each code's E2M1 value
from compressed-tensors' own table, multiplies in FP32 (one IEEE multiply, round to nearest) and rounds to
BF16 (round to nearest even, in integer ops on the bits: Triton's interpreter, which the CPU tests run,
truncates a float cast), as the reference's `(codes.float() * effective).to(bfloat16)` does.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (some CPU installs): the reference path serves
    triton = None

BLOCK = 1024  # packed bytes a program: 2,048 weights
_MAX_ROWS = 65535  # CUDA's grid limit on the second axis (the rows)

if triton is not None:

    @triton.jit
    def _to_bf16_bits(x):
        """FP32 -> BF16 bits, round to nearest even (integer ops: the same bits compiled or interpreted)."""
        bits = x.to(tl.uint32, bitcast=True)
        return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16

    @triton.jit
    def _dequantize_rows(
        packed_ptr,
        effective_ptr,
        table_ptr,
        out_ptr,
        row_bytes,
        packed_row_stride,
        OUT_FP32: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Row `program_id(1)`, bytes [program_id(0) * BLOCK, + BLOCK): byte b of a row holds weights 2b
        (low nibble) and 2b + 1 (high nibble), both in block b // 8 (16 weights a block). `out_ptr` is the
        output's bits: int16 for BF16, int32 for FP32 (the BF16 value widened)."""
        row = tl.program_id(1).to(tl.int64)
        col = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = col < row_bytes
        byte = tl.load(packed_ptr + row * packed_row_stride + col, mask=mask, other=0).to(tl.int32)
        scale = tl.load(effective_ptr + row * (row_bytes // 8) + col // 8, mask=mask, other=0.0)
        low = _to_bf16_bits(tl.load(table_ptr + (byte & 15)) * scale)
        high = _to_bf16_bits(tl.load(table_ptr + (byte >> 4)) * scale)
        bits = tl.interleave(low, high)
        if OUT_FP32:
            values = (bits << 16).to(tl.int32, bitcast=True)
        else:
            values = bits.to(tl.uint16).to(tl.int16, bitcast=True)
        out_col = tl.program_id(0) * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
        tl.store(out_ptr + row * (2 * row_bytes) + out_col, values, mask=out_col < 2 * row_bytes)


@functools.cache
def _code_table(device: torch.device) -> torch.Tensor:
    """The 16 E2M1 codes' values (FP32), as compressed-tensors unpacks them (signed zero included)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    codes = torch.arange(16, dtype=torch.uint8).reshape(1, 16)  # low nibble = the code, high = 0
    values = unpack_fp4_from_uint8(codes, 1, 32, dtype=torch.float32).reshape(16, 2)[:, 0]
    return values.contiguous().to(device)


def available(packed: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the kernel takes this dequantization: a CUDA tensor (or Triton's interpreter, which runs
    on CPU tensors), BF16 or FP32 out, rows within the grid's limit."""
    if triton is None or dtype not in (torch.bfloat16, torch.float32):
        return False
    if packed.shape[0] > _MAX_ROWS:
        return False
    return packed.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def dequantize_into(packed: torch.Tensor, effective: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """packed uint8 [R, ..., C / 2] (the dims after the first contiguous, the first strided: a slice of
    FSDP's gathered bytes), effective FP32 [R, ..., C / 16] -> out [R, ..., C] (contiguous, BF16 or FP32)."""
    rows = packed.shape[0]
    packed2 = packed.reshape(rows, -1)
    row_bytes = packed2.shape[1]
    if packed2.stride(1) != 1:
        packed2 = packed2.contiguous()
    effective2 = effective.reshape(rows, -1).contiguous()
    if effective2.shape[1] * 8 != row_bytes or out.numel() != 2 * rows * row_bytes or not out.is_contiguous():
        raise ValueError(
            f"NVFP4 dequantization: packed {list(packed.shape)}, scales {list(effective.shape)}, "
            f"out {list(out.shape)} do not describe one weight"
        )
    fp32 = out.dtype == torch.float32
    bits = out.view(torch.int32 if fp32 else torch.int16)
    grid = (triton.cdiv(row_bytes, BLOCK), rows)
    _dequantize_rows[grid](
        packed2,
        effective2,
        _code_table(packed.device),
        bits,
        row_bytes,
        packed2.stride(0),
        OUT_FP32=fp32,
        BLOCK=BLOCK,
    )
    return out
