"""MetricsLogger's trackers besides metrics.jsonl: TensorBoard and MLflow written for real and read back
(TensorBoard's EventAccumulator, MLflow's client on a `file:` store in a temp directory), W&B through a
stand-in module, and the one-line error for a tracker whose package is missing."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import types

import pytest

from rl.config import LoggingConfig, load_config
from rl.metrics import (
    ROLLOUT_COLUMNS,
    TRACKER_ROWS,
    MetricsLogger,
    TrackerMissing,
    mlflow_key,
    tracker_problems,
)


def _rows(step: int, n: int = 40) -> list[dict]:
    """A step's rollouts/step_<N>.jsonl rows: sample i has reward i / (n - 1); sample 7's response is long
    and holds the characters a Markdown table breaks on."""
    rows = []
    for i in range(n):
        response = f"resp-{i} | a*b_c <tag> `code`\nAnswer: {i}"
        if i == 7:
            response = "start " + "y" * 3000 + " Answer: 7"
        rows.append(
            {
                "step": step,
                "group": i // 8,
                "index": i,
                "data_source": "synthetic/arith",
                "prompt": f"prompt-{i}",
                "response": response,
                "ground_truth": "5",
                "reward": i / (n - 1),
                "acc": i == n - 1,
                "pred": str(i),
                "response_length": 10 + i,
                "finish_reason": "stop",
                "k3_kl": None if i == 3 else 1e-6 * i,
                "adapter_version": step - 1,
            }
        )
    return rows


def _cells(line: str) -> list[str]:
    """A Markdown table row's cells, split at the pipes that are not escaped."""
    return re.split(r"(?<!\\)\|", line.strip())[1:-1]


def test_tensorboard_gets_the_step_metrics_and_a_bounded_table_of_rollouts(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(tmp_path, total_steps=2, tensorboard=True)
    log.log_rollouts(1, _rows(1))
    log.log(1, {"reward/mean": 0.5})
    log.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.5)]
    (text,) = events.Tensors("rollouts/text_summary")
    assert text.step == 1
    lines = text.tensor_proto.string_val[0].decode().splitlines()
    assert _cells(lines[0]) == [f" {c} " for c in ROLLOUT_COLUMNS]
    body = lines[2:]
    assert len(body) == TRACKER_ROWS  # of 40
    assert all(len(_cells(line)) == len(ROLLOUT_COLUMNS) for line in body)  # `|` in a response escaped
    col = {c: i for i, c in enumerate(ROLLOUT_COLUMNS)}
    indices = [int(_cells(line)[col["index"]]) for line in body]
    assert indices == [*range(39, 31, -1), *range(7, -1, -1)]  # the 8 best rewards, then the 8 worst
    response = {int(_cells(line)[col["index"]]): _cells(line)[col["response"]] for line in body}
    assert response[39].strip() == r"resp-39 \| a\*b\_c &lt;tag&gt; \`code\`<br>Answer: 39"
    assert (
        len(response[7]) < 600 and "cut ...\\]" in response[7] and response[7].strip().endswith("Answer: 7")
    )
    assert _cells(body[-1])[col["k3_kl"]].strip() == "0"  # sample 0; sample 3's None is an empty cell
    assert _cells(body[-4])[col["k3_kl"]].strip() == ""


def test_wandb_gets_a_table_of_rollouts_at_the_step(tmp_path, monkeypatch):
    """wandb is not a dependency of the tests (its runs need an account or its offline files, which have no
    reader here): a stand-in `wandb` module records what MetricsLogger hands to it."""
    calls = []

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    class Run:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Table=Table))
    log = MetricsLogger(tmp_path, total_steps=2, tensorboard=False, wandb_project="p", run_name="a/b=1")
    log.log_rollouts(2, _rows(2))
    log.close()
    run_id = calls[0][1]["id"]
    assert re.fullmatch(r"a_b_1-[0-9a-f]{8}", run_id) and calls[0][1]["resume"] == "allow"
    (_, data, step) = calls[1]
    table = data["rollouts"]
    assert step == 2 and table.columns == list(ROLLOUT_COLUMNS) and len(table.data) == TRACKER_ROWS
    assert max(len(row[table.columns.index("response")]) for row in table.data) < 600
    assert calls[-1] == ("finish",)
    # resumed in its directory: the same W&B run; the same run.name in another directory: a new one
    calls.clear()
    MetricsLogger(tmp_path, 2, start_step=1, tensorboard=False, wandb_project="p", run_name="a/b=1").close()
    other = tmp_path / "other"
    other.mkdir()
    MetricsLogger(other, 2, tensorboard=False, wandb_project="p", run_name="a/b=1").close()
    inits = [c[1]["id"] for c in calls if c[0] == "init"]
    assert inits[0] == run_id and inits[1] != run_id and inits[1].startswith("a_b_1-")


def test_a_tracker_without_its_package_is_one_line_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow fails, as where it is not installed
    monkeypatch.setitem(sys.modules, "wandb", None)
    problems = tracker_problems(LoggingConfig(mlflow_tracking_uri="http://host:5000", wandb_project="p"))
    assert problems == [
        "logging.wandb_project is set but wandb is not installed: pip install wandb "
        "(or set logging.wandb_project= to turn it off)",
        "logging.mlflow_tracking_uri is set but mlflow is not installed: pip install mlflow "
        "(or set logging.mlflow_tracking_uri= to turn it off)",
    ]
    assert tracker_problems(LoggingConfig()) == []
    from rl.config import load_config
    from rl.preflight import PreflightError, preflight

    cfg = load_config("demo_cpu", ["run.name=t", "logging.mlflow_tracking_uri=http://host:5000"])
    with pytest.raises(
        PreflightError, match=r"(?m)^logging\.mlflow_tracking_uri is set .* pip install mlflow"
    ):
        preflight(cfg)  # before Ray starts
    with pytest.raises(TrackerMissing) as e:
        MetricsLogger(tmp_path, 2, tensorboard=False, mlflow_tracking_uri="http://host:5000")
    assert "\n" not in str(e.value) and "logging.mlflow_tracking_uri" in str(e.value)
    assert isinstance(e.value, ValueError)  # the CLI prints a ValueError as one line, no traceback


