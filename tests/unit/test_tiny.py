"""make-tiny: the locally trained tokenizer, the models, determinism and the content-hash cache."""

from __future__ import annotations

import json

import pytest
import torch

from rl import tiny
from rl.cli import main


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.train_tokenizer(seed=0)


def test_tokenizer_is_deterministic_for_a_seed(tokenizer):
    again = tiny.train_tokenizer(seed=0)
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


def test_tokenizer_splits_digits_and_round_trips_any_text(tokenizer):
    pieces = [tokenizer.decode([i]) for i in tokenizer("12345 + 678", add_special_tokens=False)["input_ids"]]
    assert [p for p in pieces if p.strip().isdigit()] == list("12345678")
    text = "Ünïcödé ∑ 東京 🙂 \\boxed{42}"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_chat_template_opens_the_assistant_turn(tokenizer):
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|user|>\nhi<|end|>\n<|assistant|>\n"
    assert tokenizer.eos_token == "<|end|>"


@pytest.mark.parametrize("arch", ["dense", "qwen3_moe"])
def test_same_seed_same_weights_other_seed_other_weights(arch):
    a, _ = tiny.build(arch, seed=3)
    b, _ = tiny.build(arch, seed=3)
    c, _ = tiny.build(arch, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_moe_model_meets_the_size_floor_and_loads_in_transformers(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("SPARKRL_CACHE", str(tmp_path / "cache"))
    path = tiny.make_tiny("qwen3_moe", tmp_path / "m", seed=0)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["hidden_size"] >= 128 and cfg["num_hidden_layers"] >= 4
    assert cfg["num_local_experts"] >= 8 and cfg["num_experts_per_tok"] >= 2
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], cfg["vocab_size"])
    assert torch.isfinite(logits).all()


def test_cache_is_reused_and_out_gets_an_identical_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKRL_CACHE", str(tmp_path / "cache"))
    first = tiny.make_tiny("dense", seed=1)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = tiny.make_tiny("dense", seed=1)
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == stamp
    out = tiny.make_tiny("dense", tmp_path / "out", seed=1)
    for f in first.iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes()
    assert tiny.make_tiny("dense", seed=2) != first


def _build_counting(cache: str, log: str, seed: int, out) -> None:
    """make_tiny in a fresh process, each real build appending this process's pid to `log`."""
    import os

    os.environ["SPARKRL_CACHE"] = cache
    real = tiny._build_into

    def counted(*args):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        real(*args)

    tiny._build_into = counted
    out.put(str(tiny.make_tiny("dense", seed=seed)))


def test_two_processes_asking_for_one_uncached_model_build_it_once(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    log = tmp_path / "builds.log"
    procs = [
        ctx.Process(target=_build_counting, args=(str(tmp_path / "cache"), str(log), 3, out))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    paths = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert paths[0] == paths[1]
    assert len(log.read_text().split()) == 1  # the second waited for the first's build and took it


def test_out_refuses_to_overwrite_an_existing_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKRL_CACHE", str(tmp_path / "cache"))
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "thesis.txt").write_text("keep me")
    assert main(["make-tiny", "--arch", "dense", "--out", str(precious)]) == 2
    assert (precious / "thesis.txt").read_text() == "keep me"
    # a model directory (a real checkpoint at a mistyped --out) is kept as well
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"weights")
    assert main(["make-tiny", "--arch", "dense", "--out", str(model)]) == 2
    assert (model / "model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("model.")) == []  # no temporaries


def test_unknown_arch_is_a_clear_error():
    with pytest.raises(ValueError, match="--arch must be one of dense, qwen3_moe"):
        tiny.make_tiny("llama9")


def test_sft_progress_without_a_terminal_is_a_line_every_five_percent(capsys):
    from rl.tiny_sft import _progress

    with _progress(500) as advance:  # capsys: stdout is not a terminal
        for step in range(500):
            advance(2.0 - step / 500)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 20
    assert lines[0].startswith("sft arith: step 25/500 (5%), loss 1.952")
    assert lines[-1].startswith("sft arith: step 500/500 (100%), loss 1.002")


def test_the_tool_warmup_code_moves_only_its_own_cache_key(tmp_path, monkeypatch):
    """The CPU demo's model (`arith`) keeps its key, and so its cached bytes, whatever the tool warm-up's
    code; the `arith_tool` model's key follows that code and the `arith` model's key."""
    from rl import tiny_tool_sft

    arith, tool = tiny.cache_key("qwen3_moe", 0, "arith"), tiny.cache_key("qwen3_moe", 0, "arith_tool")
    assert tool != arith
    edited = tmp_path / "edited.py"
    edited.write_text("STEPS = 1\n")
    monkeypatch.setattr(tiny_tool_sft, "sources", lambda: [edited])
    assert tiny.cache_key("qwen3_moe", 0, "arith") == arith
    assert tiny.cache_key("qwen3_moe", 0, "arith_tool") not in (tool, arith)


def test_unknown_sft_is_a_clear_error():
    with pytest.raises(ValueError, match="--sft must be one of arith, arith_tool"):
        tiny.make_tiny("qwen3_moe", sft="tools")


def test_make_tiny_command_reports_a_warmup_without_an_accuracy_band(tmp_path, monkeypatch, capsys):
    """The tool warm-up's report has no held-out accuracy (a run measures it): the command prints the path."""
    built = tmp_path / "m"
    built.mkdir()
    (built / "sft_report.json").write_text(json.dumps({"base": "arith", "train_s": 1.0}))
    monkeypatch.setattr(tiny, "make_tiny", lambda arch, out, seed, sft: built)
    assert main(["make-tiny", "--arch", "qwen3_moe", "--sft", "arith_tool", "--out", str(built)]) == 0
    assert capsys.readouterr().out.strip() == f"make-tiny: qwen3_moe model (sft arith_tool) at {built}"
