"""sparkrl report: the KL verdict, the final-metrics table, the plots, the labels of runs that share a name and
the rollout samples, on run directories written here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from rl.cli import main
from rl.report import kl_verdict, load_run, run_labels, write_report


def _run(tmp_path, name, kls, budget=1e-3, r3=True):
    d = tmp_path / name
    d.mkdir()
    (d / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "run": {"name": name},
                "r3": {"enabled": r3},
                "monitor": {"k3_kl_max": budget, "k3_kl_trend_max": 0},
            }
        )
    )
    recs = [{"step": 0, "val-core/synthetic/arith/acc/mean@8": 0.4}]
    for i, kl in enumerate(kls, start=1):
        recs.append(
            {
                "step": i,
                "reward/mean": 0.1 * i,
                "acc/mean": 0.5,
                "rollout_corr/k3_kl": kl,
                "response_length/mean": 14.0,
                "perf/step_s": 2.0,
                "perf/rollout_s": 1.0,
                "perf/train_s": 0.8,
                "perf/sync_s": 0.2,
            }
        )
    recs[-1]["val-core/synthetic/arith/acc/mean@8"] = 0.7
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def test_verdict_inside_and_outside_the_budget(tmp_path):
    ok, text = kl_verdict(load_run(_run(tmp_path, "good", [1e-4, 2e-4, 1.5e-4])))
    assert ok and "INSIDE" in text and "max 2.00e-04 (step 2)" in text
    ok, text = kl_verdict(load_run(_run(tmp_path, "bad", [1e-4, 5e-3, 2e-3])))
    assert not ok and "OUTSIDE" in text and "exceeded at steps [2, 3]" in text


def test_report_for_two_runs_side_by_side(tmp_path):
    a = _run(tmp_path, "r3_on", [1e-4, 1e-4])
    b = _run(tmp_path, "r3_off", [4e-3, 6e-3])
    path = write_report([a, b], tmp_path / "cmp")
    text = path.read_text()
    first = text.splitlines()[2:4]
    assert first[0].startswith("- OK: r3_on") and first[1].startswith("- FAIL: r3_off")
    assert "| r3_on | 2 |" in text and "0.7" in text
    pngs = sorted(p.name for p in (tmp_path / "cmp").glob("*.png"))
    assert pngs == [
        "accuracy.png",
        "eval.png",
        "k3_kl.png",
        "response_length.png",
        "reward.png",
        "step_time.png",
    ]
    assert all((tmp_path / "cmp" / p).stat().st_size > 5000 for p in pngs)


def test_report_cli_names_a_directory_that_is_not_a_run(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err


def test_report_requires_a_run():
    with pytest.raises(ValueError, match="at least one run directory"):
        write_report([])


def _legends(monkeypatch) -> dict[str, list[str]]:
    """The legend texts of every plot make_plots saves, by file name, read from the figure just before
    matplotlib's own savefig writes it."""
    from matplotlib.figure import Figure

    seen: dict[str, list[str]] = {}
    real = Figure.savefig

    def savefig(fig, path, *args, **kwargs):
        legend = fig.axes[0].get_legend()
        name = Path(path).name.removeprefix(".").removesuffix(".tmp")  # written aside, then renamed
        seen[name] = [t.get_text() for t in legend.get_texts()] if legend else []
        return real(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return seen


def test_runs_of_one_name_are_labelled_by_their_directories(tmp_path, monkeypatch):
    """Two runs of the default name side by side (and a third of its own name): the table, the verdicts,
    the eval lines, the legends and the default output directory tell them apart by directory."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = _run(tmp_path / "a", "demo_cpu", [1e-4, 1e-4])
    b = _run(tmp_path / "b", "demo_cpu", [4e-3, 6e-3])
    c = _run(tmp_path, "other", [1e-4, 2e-4])
    legends = _legends(monkeypatch)
    monkeypatch.chdir(tmp_path)
    path = write_report([a, b, c])
    assert path == Path("reports") / "a_demo_cpu_vs_b_demo_cpu_vs_other" / "report.md"
    text = path.read_text()
    assert text.splitlines()[0] == "# sparkrl report: a/demo_cpu, b/demo_cpu, other"
    assert "- OK: a/demo_cpu: KL drift" in text and "- FAIL: b/demo_cpu: KL drift" in text
    assert "| a/demo_cpu | 2 |" in text and "| b/demo_cpu | 2 |" in text and "| other | 2 |" in text
    assert "- a/demo_cpu val-core/synthetic/arith/acc/mean@8: step 0: 0.400" in text
    assert legends["reward.png"] == ["a/demo_cpu", "b/demo_cpu", "other"]
    assert legends["step_time.png"] == ["a/demo_cpu", "b/demo_cpu", "other"]
    assert legends["eval.png"] == ["a/demo_cpu: synthetic", "b/demo_cpu: synthetic", "other: synthetic"]
    # A unique name stays as it is, also for a single run.
    assert write_report([a], tmp_path / "one").read_text().startswith("# sparkrl report: demo_cpu\n")


def test_labels_are_the_shortest_distinct_endings_of_the_directories(tmp_path):
    def runs(*specs):
        return [{"name": name, "dir": tmp_path / d} for name, d in specs]

    # Directory names differ: the name of the directory alone.
    assert run_labels(runs(("demo", "x"), ("demo", "y"))) == ["x", "y"]
    # Same directory name under different parents: as much of the path as sets them apart.
    assert run_labels(runs(("demo", "p/a/x"), ("demo", "q/a/x"), ("demo", "r/b/y"))) == [
        "p/a/x",
        "q/a/x",
        "y",
    ]
    # A run of its own name keeps it; a directory ending that equals it is lengthened instead.
    assert run_labels(runs(("x", "runs/x"), ("demo", "p/x"), ("demo", "q/z"))) == ["x", "p/x", "z"]
    # The same directory twice is numbered.
    assert run_labels(runs(("demo", "x"), ("demo", "x"), ("solo", "s"))) == [
        str(tmp_path / "x"),
        f"{tmp_path / 'x'} (2)",
        "solo",
    ]


def _rollouts(run_dir, steps, per_step=6):
    """rollouts/step_<N>.jsonl as the driver writes them: sample i of a step has reward i / (per_step - 1)
    and response `resp-<step>-<i>`."""
    (run_dir / "rollouts").mkdir()
    for step in steps:
        rows = [
            {
                "step": step,
                "group": i // 3,
                "index": i,
                "data_source": "synthetic/arith",
                "prompt": f"prompt-{step}-{i}: what is 2 + 3?",
                "response": f"resp-{step}-{i}\nAnswer: {i}",
                "ground_truth": "5",
                "reward": i / (per_step - 1),
                "acc": i == per_step - 1,
                "pred": str(i),
                "response_length": 12 + i,
                "finish_reason": "stop",
                "k3_kl": 1e-6 * i,
                "adapter_version": step - 1,
            }
            for i in range(per_step)
        ]
        (run_dir / "rollouts" / f"step_{step}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_report_shows_the_best_and_worst_samples_of_a_few_steps(tmp_path):
    d = _run(tmp_path, "samples", [1e-4] * 10)
    _rollouts(d, range(1, 11))
    # A long response containing a code fence, and a file cut short by a killed run.
    rows = [json.loads(x) for x in (d / "rollouts" / "step_10.jsonl").read_text().splitlines()]
    rows[5]["response"] = "```python\nprint(5)\n```" + "x" * 5000 + "\nAnswer: 5"
    (d / "rollouts" / "step_10.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 10, "resp'
    )
    text = write_report([d]).read_text()
    section = text.split("## Rollout samples", 1)[1]
    steps = [int(m) for m in re.findall(r"^\*\*step (\d+)\*\*", section, re.M)]
    assert steps == [1, 4, 7, 10]  # four of the ten, the first and the last among them
    assert "**step 10**: 6 samples kept, reward mean 0.5" in section  # the broken last line left out
    assert "\n\n\n" not in section
    step4 = section.split("**step 4**", 1)[1].split("**step 7**", 1)[0]
    shown = re.findall(r"response: resp-4-(\d)", step4)
    assert shown == ["5", "4", "1", "0"]  # the two best, then the two worst
    assert "- reward 1, acc 1, pred `5`, ground truth `5`, 17 tokens (stop), k3 KL 5.00e-06" in step4
    step10 = section.split("**step 10**", 1)[1]
    assert max(len(x) for x in re.findall("x+", step10)) < 600  # cut to about ROLLOUT_RESPONSE_CHARS
    assert re.search(r"\[\.\.\. \d+ cut \.\.\.\]", step10)
    assert "\n````text\n" in step10  # a fence longer than the response's own
    assert "Answer: 5\n````" in step10  # the end of a cut response, where the answer is, is kept


def test_report_without_rollouts_has_no_samples_section(tmp_path):
    d = _run(tmp_path, "plain", [1e-4])
    assert "Rollout samples" not in write_report([d]).read_text()
    (d / "rollouts").mkdir()  # present but empty
    assert "Rollout samples" not in write_report([d]).read_text()
