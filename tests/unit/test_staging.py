"""Where a rollout worker stages the weights its engine reads (rollout/staging.py): a name resolved on the
worker's own node, under the node's base, and each version published whole."""

from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path

import pytest

from rollout.staging import STAGE_DIR_ENV, StageDir, stage_base, stage_root


def test_a_name_is_resolved_under_the_nodes_own_base(monkeypatch, tmp_path):
    monkeypatch.setenv(STAGE_DIR_ENV, str(tmp_path / "node-a"))
    assert stage_base() == tmp_path / "node-a"
    assert stage_root("demo") == tmp_path / "node-a" / f"sparkrl-{getpass.getuser()}-demo"
    monkeypatch.setenv(STAGE_DIR_ENV, str(tmp_path / "node-b"))  # another node's environment
    assert stage_root("demo").parent == tmp_path / "node-b"
    monkeypatch.delenv(STAGE_DIR_ENV)
    assert stage_base() == (
        Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    )


def test_an_absolute_path_is_kept_and_any_run_name_gives_one_directory_of_its_own(monkeypatch, tmp_path):
    """A sweep names its runs `<sweep>/<point>`; users give names with spaces, dots and any length. Each
    resolves to one directory directly under the node's base, and names that differ stay apart."""
    assert stage_root(tmp_path / "mine") == tmp_path / "mine"
    monkeypatch.setenv(STAGE_DIR_ENV, str(tmp_path / "node"))
    names = [
        "tinysweep/lr=0.004",
        "tinysweep/lr=0.002",
        "tinysweep_lr=0.004",
        "..",
        "",
        "../../etc",
        "my run ünïcode",
        "x" * 300,
        "x" * 301,
    ]
    roots = [stage_root(n) for n in names]
    for name, root in zip(names, roots):
        assert root.parent == tmp_path / "node", name
        assert len(root.name) < 255 and not root.name.startswith("."), name
        StageDir(root).stage("adapter", lambda d: (d / "w").write_text("1"))
    assert len(set(roots)) == len(names)
    assert stage_root("demo").name == f"sparkrl-{getpass.getuser()}-demo"  # a plain name reads as itself


def test_a_version_is_published_whole_and_replaces_the_older(tmp_path):
    stage = StageDir(stage_root(tmp_path / "root"))
    assert (tmp_path / "root").stat().st_mode & 0o777 == 0o700

    def write(d, text):
        (d / "weights").write_text(text)

    first = stage.stage("adapter", lambda d: write(d, "v1"))
    assert (first / "weights").read_text() == "v1"

    def fails(d):
        write(d, "half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        stage.stage("adapter", fails)
    assert (first / "weights").read_text() == "v1"  # the failed write left the published version
    assert [p.name for p in stage.dir.iterdir()] == ["adapter"]  # and no temporary directory
    stage.stage("adapter", lambda d: write(d, "v2"))
    assert (first / "weights").read_text() == "v2"
