"""Files on disk: the base model (Hugging Face or NVFP4), adapters, atomic writes.

NVFP4 compressed-tensors checkpoints are dequantized to BF16 once, into a cache directory keyed by the
source's path and modification times, and loaded from there like any Hugging Face checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from rl.core.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from rl.core.paths import cache_dir
from trainer.nvfp4 import dequantize_nvfp4, is_nvfp4_checkpoint


def dequantize_checkpoint(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """`sparkrl dequantize SRC DST`: the BF16 twin of an NVFP4 checkpoint, written shard by shard."""
    return dequantize_nvfp4(src, dst, torch.bfloat16)


def _dequantized_cache(src: Path) -> Path:
    h = hashlib.sha256(str(src.resolve()).encode())
    for f in sorted(src.glob("*.safetensors")) + [src / "config.json"]:
        h.update(f"{f.name}:{f.stat().st_mtime_ns}:{f.stat().st_size}".encode())
    return cache_dir() / "dequantized" / f"{src.name}-{h.hexdigest()[:16]}"


def resolve_base_model(path: str, is_writer: bool, barrier: Callable[[], None]) -> str:
    """The directory to load trainer weights from: `path` itself, or for an NVFP4 checkpoint its BF16
    twin in the cache (written by the one rank with is_writer, while the others wait at `barrier`)."""
    if not os.path.isdir(path) or not is_nvfp4_checkpoint(path):
        return path
    target = _dequantized_cache(Path(path))
    if is_writer and not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        dequantize_checkpoint(path, target)
    barrier()
    return str(target)


def load_base_model(path: str, dtype: torch.dtype):
    from rl.models import auto_causal_lm

    return auto_causal_lm().from_pretrained(path, dtype=dtype)


# ----------------------------------------------------------------------------------------------------
# Atomic writes: a reader sees the old file or the new one, never half of one.


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_torch_save(obj, path: Path) -> None:
    _atomic(Path(path), lambda p: torch.save(obj, p))


def atomic_write_json(obj, path: Path) -> None:
    _atomic(Path(path), lambda p: p.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n"))


def replace_dir(tmp: Path, dst: Path) -> None:
    """Moves a fully written directory into place; an existing dst is replaced."""
    old = None
    if dst.exists():
        old = dst.with_name(f"{dst.name}.old-{os.getpid()}")
        os.rename(dst, old)
    os.rename(tmp, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_adapter(directory: str | os.PathLike, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """PEFT layout: adapter_model.safetensors + adapter_config.json (`PeftModel.from_pretrained` loads it)."""
    directory = Path(directory)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    _atomic(directory / ADAPTER_WEIGHTS, lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    atomic_write_json(config, directory / ADAPTER_CONFIG)
    return directory


# A trainer checkpoint's older adapter versions (rollout.max_staleness > 0), beside its current adapter.
OLDER_VERSIONS = "older_versions"


def older_version_dir(version: int) -> Path:
    """Where, inside a trainer checkpoint, the adapter of an older `version` goes."""
    return Path(OLDER_VERSIONS) / f"v{version}"


def older_versions(checkpoint: str | os.PathLike) -> dict[int, Path]:
    """{version: adapter directory} of the older versions a trainer checkpoint holds, oldest first."""
    root = Path(checkpoint) / OLDER_VERSIONS
    found = {int(d.name[1:]): d for d in root.glob("v*") if d.is_dir() and d.name[1:].isdigit()}
    return dict(sorted(found.items()))
