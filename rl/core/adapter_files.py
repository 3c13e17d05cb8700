"""A PEFT adapter directory (`save_pretrained`'s layout), read the same way by the trainer (resuming from a
checkpoint) and the rollout (`load_adapter` given a path, as evaluation does)."""

from __future__ import annotations

import json
import os
from pathlib import Path

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def read_peft_dir(directory: str | os.PathLike) -> tuple[dict, dict]:
    """(tensors, adapter_config) of a PEFT adapter directory, tensors on the CPU."""
    from safetensors.torch import load_file

    directory = Path(directory)
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory} is not a PEFT adapter directory: no {name}")
    return load_file(str(directory / ADAPTER_WEIGHTS)), json.loads((directory / ADAPTER_CONFIG).read_text())
