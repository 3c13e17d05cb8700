"""The preflight before Ray starts, the cluster check, and the CLI's run directory: what a new user meets first."""

from __future__ import annotations

import hashlib
import http.server
import json
import shutil
import socket
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl.cli import _check_resume_config, build_parser, main, parse_args
from rl.config import load_config, run_dir, save_config
from rl.data.problems import MAX_LISTED
from rl.preflight import HUB_TIMEOUT_S, ClusterInfo, Hub, PreflightError, check_cluster, is_moe, preflight
from rl.target import absolute_run_dir, load_target

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


def test_a_dense_model_passes_with_the_moe_defaults(tiny_dense_path):
    """lora.target_experts and r3.enabled (both on by default) have nothing to act on in a dense model: the
    run goes ahead as it is (tests/integration/test_train_runs.py trains one so)."""
    base = ["model.make_tiny.arch=", f"model.path={tiny_dense_path}", "sync.mode=adapter"]
    cfg = _cfg(*base)
    assert cfg.lora.target_experts and cfg.r3.enabled
    preflight(cfg)


def test_moe_models_pass_the_expert_check(tiny_moe_path):
    assert is_moe(json.loads((tiny_moe_path / "config.json").read_text()))
    preflight(_cfg("model.make_tiny.arch=", f"model.path={tiny_moe_path}"))


def _checkpoint(directory: Path, config: dict) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(b"")
    return directory


def test_a_moe_model_whose_router_no_family_knows_is_refused_with_r3(tmp_path):
    """Not a run that trains without routing replay and says so only by r3/replayed_fraction 0."""
    model = _checkpoint(
        tmp_path / "unknown-moe",
        {"model_type": "unknown_moe", "architectures": ["UnknownMoeForCausalLM"], "num_local_experts": 8},
    )
    base = ["model.make_tiny.arch=", f"model.path={model}"]
    with pytest.raises(PreflightError) as e:
        preflight(_cfg(*base))
    assert e.value.problems == [
        f"r3.enabled: {model} (UnknownMoeForCausalLM) is a mixture-of-experts model of model_type "
        "'unknown_moe', and no family in rl/models/ claims it, so its routing cannot be replayed; set "
        "r3.enabled=false to train without routing replay, or add rl/models/unknown_moe/ with its router "
        "adapter (docs/design.md, Models)"
    ]
    preflight(_cfg(*base, "r3.enabled=false"))  # the way out
    preflight(_cfg(*base), train=False)  # evaluation replays nothing

    # A family that is known but brings no router adapter for its MoE model is refused the same way.
    known = _checkpoint(tmp_path / "qwen3-moe-like", {"model_type": "qwen3", "num_experts": 8})
    with pytest.raises(PreflightError) as e:
        preflight(_cfg("model.make_tiny.arch=", f"model.path={known}"))
    assert [p.split(":")[0] for p in e.value.problems] == ["r3.enabled"]
    assert "its family, rl/models/qwen3/, has no router adapter" in e.value.problems[0]
    assert "add its router adapter to rl/models/qwen3/" in e.value.problems[0]


def test_a_model_directory_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(PreflightError, match=f"model.path: {tmp_path} has no config.json"):
        preflight(_cfg("model.make_tiny.arch=", f"model.path={tmp_path}"))


def test_a_model_directory_missing_a_shard_its_index_lists(tmp_path, tiny_moe_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_moe_path, model)
    (weights,) = model.glob("*.safetensors")
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weights.rename(model / shards[0])
    index = {"metadata": {}, "weight_map": {"a.weight": shards[0], "b.weight": shards[1]}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PreflightError) as e:
        preflight(_cfg("model.make_tiny.arch=", f"model.path={model}"))
    assert e.value.problems == [
        f"model.path: {model} lacks 1 of the 2 weight files its model.safetensors.index.json lists ({shards[1]})"
    ]


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


