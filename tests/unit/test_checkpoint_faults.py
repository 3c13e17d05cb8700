"""No sequence of faults loses the newest good checkpoint or a run's recorded steps (rl/checkpoint.py).

`SimulatedRun` does on disk what rl.driver.Run does around its checkpoints, with the same pieces: it
resumes through `Checkpoints.for_resume`, records steps with the real `MetricsLogger` (which cuts
metrics.jsonl back to the resume point) and saves through `Checkpoints.save` with the trainer's own
writers (a PEFT adapter, a torch.save'd optimizer). The trainer group and Ray are left out: they write
the files, and their part of a resume is covered by tests/integration/test_train_runs.py. A save killed
part-way is a save whose trainer part raises after its adapter: on disk the same leftover `step_<N>.tmp/`
as the SIGKILL of test_checkpoint_manifest.py, without a process per case.

Faults: a truncated adapter, a missing optimizer, a missing manifest, a same-size bit flip, and a save
killed part-way, each at the newest checkpoint or (for the first) the one before; every sequence of two
faults with training and resumes between, at keep_checkpoints 1, 2 and 3.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from rl.checkpoint import (
    DAMAGED,
    WHY,
    Checkpoints,
    NoCheckpointToResume,
    checkpoint_dirs,
    load_driver_state,
    verify_checkpoint,
)
from rl.metrics import MetricsLogger, read_metrics
from trainer.checkpoint_io import atomic_torch_save, write_adapter


class KilledMidSave(Exception):
    pass


class SimulatedRun:
    """One invocation of `sparkrl train` on `run_dir`, as far as its checkpoints and metrics go."""

    def __init__(self, run_dir: Path, keep: int, resume: bool, every: int = 2):
        self.dir, self.every = run_dir, every
        self.said: list[str] = []
        self.checkpoints = Checkpoints(run_dir, keep, report=self.said.append)
        ckpt = self.checkpoints.for_resume() if resume else None
        self.step = load_driver_state(ckpt)["step"] if ckpt else 0
        self.resumed_from = ckpt
        self._logger().close()  # the driver's logger: it cuts metrics.jsonl back to the resume point

    def _logger(self) -> MetricsLogger:
        return MetricsLogger(self.dir, total_steps=10_000, start_step=self.step, tensorboard=False)

    def train(self, steps: int, kill_in_save: bool = False) -> None:
        """`steps` steps, a checkpoint every `every` and at the last; with `kill_in_save`, the process dies
        in the last one's save, after its adapter is written."""
        self.log = self._logger()
        try:
            for _ in range(steps):
                self.step += 1
                self.log.log(self.step, {"reward/mean": float(self.step)})
                last = _ == steps - 1
                if self.step % self.every == 0 or last:
                    self.checkpoints.save(
                        self.step, {"step": self.step}, _trainer_part(self.step, die=kill_in_save and last)
                    )
        finally:
            self.log.close()


def _trainer_part(step: int, die: bool = False):
    def save(d: Path) -> None:
        g = torch.Generator().manual_seed(step)
        write_adapter(
            d, {"layer.lora_A.weight": torch.randn(8, 64, generator=g)}, {"r": 8, "peft_type": "LORA"}
        )
        if die:
            raise KilledMidSave
        atomic_torch_save({"state": {0: {"exp_avg": torch.randn(8, 64, generator=g)}}}, d / "optimizer.pt")

    return save


def _truncate(path: Path) -> None:
    f = path / "trainer" / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:100])


def _flip(path: Path) -> None:
    f = path / "trainer" / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))


DAMAGE = {
    "truncated adapter": lambda p: _truncate(p),
    "missing optimizer": lambda p: (p / "trainer" / "optimizer.pt").unlink(),
    "missing manifest": lambda p: (p / "manifest.json").unlink(),
    "bit flip": _flip,
}
FAULTS = [*(f"{name} (newest)" for name in DAMAGE), "truncated adapter (second newest)", "killed in save"]


class Ledger:
    """What the test knows apart from the code under test: which checkpoints were written whole and not
    damaged since (pruning then takes older ones away)."""

    def __init__(self):
        self.good: dict[int, str] = {}  # step -> its manifest's text

    def written(self, run_dir: Path, steps) -> None:
        for step in steps:
            if (run_dir / "checkpoints" / f"step_{step}").is_dir():
                self.good[step] = _fingerprint(run_dir / "checkpoints" / f"step_{step}")

    def newest(self) -> int | None:
        return max(self.good) if self.good else None

    def check(self, run_dir: Path) -> None:
        """The newest good checkpoint is there, unchanged and verifying; then forget those pruned, which
        must all be older than it."""
        newest = self.newest()
        if newest is None:
            return
        path = run_dir / "checkpoints" / f"step_{newest}"
        assert path.is_dir(), f"the newest good checkpoint step_{newest} is gone"
        assert verify_checkpoint(path) is None and _fingerprint(path) == self.good[newest]
        on_disk = {s for s, _ in checkpoint_dirs(run_dir)}
        self.good = {s: f for s, f in self.good.items() if s in on_disk}


