"""The preflight before Ray starts, the cluster check, and the CLI's run directory: what a new user meets first."""

from __future__ import annotations

import json
import shutil
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl.cli import _check_resume_config, absolute_run_dir, build_parser, load_target, main, parse_args
from rl.config import load_config, run_dir, save_config
from rl.preflight import ClusterInfo, PreflightError, check_cluster, is_moe, preflight

DEMO = ["logging.tensorboard=false"]


def _cfg(*overrides):
    return load_config("demo_cpu", [*DEMO, *overrides])


def _one_line_error(capsys, argv) -> str:
    t = time.monotonic()
    assert main(argv) == 2
    took = time.monotonic() - t
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err, took


def test_a_missing_model_path_is_one_line_before_any_ray(capsys):
    import ray

    err, took = _one_line_error(
        capsys, ["train", "demo_cpu", "model.make_tiny.arch=", "model.path=/tmp/does/not/exist"]
    )
    assert err == (
        "sparkrl train: error: model.path: /tmp/does/not/exist: no such directory "
        "(nor a Hugging Face hub id owner/name)"
    )
    assert not ray.is_initialized() and took < 10


def test_a_dense_model_with_expert_targets_names_the_keys(tiny_dense_path):
    base = ["model.make_tiny.arch=", f"model.path={tiny_dense_path}", "sync.mode=adapter"]
    with pytest.raises(PreflightError) as e:
        preflight(_cfg(*base))
    assert [p.split(":")[0] for p in e.value.problems] == ["lora.target_experts", "r3.enabled"]
    assert "set lora.target_experts=false" in e.value.problems[0]
    assert "Qwen3ForCausalLM" in e.value.problems[0]
    preflight(_cfg(*base, "lora.target_experts=false", "r3.enabled=false"))  # now nothing to say


def test_moe_models_pass_the_expert_check(tiny_moe_path):
    assert is_moe(json.loads((tiny_moe_path / "config.json").read_text()))
    preflight(_cfg("model.make_tiny.arch=", f"model.path={tiny_moe_path}"))


def test_a_model_directory_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(PreflightError, match=f"model.path: {tmp_path} has no config.json"):
        preflight(_cfg("model.make_tiny.arch=", f"model.path={tmp_path}"))


