"""bench.base_format's trainer: its command line reaches the trainer's spec (the activation budget, the
compiled or eager layers); the spec is the one the trainer worker builds from, no GPU needed to check it."""

from bench.base_format import parser, trainer_spec

MODEL = {"nvfp4": "/models/m/nvfp4", "dq": "/models/m/dq", "spec": {"name": "muse"}}


def test_activation_budget_and_compile_reach_the_trainer_spec(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the spec a GPU machine builds
    args = parser().parse_args(["--out", "x", "--activation-memory-budget", "0.5"])
    spec = trainer_spec(MODEL, "nvfp4", args)
    assert spec.trainer.activation_memory_budget == 0.5 and spec.trainer.compile
    assert spec.model_path == "/models/m/nvfp4" and spec.base_format == "nvfp4" and spec.lora.target_latent

    eager = trainer_spec(MODEL, "bf16", parser().parse_args(["--out", "x", "--no-compile"]))
    assert eager.trainer.activation_memory_budget == 0.0 and not eager.trainer.compile
    assert eager.model_path == "/models/m/dq" and eager.trainer.activation_checkpointing
