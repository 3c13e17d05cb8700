"""bench.common.run writes each row a measure yields as it comes: a command that dies (an engine lost in
a later row, a GPU call cut by its limit) leaves the rows before it on disk, marked incomplete."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench.common import Bench, run


class EngineDied(RuntimeError):
    pass


def _bench(measure) -> Bench:
    return Bench(name="probe", doc="a probe", columns=("row", "value"), measure=measure)


# A started Setup stands in for Ray and the workers: run() then starts nothing and only reads model_path.
SETUP = SimpleNamespace(model_path="/models/tiny")


def test_rows_before_a_failure_stay_on_disk_marked_incomplete(tmp_path):
    def measure(s, args):
        yield {"row": "first", "value": 1.0}
        (tmp_path / "seen.json").write_text((tmp_path / "probe.json").read_text())  # written before the next
        raise EngineDied("illegal memory access")

    with pytest.raises(EngineDied):
        run(_bench(measure), ["demo_cpu", "--out", str(tmp_path)], setup=SETUP)
    doc = json.loads((tmp_path / "probe.json").read_text())
    assert doc["complete"] is False and doc["rows"] == [{"row": "first", "value": 1.0}]
    assert json.loads((tmp_path / "seen.json").read_text())["rows"] == doc["rows"]
    table = (tmp_path / "probe.md").read_text()
    assert "| first | 1.000 |" in table and "Incomplete: the command stopped after these rows." in table


def test_a_finished_command_is_complete_whether_it_yields_or_returns(tmp_path):
    rows = [{"row": "a", "value": 1.0}, {"row": "b", "value": 2.0}]

    def yielding(s, args):
        yield from rows

    for name, measure in (("yielding", yielding), ("returning", lambda s, args: list(rows))):
        out = tmp_path / name
        doc = run(_bench(measure), ["demo_cpu", "--out", str(out)], setup=SETUP)
        on_disk = json.loads((out / "probe.json").read_text())
        assert doc["complete"] is True and on_disk["complete"] is True and on_disk["rows"] == rows
        assert "Incomplete" not in (out / "probe.md").read_text()


def test_kl_rows_of_another_name_are_one_clear_line(capsys):
    from bench.common import parser
    from bench.kl import BENCH

    assert parser(BENCH).parse_args(["demo_cpu", "--rows", "fp32,r3"]).rows == ["fp32", "r3"]
    with pytest.raises(SystemExit):
        parser(BENCH).parse_args(["demo_cpu", "--rows", "r3,fp64"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--rows" in err and "'r3,fp64'" in err and "r3, fp32, same_engine" in err