def test_every_bad_row_of_a_data_file_is_a_line_naming_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.parquet"
    answers = [None if n % 2 else str(n) for n in range(1, 2 * MAX_LISTED + 7)]  # odd rows: null answers
    pq.write_table(pa.table({"problem": [f"q{n}" for n in range(len(answers))], "answer": answers}), bad)
    with pytest.raises(PreflightError) as e:
        preflight(_cfg(f"data.train={bad}"))
    lines = e.value.problems
    assert lines[0].startswith(
        f"data.train: {bad}: {MAX_LISTED + 3} problems (row N is the file's N-th record"
    )
    assert lines[1:4] == [
        f"data.train: {bad}: row {n}: column 'answer': empty (null); expected the answer" for n in (1, 3, 5)
    ]
    assert (
        len(lines) == MAX_LISTED + 2
        and lines[-1] == f"data.train: {bad}: and 3 more (the first {MAX_LISTED} are listed)"
    )
    err, _ = _one_line_error(capsys, ["train", "demo_cpu", *DEMO, f"data.train={bad}"])
    assert err.splitlines() == [f"sparkrl train: error: {lines[0]}", *lines[1:]]


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


# Hub ids: the local caches, else the hub must answer ------------------------------------------------


@pytest.fixture
def hf_env(tmp_path, monkeypatch):
    """An empty HF_HOME, no offline flags, and HF_ENDPOINT at a local port nothing listens on."""
    for name in (
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_DATASETS_CACHE",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_DATASETS_OFFLINE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with socket.socket() as s:  # a port just freed: connecting to it is refused
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", closed)
    return tmp_path / "hf", closed


@pytest.fixture
def answering_hub(monkeypatch):
    """A local endpoint answering the hub's repo-info routes; HF_ENDPOINT points at it. Yields the paths asked."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            asked.append(self.path)
            body = json.dumps({"id": self.path.split("/", 3)[-1], "sha": "0" * 40}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield asked
    server.shutdown()
    server.server_close()


def _timed_problems(cfg) -> tuple[list[str], float]:
    t = time.monotonic()
    with pytest.raises(PreflightError) as e:
        preflight(cfg)
    return e.value.problems, time.monotonic() - t


def test_an_uncached_hub_model_without_the_hub_is_one_line_in_seconds(hf_env, capsys):
    import ray

    home, endpoint = hf_env
    err, _ = _one_line_error(
        capsys, ["train", "demo_cpu", *DEMO, "model.make_tiny.arch=", "model.path=Qwen/Qwen3-30B-A3B"]
    )
    prefix = (
        f"sparkrl train: error: model.path: Qwen/Qwen3-30B-A3B is no local directory, nor in the local Hugging "
        f"Face cache ({home / 'hub'}), and the hub at {endpoint} cannot be reached ("
    )
    assert err.startswith(prefix) and "\n" not in err
    assert err.endswith(
        "); download it first (hf download Qwen/Qwen3-30B-A3B) or set model.path to a local checkpoint directory"
    )
    assert not ray.is_initialized()
    # The preflight itself: one refused connection, nowhere near the run's minutes of retries.
    problems, took = _timed_problems(_cfg("model.make_tiny.arch=", "model.path=Qwen/Qwen3-30B-A3B"))
    assert [p.split(":")[0] for p in problems] == ["model.path"] and took < HUB_TIMEOUT_S


def test_uncached_hub_datasets_without_the_hub_name_their_keys(hf_env):
    home, endpoint = hf_env
    cfg = _cfg(
        "data.train=BytedTsinghua-SIA/DAPO-Math-17k", "eval.data=hf:BytedTsinghua-SIA/AIME-2024?split=train"
    )
    problems, took = _timed_problems(cfg)
    assert took < HUB_TIMEOUT_S
    assert [p.split(":")[0] for p in problems] == ["data.train", "eval.data"]
    assert problems[0].startswith(
        f"data.train: BytedTsinghua-SIA/DAPO-Math-17k is no local file or directory, nor in the local datasets "
        f"cache ({home / 'datasets'}), and the hub at {endpoint} cannot be reached ("
    )
    assert problems[1].endswith(
        "download it first (hf download BytedTsinghua-SIA/AIME-2024 --repo-type dataset --local-dir DIR) and set "
        "eval.data=DIR (or one of its parquet files)"
    )


def test_offline_means_the_cache_or_an_error_and_no_request(hf_env, answering_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    problems, _ = _timed_problems(
        _cfg(
            "model.make_tiny.arch=",
            "model.path=Qwen/Qwen3-30B-A3B",
            "data.train=BytedTsinghua-SIA/DAPO-Math-17k",
        )
    )
    assert [p.split(":")[0] for p in problems] == ["model.path", "data.train"]
    assert all(", and HF_HUB_OFFLINE is set; download it first (hf download " in p for p in problems)
    assert answering_hub == []
    # datasets' own switch wins for datasets, as in `datasets`
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    preflight(_cfg("data.train=BytedTsinghua-SIA/DAPO-Math-17k"))
    assert answering_hub == ["/api/datasets/BytedTsinghua-SIA/DAPO-Math-17k"]


def test_with_the_hub_answering_uncached_ids_pass_as_before(hf_env, answering_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # set, but not true: huggingface_hub goes online
    preflight(
        _cfg(
            "model.make_tiny.arch=",
            "model.path=Qwen/Qwen3-30B-A3B",
            "model.rollout_path=RedHatAI/Qwen3-30B-A3B-NVFP4",
            "data.train=BytedTsinghua-SIA/DAPO-Math-17k",
            "eval.data=BytedTsinghua-SIA/AIME-2024",
        )
    )
    assert answering_hub == ["/api/models/Qwen/Qwen3-30B-A3B"]  # asked once for all four ids


def test_a_hub_that_accepts_but_never_answers_is_given_up_on_time():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()  # connections complete in the backlog; nothing ever reads or answers them
        hub = Hub(timeout_s=0.5)
        hub.endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
        t = time.monotonic()
        reason = hub.unreachable("models", "owner/name")
        took = time.monotonic() - t
    assert reason.startswith(f"the hub at {hub.endpoint} cannot be reached (") and took < 2


def _cache_model(hub_cache: Path, repo_id: str, source: Path) -> Path:
    """`source`'s files as huggingface_hub lays a download out: blobs named by content hash, a snapshot
    directory of links to them, and refs/main naming the snapshot's commit."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(p for p in source.iterdir() if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def test_a_cached_hub_model_passes_without_the_hub(hf_env, tiny_moe_path):
    from huggingface_hub import snapshot_download

    home, _ = hf_env
    snapshot = _cache_model(home / "hub", "sparkrl-test/tiny-moe", tiny_moe_path)
    # huggingface_hub itself finds the snapshot there, without the network: the layout is the real one.
    found = snapshot_download("sparkrl-test/tiny-moe", cache_dir=home / "hub", local_files_only=True)
    assert Path(found) == snapshot
    cfg = _cfg("model.make_tiny.arch=", "model.path=sparkrl-test/tiny-moe")
    preflight(cfg)

    # Half a download (no weights yet) is no use offline.
    for weights in snapshot.glob("*.safetensors"):
        weights.unlink()
    problems, _ = _timed_problems(cfg)
    assert len(problems) == 1 and problems[0].startswith(
        f"model.path: sparkrl-test/tiny-moe is no local directory, and only partly in the local Hugging Face "
        f"cache: {snapshot} holds no weight files"
    )


def _cache_dataset(
    datasets_cache: Path, repo_id: str, table: pa.Table, split: str = "train", config: str = "default"
) -> Path:
    """`table` as datasets prepares a hub dataset: `<owner>___<name>/<config>/<version>/<hash>/` holding
    `<name>-<split>.arrow` and dataset_info.json, written with datasets' own writers."""
    import datasets
    from datasets.arrow_writer import ArrowWriter
    from datasets.naming import camelcase_to_snakecase

    owner, name = repo_id.split("/")
    name = camelcase_to_snakecase(name)
    directory = datasets_cache / f"{owner}___{name}" / config / "0.0.0" / "0123456789abcdef"
    directory.mkdir(parents=True)
    features = datasets.Dataset(datasets.table.InMemoryTable(table)).features
    with ArrowWriter(features=features, path=str(directory / f"{name}-{split}.arrow")) as writer:
        writer.write_table(table)
        rows, size = writer.finalize()
    split_info = datasets.SplitInfo(split, num_bytes=size, num_examples=rows, dataset_name=name)
    datasets.DatasetInfo(
        features=features,
        config_name=config,
        dataset_name=name,
        splits=datasets.SplitDict({split: split_info}),
    ).write_to_directory(str(directory))
    return directory


def test_a_cached_hub_dataset_passes_without_the_hub(hf_env, monkeypatch):
    import datasets

    from rl.data.sources import load_source

    home, _ = hf_env
    table = pq.read_table(Path(__file__).resolve().parent.parent / "data" / "bytedtsinghua_aime_2024.parquet")
    _cache_dataset(home / "datasets", "sparkrl-test/AIME-2024", table)
    # The run's own reader loads it from there with the hub out of reach: the layout is the real one.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    src = load_source("sparkrl-test/AIME-2024")
    assert (src.num_raw_rows, len(src.dataset)) == (12, 3)

    preflight(_cfg("data.train=sparkrl-test/AIME-2024", "eval.data=sparkrl-test/AIME-2024?split=train"))
    problems, _ = _timed_problems(_cfg("eval.data=sparkrl-test/AIME-2024?split=test"))
    assert len(problems) == 1 and problems[0].startswith(
        "eval.data: sparkrl-test/AIME-2024 is in the local datasets cache ("
    )
    assert "without split 'test' (it has train), and the hub at " in problems[0]

    # Two configs cached side by side: datasets refuses to pick one, and so does the preflight.
    _cache_dataset(home / "datasets", "sparkrl-test/AIME-2024", table, config="other")
    with pytest.raises(ValueError, match="multiple 'sparkrl-test/AIME-2024' configurations in the cache"):
        load_source("sparkrl-test/AIME-2024")
    problems, _ = _timed_problems(_cfg("data.train=sparkrl-test/AIME-2024"))
    assert (
        len(problems) == 1 and "in several configs (default, other), and the spec names none" in problems[0]
    )
    preflight(_cfg("data.train=sparkrl-test/AIME-2024?config=other"))


def test_a_colocated_kv_cache_too_small_for_one_sequence_is_named_before_ray(tmp_path, tiny_dense_path):
    """Colocated on GPUs the engine's KV cache is what the plan leaves of gpu_memory_utilization: a share
    that leaves less than one sequence is one line naming the key, not an engine dying at start."""
    import shutil

    from rl.plan import colocated_engine_plan
    from rl.preflight import kv_cache_problems

    assert kv_cache_problems(load_config("recipes/gpu_demo.yaml")) == []
    for recipe in (
        "gpu_demo",
        "qwen3_30b_a3b_1gpu",
        "muse_spark_open_dapo_lora",
    ):  # the shipped colocated ones
        assert colocated_engine_plan(load_config(recipe)) is not None, recipe  # sized by the plan
        assert kv_cache_problems(load_config(recipe)) == [], recipe
    (line,) = kv_cache_problems(load_config("recipes/gpu_demo.yaml", ["rollout.gpu_memory_utilization=0.01"]))
    assert line.startswith(
        "rollout.gpu_memory_utilization: 0.01 of a 80 GiB GPU (resources.gpu_memory_gib) leaves 0.00 GiB of KV "
    )
    assert line.endswith("one 288-token sequence needs 0.3 MiB: raise it (`sparkrl plan` shows the split)")
    theirs = ["rollout.engine_args={gpu_memory_utilization: 0.01}"]  # the share vLLM gets
    (line,) = kv_cache_problems(load_config("recipes/gpu_demo.yaml", theirs))
    assert line.startswith("rollout.gpu_memory_utilization: 0.01 of a 80 GiB GPU")
    own = ["rollout.gpu_memory_utilization=0.01", "rollout.engine_args={kv_cache_memory_bytes: 1073741824}"]
    assert kv_cache_problems(load_config("recipes/gpu_demo.yaml", own)) == []  # a size of one's own
    split = load_config(
        "recipes/gpu_demo.yaml", ["rollout.gpu_memory_utilization=0.01", "resources.num_gpus=0"]
    )
    assert kv_cache_problems(split) == []  # no sleep mode: vLLM sizes its cache itself
    # weights in a format the planner does not count byte for byte (FP8 here): vLLM's profile sizes the cache
    fp8 = tmp_path / "fp8"
    shutil.copytree(tiny_dense_path, fp8)
    config = json.loads((fp8 / "config.json").read_text())
    (fp8 / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    over = [f"model.path={fp8}", "model.make_tiny.arch=", "rollout.gpu_memory_utilization=0.01"]
    assert colocated_engine_plan(load_config("recipes/gpu_demo.yaml", over)) is None
    assert kv_cache_problems(load_config("recipes/gpu_demo.yaml", over)) == []