def test_data_files_are_parsed_with_their_columns(tmp_path):
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["1+1?"], "answer": ["2"]}), bad)
    with pytest.raises(PreflightError) as e:
        preflight(_cfg(f"data.train={bad}"))
    assert e.value.problems[0].startswith(f"data.train: {bad}: no prompt column")
    with pytest.raises(PreflightError, match=r"^data.train: prompt source '/nope/x.parquet': no such file"):
        preflight(_cfg("data.train=/nope/x.parquet"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": [')
    with pytest.raises(PreflightError, match=f"^eval.data: {broken}"):
        preflight(_cfg(f"eval.data={broken}"))


def test_eval_data_is_not_checked_when_eval_is_off():
    preflight(_cfg("eval.data=/nope/aime.parquet", "eval.every=0"))
    with pytest.raises(PreflightError, match="eval.data"):
        preflight(_cfg("eval.data=/nope/aime.parquet"))


def test_a_missing_adapter_is_named(tmp_path):
    with pytest.raises(PreflightError, match=f"--adapter: {tmp_path} has no adapter_config.json"):
        preflight(_cfg(), adapter=tmp_path, train=False, evaluate=True)


def test_cluster_short_of_cpu_slots_gpus_or_nodes():
    cfg = _cfg()  # 2 trainer ranks + 1 rollout engine, one CPU slot each
    check_cluster(cfg, ClusterInfo(cpus=3, gpus=0, nodes=1))
    with pytest.raises(PreflightError) as e:
        check_cluster(cfg, ClusterInfo(cpus=1, gpus=0, nodes=1, address="10.0.0.1:6379"))
    (line,) = e.value.problems
    assert line.startswith("trainer.num_ranks: the run's workers need 3 CPU slots, but the Ray cluster at ")
    assert "has 1 CPU slots, 0 GPUs on 1 node(s)" in line and "rollout.num_workers (1)" in line

    gpu = _cfg("resources.num_gpus=8", "resources.nodes=2", "resources.gpus_per_node=4")
    with pytest.raises(PreflightError) as e:
        check_cluster(gpu, ClusterInfo(cpus=64, gpus=1, nodes=1))
    assert [p.split(":")[0] for p in e.value.problems] == ["resources.num_gpus", "resources.nodes"]
    assert "needs 2 GPUs" in e.value.problems[0]  # colocated: one GPU per trainer rank


def _finished_run(tmp_path, name="r"):
    cfg = _cfg(f"run.name={name}", f"run.dir={tmp_path / name}")
    save_config(cfg, tmp_path / name / "config.yaml")
    return tmp_path / name


def test_the_named_run_directory_is_the_run_even_moved(tmp_path, monkeypatch):
    moved = tmp_path / "elsewhere" / "r2"
    moved.parent.mkdir()
    shutil.move(_finished_run(tmp_path), moved)
    monkeypatch.chdir(tmp_path / "elsewhere")
    cfg = load_target("r2", ["trainer.total_steps=8"])
    assert run_dir(cfg) == moved and cfg.trainer.total_steps == 8
    _check_resume_config(cfg, absolute_run_dir(cfg))  # a moved run resumes: run.dir may differ
    with pytest.raises(ValueError, match=r"trainer.lr: 0.004 -> 0.1"):
        _check_resume_config(load_target(str(moved), ["trainer.lr=0.1"]), moved)


def test_eval_of_a_run_directory_records_under_it(tmp_path, monkeypatch):
    from rl.checkpoint import save_checkpoint
    from rl.eval_run import resolve_target

    rdir = _finished_run(tmp_path)
    save_checkpoint(rdir, 3, {"step": 3}, lambda d: (d.mkdir(), (d / "adapter_config.json").write_text("{}")))
    copy = tmp_path / "copy"
    shutil.copytree(rdir, copy)
    monkeypatch.chdir(tmp_path / "r")  # any cwd, even the original run's
    cfg, adapter = resolve_target(str(copy), [], None)
    assert adapter == copy / "checkpoints" / "step_3" / "trainer"
    assert run_dir(cfg) == copy  # eval/ records go to the copy, not to ./runs/<name>


def test_report_of_a_run_directory_from_another_cwd(tmp_path, monkeypatch):
    rdir = _finished_run(tmp_path)
    (rdir / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout_corr/k3_kl": 1e-5}) + "\n")
    monkeypatch.chdir(tmp_path.parent)
    assert main(["report", str(rdir)]) == 0
    assert (rdir / "report" / "report.md").is_file()


def test_options_and_overrides_in_any_order():
    parser = build_parser()
    for argv in (
        ["train", "RUN", "--resume", "trainer.total_steps=8", "a.b=1"],
        ["train", "RUN", "trainer.total_steps=8", "--resume", "a.b=1"],
    ):
        args = parse_args(parser, argv)
        assert args.resume and args.recipe == "RUN" and args.overrides == ["trainer.total_steps=8", "a.b=1"]
    args = parse_args(parser, ["eval", "RUN", "--adapter", "A", "eval.k=2"])
    assert args.adapter == "A" and args.overrides == ["eval.k=2"]
    with pytest.raises(SystemExit):
        parse_args(parser, ["train", "RUN", "--frobnicate"])


def test_inside_a_ray_job_a_relative_run_dir_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"metadata": {"job_submission_id": "j-1"}}))
    with pytest.raises(ValueError, match=r"^run.dir: runs/demo_cpu is relative, .* the Ray job j-1"):
        absolute_run_dir(_cfg())
    cfg = _cfg(f"run.dir={tmp_path / 'abs'}")
    assert absolute_run_dir(cfg) == tmp_path / "abs"
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")
    monkeypatch.chdir(tmp_path)
    cfg = _cfg()
    assert absolute_run_dir(cfg) == tmp_path / "runs" / "demo_cpu" and cfg.run.dir == str(
        tmp_path / "runs/demo_cpu"
    )


def test_version(capsys):
    from rl import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"sparkrl {__version__}"


def test_submit_of_a_moved_run_directory_resumes_it_where_it_lies(tmp_path):
    from rl.submit import train_command

    moved = tmp_path / "moved"
    shutil.move(_finished_run(tmp_path), moved)
    cmd = train_command(str(moved), ["trainer.total_steps=9"], working_dir=None, resume=True)
    assert cmd.run_dir == moved
    assert cmd.argv[-2:] == [f"run.dir={moved}", "--resume"] and "trainer.total_steps=9" in cmd.argv