def _fingerprint(path: Path) -> str:
    return (path / "manifest.json").read_text()


def _apply(fault: str, run: SimulatedRun, ledger: Ledger, run_dir: Path) -> None:
    on_disk = [s for s, _ in checkpoint_dirs(run_dir)]
    if fault == "killed in save":  # two more steps, the process killed in the second one's save
        with pytest.raises(KilledMidSave):
            run.train(2, kill_in_save=True)
        ledger.written(run_dir, [run.step - 1])
        assert (run_dir / "checkpoints" / f"step_{run.step}.tmp").is_dir()
        return
    name, where = fault.rsplit(" (", 1)
    target = on_disk[-1] if where == "newest)" else (on_disk[-2] if len(on_disk) > 1 else None)
    if target is None:
        return
    DAMAGE[name](run_dir / "checkpoints" / f"step_{target}")
    ledger.good.pop(target, None)


def _resume(run_dir: Path, keep: int, ledger: Ledger) -> SimulatedRun | None:
    """A `--resume`: from the newest good checkpoint, with everything above it moved aside and the
    metrics cut back to it; or, with none, an error naming each checkpoint that changes nothing."""
    before = _snapshot(run_dir)
    recorded = [r["step"] for r in read_metrics(run_dir)]
    newest = ledger.newest()
    if newest is None:
        with pytest.raises(NoCheckpointToResume) as err:
            SimulatedRun(run_dir, keep, resume=True)
        for s, _ in checkpoint_dirs(run_dir):
            assert f"step_{s}:" in str(err.value)
        assert _snapshot(run_dir) == before  # nothing moved, nothing cut
        return None
    run = SimulatedRun(run_dir, keep, resume=True)
    assert run.step == newest and run.resumed_from.name == f"step_{newest}"
    assert [s for s, _ in checkpoint_dirs(run_dir)][-1] == newest  # nothing above the resume point
    assert [r["step"] for r in read_metrics(run_dir)] == [s for s in recorded if s <= newest]
    for moved in (run_dir / "checkpoints" / DAMAGED).glob("*"):
        assert (moved / WHY).read_text().strip()  # named, with its fault
    # what the resume cut from metrics.jsonl is kept beside it
    superseded = run_dir / "metrics.superseded.jsonl"
    cut = [s for s in recorded if s > newest]
    if cut:
        kept = [json.loads(line)["step"] for line in superseded.read_text().splitlines()]
        assert kept[-len(cut) :] == cut
    return run


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _good_on_disk(run_dir: Path) -> list[int]:
    return [s for s, p in checkpoint_dirs(run_dir) if verify_checkpoint(p) is None]


@pytest.mark.parametrize("keep", [1, 2, 3])
@pytest.mark.parametrize("first,second", list(itertools.product(FAULTS, repeat=2)))
def test_the_newest_good_checkpoint_survives_every_sequence_of_two_faults(tmp_path, keep, first, second):
    """train 5 steps; fault; resume; train 3; fault; resume; train 3; resume: after each, the newest
    checkpoint known good is there and verifies, pruning kept at most `keep` good ones, and every resume
    starts from it (or, with none left, is an error that changes nothing)."""
    ledger = Ledger()
    run = SimulatedRun(tmp_path, keep, resume=False)
    run.train(5)
    ledger.written(tmp_path, (2, 4, 5))
    ledger.check(tmp_path)
    for fault in (first, second):
        _apply(fault, run, ledger, tmp_path)
        ledger.check(tmp_path)
        run = _resume(tmp_path, keep, ledger)
        if run is None:
            return
        ledger.check(tmp_path)
        start = run.step
        run.train(3)
        ledger.written(tmp_path, range(start + 1, start + 4))
        ledger.check(tmp_path)
        assert ledger.newest() == start + 3  # the run's last step, checkpointed, is the newest good one
        assert len(_good_on_disk(tmp_path)) <= keep
    assert _resume(tmp_path, keep, ledger).step == ledger.newest()