def test_mlflow_key_keeps_names_mlflow_allows():
    assert mlflow_key("val-core/synthetic/arith/acc/mean@8") == "val-core/synthetic/arith/acc/mean_at_8"
    assert mlflow_key("rollout_corr/abs_logp_diff_p50") == "rollout_corr/abs_logp_diff_p50"
    assert mlflow_key("a=b,c") == "a_b_c"


# ----------------------------------------------------------------------------------------------------
# MLflow, for real on a file store
# ----------------------------------------------------------------------------------------------------


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    # MLflow 3 refuses its file store unless asked for it; a file store needs no server for the test.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return f"file:{tmp_path / 'mlruns'}"


def _config(**over) -> dict:
    cfg = load_config("demo_cpu", ["run.name=mlrun", *(f"{k}={v}" for k, v in over.items())])
    return dataclasses.asdict(cfg)


def _logger(run_dir, uri, start_step=0, config=None):
    return MetricsLogger(
        run_dir,
        4,
        start_step,
        tensorboard=False,
        run_name="mlrun",
        config=config or _config(),
        mlflow_tracking_uri=uri,
    )


def test_mlflow_gets_params_metrics_and_rollouts_and_a_resume_continues_its_run(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = _logger(run_dir, mlflow_store)
    for step in (1, 2):
        log.log(step, {"reward/mean": 0.1 * step, "actor/grad_norm": float("nan")})
    log.log(2, {"val-core/synthetic/arith/acc/mean@8": 0.6})
    log.log_rollouts(2, _rows(2))
    log.close()

    client = MlflowClient(tracking_uri=mlflow_store)
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "mlrun"
    assert client.get_experiment(run.info.experiment_id).name == "sparkrl"
    params = run.data.params
    assert params["trainer.lr"] == "0.004" and params["trainer.total_steps"] == "25"
    assert params["lora.target_modules"] == json.dumps(["q_proj", "k_proj", "v_proj", "o_proj"])
    assert params["data.train"] == "synthetic:arith" and len(params) > 100  # more than one batch of params
    history = client.get_metric_history(run_id, "reward/mean")
    assert [(m.step, round(m.value, 6)) for m in history] == [(1, 0.1), (2, 0.2)]
    assert math.isnan(client.get_metric_history(run_id, "actor/grad_norm")[0].value)
    assert client.get_metric_history(run_id, "val-core/synthetic/arith/acc/mean_at_8")[0].value == 0.6
    table = json.loads(_artifact(client, run_id, tmp_path / "download"))
    assert table["columns"] == list(ROLLOUT_COLUMNS) and len(table["data"]) == TRACKER_ROWS

    # --resume from the checkpoint at step 1, with trainer.total_steps raised (as a resume may): the same
    # MLflow run goes on, its params as first logged.
    log = _logger(run_dir, mlflow_store, start_step=1, config=_config(**{"trainer.total_steps": 40}))
    assert (run_dir / "mlflow_run_id").read_text().strip() == run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    log.log(2, {"reward/mean": 0.25})
    log.log(3, {"reward/mean": 0.3})
    log.close()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["trainer.total_steps"] == "25"
    assert run.data.tags["sparkrl.resumed_at_step"] == "1"
    steps = [m.step for m in client.get_metric_history(run_id, "reward/mean")]
    assert sorted(steps) == [1, 2, 2, 3]  # MLflow keeps the point of step 2 logged before the stop
    assert len(client.search_runs([run.info.experiment_id])) == 1


def _artifact(client, run_id, tmp_path) -> str:
    (path,) = [a.path for a in client.list_artifacts(run_id, "rollouts")]
    assert path == "rollouts/step_2.json"
    local = client.download_artifacts(run_id, path, str(tmp_path))
    with open(local) as f:
        return f.read()


def test_mlflow_run_of_a_failed_step_is_marked_failed(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    log = _logger(tmp_path, mlflow_store)
    with pytest.raises(RuntimeError):
        try:
            log.log(1, {"reward/mean": 0.1})
            raise RuntimeError("a rank died")
        finally:
            log.close()  # as in the driver's `finally`
    run_id = (tmp_path / "mlflow_run_id").read_text().strip()
    assert MlflowClient(tracking_uri=mlflow_store).get_run(run_id).info.status == "FAILED"


def test_mlflow_run_id_of_another_store_starts_a_new_run(tmp_path, mlflow_store):
    """A run directory copied to where another tracking store is configured: its old id is not there, so
    a new MLflow run begins (and its id replaces the old one)."""
    (tmp_path / "mlflow_run_id").write_text("0123456789abcdef0123456789abcdef\n")
    log = _logger(tmp_path, mlflow_store)
    log.close()
    run_id = (tmp_path / "mlflow_run_id").read_text().strip()
    assert run_id != "0123456789abcdef0123456789abcdef"
    assert not list(tmp_path.glob(".mlflow_run_id*"))  # the temporary file was renamed into place
