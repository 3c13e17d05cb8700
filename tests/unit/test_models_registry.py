"""The model families (rl/models/<family>/, rl/models/registry.py): each is one folder that declares itself
once, its code parts resolve, the registry reads without torch, and the facts other parts of sparkrl held
before (expert-count keys, make-tiny's arch list) have one home."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import subprocess
import sys

import pytest
import torch

from rl.core import model_info
from rl.models import registry
from rl.models.family import load

FAMILIES = {f.name: f for f in registry.FAMILIES}


@pytest.mark.parametrize("name", FAMILIES)
def test_a_family_is_a_folder_that_declares_itself(name):
    family = FAMILIES[name]
    assert (registry.family_dir(family) / "__init__.py").is_file()
    assert importlib.import_module(f"rl.models.{name}").FAMILY is family
    assert all(registry.family(t) is family for t in family.model_types)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_familys_code_resolves(name):
    family = FAMILIES[name]
    for router in family.routers:
        cls, adapter = load(router.cls), load(router.adapter)
        assert isinstance(cls, type) and issubclass(cls, torch.nn.Module) and callable(adapter)
    if family.register_hf:
        load(family.register_hf)()
    for module, _, cls in (t.partition(":") for t in family.vllm_models.values()):
        spec = importlib.util.find_spec(module)  # the file, without importing vLLM
        assert spec is not None and f"class {cls}(" in open(spec.origin).read()
    if family.tiny is not None:
        config = family.tiny.build_config({"vocab_size": 64})
        assert config.model_type in family.model_types


def test_the_registry_the_planner_and_the_preflight_import_no_torch():
    code = "import sys, rl.models.registry, rl.plan, rl.preflight; print(sorted({'torch', 'transformers', 'vllm'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("arch", registry.TINY_ARCHES)
def test_the_trainer_finds_a_router_in_every_moe_layer_of_each_tiny_model(arch):
    from rl.models import auto_causal_lm
    from rl.tiny import model_config
    from trainer.routing_replay import moe_routers

    family = registry.tiny_family(arch)
    config = model_config(arch, 64, eos_id=1, pad_id=0)
    with torch.device("meta"):
        model = auto_causal_lm().from_config(config)
    routers = moe_routers(model)
    if family.tiny_is_moe:
        assert len(routers) == config.num_hidden_layers
        assert {type(r) for r in routers} <= {load(r.cls) for r in family.routers}
    else:
        assert routers == [] and not family.routers


def test_the_expert_count_keys_have_one_home():
    from rl import preflight

    assert preflight.is_moe is model_info.is_moe
    for key in model_info.EXPERT_COUNT_KEYS:
        assert model_info.is_moe({key: 4}) and model_info.is_moe({"text_config": {key: 4}})
        assert model_info.num_experts({key: 4}) == 4
    assert not model_info.is_moe({"num_hidden_layers": 2, "text_config": {"hidden_size": 8}})
    assert model_info.num_experts({"moe_num_experts": [64, 32]}) == 64


def test_make_tinys_arch_lists_are_the_registrys():
    from rl.cli import build_parser
    from rl.config import MakeTinyConfig

    (arch,) = [f for f in dataclasses.fields(MakeTinyConfig) if f.name == "arch"]
    assert tuple(arch.metadata["choices"]) == ("", *registry.TINY_ARCHES)
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    (option,) = [a for a in sub.choices["make-tiny"]._actions if a.dest == "arch"]
    assert tuple(option.choices) == registry.TINY_ARCHES


def test_a_model_type_is_found_at_the_top_or_in_text_config():
    assert registry.family_of({"model_type": "muse_spark"}) is FAMILIES["muse"]
    assert (
        registry.family_of({"model_type": "wrapper", "text_config": {"model_type": "qwen3_moe"}})
        is (FAMILIES["qwen3_moe"])
    )
    assert registry.family_of({"model_type": "mixtral"}) is None


def test_a_model_type_claimed_twice_is_refused():
    twin = dataclasses.replace(FAMILIES["qwen3_moe"], name="twin", tiny=None)
    with pytest.raises(ValueError, match="model_type 'qwen3_moe' is claimed by families qwen3_moe and twin"):
        registry._index((FAMILIES["qwen3_moe"], twin))