def test_the_reported_sequence_keeps_step_20_until_two_newer_good_ones_exist(tmp_path):
    """keep_checkpoints 2 holding step_20 and step_25; step_25's adapter truncated; resume to 26: the
    damaged step_25 is moved aside (not kept as recent), the run writes a good step_25 and step_26, and
    only then is step_20 pruned. Damage step_26 too: resume takes the new step_25. A stop at step 26
    after that keeps its checkpoint."""
    run = SimulatedRun(tmp_path, keep=2, resume=False, every=5)
    run.train(25)
    assert [s for s, _ in checkpoint_dirs(tmp_path)] == [20, 25]
    _truncate(tmp_path / "checkpoints" / "step_25")
    run = SimulatedRun(tmp_path, keep=2, resume=True, every=5)
    assert run.step == 20
    assert any("moved step_25 aside" in line and "truncated" in line for line in run.said)
    assert [s for s, _ in checkpoint_dirs(tmp_path)] == [20]
    run.train(1)  # step 21, the last of this invocation: checkpointed
    assert [s for s, _ in checkpoint_dirs(tmp_path)] == [20, 21]
    run = SimulatedRun(tmp_path, keep=2, resume=True, every=5)
    run.train(5)  # 22..26: step_25 (new), step_26
    assert [s for s, _ in checkpoint_dirs(tmp_path)] == [25, 26]
    assert verify_checkpoint(tmp_path / "checkpoints" / "step_25") is None
    damaged = tmp_path / "checkpoints" / DAMAGED / "step_25"
    assert "truncated" in (damaged / WHY).read_text()
    _truncate(tmp_path / "checkpoints" / "step_26")
    run = SimulatedRun(tmp_path, keep=2, resume=True, every=5)
    assert run.step == 25
    assert len(read_metrics(tmp_path)) == 25
    run.train(1)  # a Ctrl-C at step 26: its checkpoint is written and kept
    assert [s for s, _ in checkpoint_dirs(tmp_path)] == [25, 26]
    assert (tmp_path / "checkpoints" / DAMAGED / "step_26" / WHY).exists()
    assert (tmp_path / "checkpoints" / DAMAGED / "step_25" / WHY).exists()


def test_resume_with_nothing_good_names_each_checkpoint_and_changes_nothing(tmp_path):
    run = SimulatedRun(tmp_path, keep=2, resume=False)
    run.train(4)
    _truncate(tmp_path / "checkpoints" / "step_4")
    (tmp_path / "checkpoints" / "step_2" / "trainer" / "optimizer.pt").unlink()
    before = _snapshot(tmp_path)
    with pytest.raises(NoCheckpointToResume) as err:
        SimulatedRun(tmp_path, keep=2, resume=True)
    text = str(err.value)
    assert "no checkpoint that verifies" in text and "metrics.jsonl records 4 step(s)" in text
    assert "step_4:" in text and "adapter_model.safetensors" in text and "truncated" in text
    assert "step_2:" in text and "optimizer.pt: missing" in text
    assert _snapshot(tmp_path) == before


def test_resume_of_a_run_with_steps_but_no_checkpoint_is_an_error(tmp_path):
    """Steps recorded (checkpoint_every 0 and killed before the end): resuming would start at step 0 and
    cut metrics.jsonl; it refuses instead."""
    log = MetricsLogger(tmp_path, total_steps=10, tensorboard=False)
    for s in (1, 2, 3):
        log.log(s, {"reward/mean": 0.0})
    log.close()
    with pytest.raises(NoCheckpointToResume, match="metrics.jsonl records 3 step"):
        Checkpoints(tmp_path).for_resume()
    assert len(read_metrics(tmp_path)) == 3


def test_a_run_that_recorded_nothing_resumes_at_step_0(tmp_path):
    (tmp_path / "config.yaml").write_text("run: {}\n")
    assert Checkpoints(tmp_path).for_resume() is None


def test_a_crash_between_the_renames_of_a_resave_keeps_the_old_checkpoint(tmp_path):
    """A second save of one step renames the old one to `.step_<N>.replaced` before the new one moves in;
    a crash between the two leaves no `step_<N>`: resume puts the old one back."""
    cps = Checkpoints(tmp_path)
    cps.save(2, {"step": 2}, _trainer_part(2))
    root = tmp_path / "checkpoints"
    (root / "step_2").rename(root / ".step_2.replaced")
    assert Checkpoints(tmp_path).for_resume() == root / "step_2"
    assert not (root / ".step_2.replaced").exists()


def test_pruning_hashes_a_checkpoint_once_then_checks_sizes(tmp_path, monkeypatch):
    """Each save prunes; a checkpoint this process verified in full is re-checked by its files' sizes only.
    A truncation is still caught at the next save and the checkpoint moved aside."""
    from rl import checkpoint as C

    hashed: list[str] = []
    real = C._sha256
    monkeypatch.setattr(C, "_sha256", lambda p: (hashed.append(p.name), real(p))[1])
    cps = Checkpoints(tmp_path, keep=3)
    for s in (1, 2, 3):
        cps.save(s, {"step": s}, _trainer_part(s))
    writes = len(hashed)
    cps.save(4, {"step": 4}, _trainer_part(4))
    assert len(hashed) - writes == 4  # the new checkpoint's manifest (4 files); none re-hashed
    _truncate(tmp_path / "checkpoints" / "step_3")
    cps.save(5, {"step": 5}, _trainer_part(5))
    assert [s for s, _ in checkpoint_dirs(tmp_path)] == [2, 4, 5]
    assert (tmp_path / "checkpoints" / DAMAGED / "step_3" / WHY).exists()
