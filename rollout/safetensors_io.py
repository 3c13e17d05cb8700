"""Write a safetensors file straight from tensors that may share memory (views of one stacked tensor).

`safetensors.torch.save_file` refuses tensors whose memory overlaps, so the per-expert views of a stacked
LoRA factor would each need a copy of their own, and it copies every tensor into a bytes object before
writing: two extra passes over a 425 MB adapter. This writer hands the tensors' own memory to `os.writev`.

Format (huggingface/safetensors, `safetensors/src/tensor.rs`): an 8-byte little-endian u64 N, N bytes of
JSON header `{"__metadata__": {str: str}, name: {"dtype": "BF16", "shape": [...], "data_offsets": [begin,
end]}, ...}` padded with spaces to a multiple of 8, then the data. Offsets count from the end of the
header; readers require the tensors to tile the data exactly (in offset order, no gap, no overlap, the last
one ending at the end of the file), so a tensor listed twice is written twice.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_IOV_MAX = 1024  # buffers per writev call: Linux's IOV_MAX


def write_safetensors(
    path: str | Path,
    tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write `tensors` (name -> tensor, or (name, tensor) pairs) to `path`; returns the file size.

    The data follows the given order, except that wider elements come first (a stable sort, as the library
    does): the data starts 8-aligned, so each tensor then starts at a multiple of its element size, which
    readers that map the file rely on. `metadata` defaults to `{"format": "pt"}`, what transformers checks.
    """
    if sys.byteorder != "little":
        raise RuntimeError("write_safetensors writes the tensors' memory as is; safetensors is little-endian")
    items = sorted(tensors.items() if isinstance(tensors, dict) else tensors, key=lambda kv: -kv[1].itemsize)
    header: dict = {"__metadata__": {"format": "pt"} if metadata is None else metadata}
    spans = _Spans()
    offset = 0
    for name, tensor in items:
        if name in header:
            raise ValueError(f"write_safetensors: tensor name {name!r} is a duplicate or reserved")
        if tensor.dtype not in DTYPES:
            raise ValueError(f"write_safetensors: {name}: safetensors has no {tensor.dtype}")
        nbytes = tensor.numel() * tensor.itemsize
        header[name] = {
            "dtype": DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        spans.add(tensor)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb", buffering=0) as f:
        _writev_all(f.fileno(), [struct.pack("<Q", len(text)) + text, *spans.buffers()])
    return 8 + len(text) + offset


class _Spans:
    """The data section as byte ranges of the tensors' storages, in file order. A tensor that starts where
    the previous one ended in the same storage extends that range, so the per-expert views of a stacked
    tensor, listed in memory order, become one buffer (one numpy view, one iovec) instead of thousands."""

    def __init__(self):
        self.arrays: dict[int, object] = {}  # storage address -> uint8 numpy array over all of it
        self.ranges: list[list] = []  # [array, begin, end]

    def add(self, tensor: torch.Tensor) -> None:
        t = tensor if tensor.device.type == "cpu" else tensor.cpu()  # only its memory is read: no detach
        t = t.contiguous()  # a copy only if it is not
        storage = t.untyped_storage()
        base = storage.data_ptr()
        array = self.arrays.get(base)
        if array is None:
            # The storage's bytes as uint8 (numpy has no bfloat16); the array keeps the storage alive.
            array = self.arrays[base] = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
        begin = t.data_ptr() - base
        end = begin + t.nbytes
        last = self.ranges[-1] if self.ranges else None
        if last is not None and last[0] is array and last[2] == begin:
            last[2] = end
        elif end > begin:
            self.ranges.append([array, begin, end])

    def buffers(self) -> list:
        return [array[begin:end] for array, begin, end in self.ranges]


def _writev_all(fd: int, buffers: list) -> None:
    """Write the buffers in order with as few system calls as the kernel allows (IOV_MAX per call),
    resuming after a partial write."""
    views = [memoryview(b).cast("B") for b in buffers]
    i = 0
    while i < len(views):
        written = os.writev(fd, views[i : i + _IOV_MAX])
        if not written:
            raise OSError(f"writev wrote nothing ({len(views) - i} buffers left)")
        while i < len(views) and written >= len(views[i]):
            written -= len(views[i])
            i += 1
        if written:
            views[i] = views[i][written:]
