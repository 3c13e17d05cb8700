"""vLLM's LoRA kernel configs on Hopper: the single-slice `lora_expand` kernel with a narrower N block.

On sm90 GPUs, vLLM's Triton `lora_expand` kernel gives NaN with `block_n=128`, its default for a projection
of one output slice (`o_proj`, `down_proj`, a single-slice expert projection): vLLM issue 48590, reported on
vLLM 0.26 with a MoE LoRA, NaN from about the 128th prompt token. vLLM's public way to choose those block
sizes is a folder of tuned configs named by `VLLM_TUNED_CONFIG_FOLDER`
(`vllm/lora/ops/triton_ops/utils.py::load_lora_op_config`, same in 0.26 and 0.30): a file per op and GPU,
`{gpu}_EXPAND_{add_inputs}.json`, structured `[max_loras][num_slices][m][k][n] -> config`, where every level
but num_slices falls back to the nearest key. `write_tuned_configs` writes the two expand files with vLLM's
default expand config (`get_lora_op_configs`) except `block_n` of a single slice.

Side effects of setting the folder, both vLLM's own behaviour: the shrink op finds no file and keeps its
default config (vLLM logs a warning), and the fused MoE LoRA ops (`use_tuned_config`) take
`get_lora_op_configs`' defaults instead of the fused-MoE config tables.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "VLLM_TUNED_CONFIG_FOLDER"
HOPPER_MAJOR = 9  # compute capability 9.x: H100, H200, H20
# vLLM's default `lora_expand` config (get_lora_op_configs, op_type "expand"); block_n is 64 for several
# slices and 128 for one, the value that breaks on sm90.
EXPAND_DEFAULT = {
    "block_m": 64,
    "block_k": 32,
    "num_warps": 4,
    "num_ctas": 1,
    "num_stages": 2,
    "max_nreg": None,
}
MULTI_SLICE_BLOCK_N = 64
# num_slices is looked up exactly (a missing one is a KeyError inside the engine): every count a vLLM layer
# stacks (QKV 3, gate/up 2) and more.
MAX_SLICES = 16


def config_file_names(gpu_name: str) -> list[str]:
    """The expand files vLLM looks for on `gpu_name` (its spaces and dashes made underscores, as vLLM does)."""
    gpu = gpu_name.replace(" ", "_").replace("-", "_")
    return [f"{gpu}_EXPAND_{flag}.json" for flag in ("TRUE", "FALSE")]


def expand_configs(single_slice_block_n: int) -> dict:
    """The expand op's tuned-config table: one entry per slice count, any max_loras / m / k / n."""
    by_slices = {}
    for slices in range(1, MAX_SLICES + 1):
        block_n = single_slice_block_n if slices == 1 else MULTI_SLICE_BLOCK_N
        by_slices[str(slices)] = {"1": {"1": {"1": {**EXPAND_DEFAULT, "block_n": block_n}}}}
    return {"1": by_slices}


def write_tuned_configs(folder: Path, gpu_name: str, single_slice_block_n: int) -> list[Path]:
    """Write the expand files for `gpu_name` under `folder`; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(expand_configs(single_slice_block_n), indent=1)
    paths = []
    for name in config_file_names(gpu_name):
        tmp = folder / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, folder / name)
        paths.append(folder / name)
    return paths


def hopper_gpu_name() -> str | None:
    """The first visible GPU's name if it is a Hopper (sm90) CUDA GPU, else None. Read through vLLM's
    platform (NVML), which leaves CUDA uninitialised in this process, so vLLM may still fork its engine."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    cap = current_platform.get_device_capability()
    if cap is None or cap.major != HOPPER_MAJOR:
        return None
    return current_platform.get_device_name()


class HopperLoraConfigs:
    """Points `VLLM_TUNED_CONFIG_FOLDER` at expand configs with `block_n` for a single slice while an engine
    runs, and puts the variable back on `restore`. Does nothing off Hopper, with `block_n` 0, or where the
    variable is already set (the user's own tuned configs win)."""

    def __init__(self, folder: Path, block_n: int, gpu_name: str | None):
        self.folder: Path | None = None
        self._previous = os.environ.get(ENV)
        if not block_n or gpu_name is None or self._previous:
            if block_n and gpu_name and self._previous:
                log.info("%s is set (%s): vLLM's LoRA kernel configs left as they are", ENV, self._previous)
            return
        write_tuned_configs(folder, gpu_name, block_n)
        os.environ[ENV] = str(folder)
        self.folder = folder
        log.info("LoRA expand block_n %d for single slices on %s (%s=%s)", block_n, gpu_name, ENV, folder)

    def restore(self) -> None:
        if self.folder is not None:
            os.environ.pop(ENV, None)
            self.folder = None
