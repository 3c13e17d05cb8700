"""Checkpoint manifests: a damaged or incomplete newest checkpoint is named and skipped for the one before.

The trainer's part is written with the trainer's own writers (trainer.checkpoint_io: a PEFT adapter and
torch.save'd optimizer state) from a function standing in for the Ray trainer group, which needs a
torch.distributed group that unit tests do not start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

from rl.checkpoint import (
    MANIFEST,
    checkpoint_dirs,
    latest_checkpoint,
    load_driver_state,
    save_checkpoint,
    verify_checkpoint,
)
from trainer.checkpoint_io import atomic_torch_save, write_adapter

ROOT = Path(__file__).resolve().parents[2]


def _trainer_part(step: int):
    def save(d: Path) -> None:
        g = torch.Generator().manual_seed(step)
        write_adapter(
            d, {"layer.lora_A.weight": torch.randn(8, 64, generator=g)}, {"r": 8, "peft_type": "LORA"}
        )
        atomic_torch_save({"state": {0: {"exp_avg": torch.randn(8, 64, generator=g)}}}, d / "optimizer.pt")

    return save


def _run_with(tmp_path, steps=(2, 4)) -> None:
    for s in steps:
        save_checkpoint(tmp_path, s, {"step": s}, _trainer_part(s))


def test_every_checkpoint_has_a_manifest_of_its_files(tmp_path):
    path = save_checkpoint(tmp_path, 2, {"step": 2}, _trainer_part(2))
    files = json.loads((path / MANIFEST).read_text())["files"]
    assert set(files) == {
        "driver_state.json",
        "trainer/adapter_config.json",
        "trainer/adapter_model.safetensors",
        "trainer/optimizer.pt",
    }
    weights = path / "trainer" / "adapter_model.safetensors"
    assert files["trainer/adapter_model.safetensors"]["size"] == weights.stat().st_size
    assert verify_checkpoint(path) is None


def test_truncated_adapter_falls_back_to_the_previous_checkpoint(tmp_path):
    _run_with(tmp_path)
    weights = tmp_path / "checkpoints" / "step_4" / "trainer" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    said = []
    ckpt = latest_checkpoint(tmp_path, report=said.append)
    assert ckpt == tmp_path / "checkpoints" / "step_2" and load_driver_state(ckpt) == {"step": 2}
    assert len(said) == 1 and "step_4" in said[0] and str(weights) in said[0] and "truncated" in said[0]


def test_missing_optimizer_file_falls_back(tmp_path):
    _run_with(tmp_path)
    optim = tmp_path / "checkpoints" / "step_4" / "trainer" / "optimizer.pt"
    optim.unlink()
    said = []
    assert latest_checkpoint(tmp_path, report=said.append).name == "step_2"
    assert said == [f"checkpoint: skipping step_4: {optim}: missing"]


def test_same_size_corruption_is_caught_by_the_checksum(tmp_path):
    _run_with(tmp_path)
    weights = tmp_path / "checkpoints" / "step_4" / "trainer" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    said = []
    assert latest_checkpoint(tmp_path, report=said.append).name == "step_2"
    assert "SHA-256" in said[0] and str(weights) in said[0]


def test_a_step_directory_without_manifest_is_incomplete(tmp_path):
    """A checkpoint copied only in part (the manifest, written last, did not arrive)."""
    _run_with(tmp_path)
    (tmp_path / "checkpoints" / "step_4" / MANIFEST).unlink()
    said = []
    assert latest_checkpoint(tmp_path, report=said.append).name == "step_2"
    assert "manifest.json: missing" in said[0]


def test_nothing_good_left_gives_none(tmp_path):
    _run_with(tmp_path, steps=(2,))
    (tmp_path / "checkpoints" / "step_2" / "driver_state.json").write_text("{}")
    said = []
    assert latest_checkpoint(tmp_path, report=said.append) is None and len(said) == 1


def test_killed_mid_save_leaves_the_previous_checkpoint_newest(tmp_path):
    """A real process is SIGKILLed while it writes step 4 (after its adapter, before its optimizer)."""
    save_checkpoint(tmp_path, 2, {"step": 2}, _trainer_part(2))
    flag = tmp_path / "adapter_written"
    script = textwrap.dedent(
        f"""
        import time, torch
        from pathlib import Path
        from rl.checkpoint import save_checkpoint
        from trainer.checkpoint_io import write_adapter

        def save(d):
            write_adapter(d, {{"w.lora_A.weight": torch.ones(4, 4)}}, {{"r": 4}})
            Path({str(flag)!r}).write_text("1")
            time.sleep(600)

        save_checkpoint(Path({str(tmp_path)!r}), 4, {{"step": 4}}, save)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        deadline = time.monotonic() + 300
        while not flag.exists():
            assert proc.poll() is None, "the saving process exited early"
            assert time.monotonic() < deadline, "the saving process never wrote its adapter"
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    root = tmp_path / "checkpoints"
    assert (root / "step_4.tmp" / "trainer" / "adapter_model.safetensors").exists()  # the half-written one
    assert [s for s, _ in checkpoint_dirs(tmp_path)] == [2]
    assert latest_checkpoint(tmp_path).name == "step_2"
    # The next save of step 4 starts over and replaces the leftovers.
    save_checkpoint(tmp_path, 4, {"step": 4}, _trainer_part(4))
    assert latest_checkpoint(tmp_path).name == "step_4" and not (root / "step_4.tmp").exists()
