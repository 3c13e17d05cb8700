"""rollout.safetensors_io against the safetensors package: same bytes where both can write, and files its
reader accepts (offsets, alignment, metadata) where only ours can (tensors sharing memory)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import rollout.safetensors_io as sio
from rollout.safetensors_io import write_safetensors


def _header(path) -> dict:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0 and raw[8:9] == b"{"
    return json.loads(raw[8 : 8 + n])


def test_same_bytes_as_save_file(tmp_path):
    # One dtype and names in sorted order: the library's own order, so the files must be identical.
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "b.scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "c.empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "d.weight": torch.randn(7, generator=g).to(torch.bfloat16),
    }
    save_file(tensors, tmp_path / "lib.safetensors", metadata={"format": "pt"})
    size = write_safetensors(tmp_path / "ours.safetensors", tensors)
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "lib.safetensors").read_bytes()
    assert size == (tmp_path / "ours.safetensors").stat().st_size


def test_shared_memory_views_mixed_dtypes_and_order(tmp_path):
    stacked = torch.arange(4 * 6 * 3, dtype=torch.float32).reshape(4, 6, 3)
    halves = stacked.reshape(8, 3, 3).unbind(0)  # views, back to back in one storage
    items = [
        ("mask", torch.tensor([True, False, True])),
        *[(f"half.{i}", halves[i]) for i in range(8)],
        ("again.0", stacked[0]),  # the same memory as half.0 and half.1, listed twice
        ("late.3", stacked[3]),  # out of memory order
        ("transposed", stacked[1].t()),  # not contiguous
        ("ids", torch.arange(5)),
        ("half_precision", torch.linspace(0, 1, 5, dtype=torch.float16)),
    ]
    path = tmp_path / "t.safetensors"
    write_safetensors(path, items, metadata={"format": "pt", "note": "x"})
    got = load_file(str(path))
    assert got.keys() == dict(items).keys()
    for name, value in items:
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "x"}
    header = _header(path)
    # Wider elements first (the given order otherwise), each starting at a multiple of its size.
    names = [n for n in header if n != "__metadata__"]
    assert names[0] == "ids" and names[-2:] == ["half_precision", "mask"]
    for name in names:
        begin, end = header[name]["data_offsets"]
        assert begin % dict(items)[name].itemsize == 0, name


def test_views_of_one_storage_become_one_buffer():
    stacked = torch.zeros(16, 4, 2, dtype=torch.bfloat16)
    spans = sio._Spans()
    for view in stacked.unbind(0):
        spans.add(view)
    spans.add(stacked[0])  # a repeat starts a new range
    assert [b.nbytes for b in spans.buffers()] == [stacked.nbytes, stacked[0].nbytes]


def test_partial_writes_and_more_buffers_than_iov_max(tmp_path, monkeypatch):
    # 3000 tensors that do not touch in memory (every other row): more iovecs than one writev takes.
    rows = torch.arange(6000 * 3, dtype=torch.int32).reshape(6000, 3)
    items = [(f"r{i}", rows[2 * i]) for i in range(3000)]
    real = sio.os.writev
    calls = []

    def short_writev(fd, buffers):  # the kernel may write less than asked: here 1 byte short
        calls.append(len(buffers))
        data = b"".join(bytes(b) for b in buffers)
        return real(fd, [data[: max(1, len(data) - 1)]])

    monkeypatch.setattr(sio.os, "writev", short_writev)
    path = tmp_path / "t.safetensors"
    write_safetensors(path, items)
    assert max(calls) == sio._IOV_MAX and len(calls) > 3
    got = load_file(str(path))
    assert all(torch.equal(got[name], value) for name, value in items)


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="duplicate or reserved"):
        write_safetensors(tmp_path / "t", [("a", torch.zeros(1)), ("a", torch.zeros(1))])
    with pytest.raises(ValueError, match="duplicate or reserved"):
        write_safetensors(tmp_path / "t", {"__metadata__": torch.zeros(1)})
    with pytest.raises(ValueError, match="complex64"):
        write_safetensors(tmp_path / "t", {"c": torch.zeros(2, dtype=torch.complex64)})
