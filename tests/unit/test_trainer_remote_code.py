"""model.trust_remote_code reaches the trainer: a checkpoint whose classes ship with it (config.json's
`auto_map`) builds in the trainer only when the key allows it, as in the tokenizer and vLLM."""

import json
import shutil

import pytest
import torch

from rl.config import load_config
from rl.setup import trainer_spec
from rl.tiny import make_tiny
from trainer.sharded_load import build_empty_model

CONFIG_CODE = """
from transformers import Qwen3Config


class RemoteQwen3Config(Qwen3Config):
    model_type = "remote_qwen3"
"""
MODELING_CODE = """
from transformers import Qwen3ForCausalLM

from .configuration_remote import RemoteQwen3Config


class RemoteQwen3ForCausalLM(Qwen3ForCausalLM):
    config_class = RemoteQwen3Config
"""


@pytest.fixture(scope="module")
def remote_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("remote") / "model"
    shutil.copytree(make_tiny("dense"), path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "remote_qwen3"
    config["auto_map"] = {
        "AutoConfig": "configuration_remote.RemoteQwen3Config",
        "AutoModelForCausalLM": "modeling_remote.RemoteQwen3ForCausalLM",
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "configuration_remote.py").write_text(CONFIG_CODE)
    (path / "modeling_remote.py").write_text(MODELING_CODE)
    return path


def test_the_trainer_builds_a_remote_code_model_only_when_allowed(remote_checkpoint):
    with pytest.raises(ValueError, match="trust_remote_code"):
        build_empty_model(str(remote_checkpoint), torch.float32)
    model = build_empty_model(str(remote_checkpoint), torch.float32, trust_remote_code=True)
    assert type(model).__name__ == "RemoteQwen3ForCausalLM"
    assert all(p.is_meta for p in model.parameters())


def test_the_trainer_spec_carries_the_sampling_distribution_and_remote_code():
    cfg = load_config(
        "demo_cpu",
        ["run.name=t", "rollout.temperature=0.7", "rollout.top_p=0.9", "model.trust_remote_code=true"],
    )
    spec = trainer_spec(cfg, "some/model")
    assert (spec.temperature, spec.top_p, spec.trust_remote_code) == (0.7, 0.9, True)
