"""rl.core.user_code: import paths to files and modules, resolved in the calling process; each error is one
line naming the config key and the file; load_config makes a recipe's relative file absolute against the
recipe's directory and an override's against the working directory."""

from __future__ import annotations

import sys

import pytest

from rl.config import ConfigError, load_config
from rl.core import user_code
from rl.core.user_code import UserCodeError, absolute_file, is_import_path, problem, resolve


def test_import_paths_by_form():
    assert is_import_path("my.py:score") and is_import_path("pkg.mod:fn") and not is_import_path("grpo")
    assert problem("a/b.py:fn") is None and problem("pkg.mod:Cls.method") is None
    assert "expected `path/to/file.py:name`" in problem("score.py:")
    assert "is not a Python name" in problem("score.py:1x")
    assert "neither a .py file nor a dotted module name" in problem("not a module:fn")
    assert absolute_file("pkg.mod:fn", "/base") == "pkg.mod:fn"
    assert absolute_file("sub/r.py:fn", "/base") == "/base/sub/r.py:fn"
    assert absolute_file("/abs/r.py:fn", "/base") == "/abs/r.py:fn"


def test_resolve_a_file_and_a_module(tmp_path, monkeypatch):
    (tmp_path / "rw.py").write_text(
        "CALLS = []\ndef score(x):\n    return x + 1\nclass K:\n    @staticmethod\n    def f():\n        return 7\n"
    )
    fn = resolve("reward.function", f"{tmp_path}/rw.py:score")
    assert fn(1) == 2
    assert resolve("reward.function", f"{tmp_path}/rw.py:K.f")() == 7
    # one module a file and process: a second name comes from the same module
    assert resolve("x", f"{tmp_path}/rw.py:score").__module__ == fn.__module__ in sys.modules
    (tmp_path / "pkg_for_test").mkdir()
    (tmp_path / "pkg_for_test" / "__init__.py").write_text("")
    (tmp_path / "pkg_for_test" / "losses.py").write_text("def loss():\n    return 'loss'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve("algorithm.policy_loss", "pkg_for_test.losses:loss")() == "loss"


def test_errors_name_the_key_and_the_file(tmp_path):
    (tmp_path / "rw.py").write_text("VALUE = 3\ndef score():\n    pass\n")
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    cases = {
        f"{tmp_path}/missing.py:score": f"reward.function: '{tmp_path}/missing.py:score': no such file {tmp_path}/missing.py",
        f"{tmp_path}/rw.py:scor": f"reward.function: file {tmp_path}/rw.py has no 'scor' (its functions: score)",
        f"{tmp_path}/rw.py:VALUE": f"reward.function: file {tmp_path}/rw.py: 'VALUE' is a int, not a function",
        f"{tmp_path}/broken.py:f": f"reward.function: importing file {tmp_path}/broken.py failed: "
        "ModuleNotFoundError: No module named 'not_a_module_anywhere'",
        "no_such_pkg_xyz.mod:f": "reward.function: importing module no_such_pkg_xyz.mod failed: ModuleNotFoundError",
    }
    for value, message in cases.items():
        with pytest.raises(UserCodeError) as e:
            resolve("reward.function", value)
        assert str(e.value).startswith(message), str(e.value)
        assert "\n" not in str(e.value)


def _recipe(directory, extra: str) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "r.yaml"
    path.write_text(
        "run: {name: t}\nmodel: {make_tiny: {arch: qwen3_moe}}\ndata: {train: 'synthetic:arith'}\n" + extra
    )
    return str(path)


def test_load_config_makes_files_absolute_where_they_were_set(tmp_path, monkeypatch):
    recipe = _recipe(
        tmp_path / "recipes",
        "reward: {function: 'rw.py:score', by_source: {a: 'sub/a.py:f', b: math_verify, c: 'pkg.m:f'}}\n"
        "algorithm: {policy_loss: 'loss.py:pl', adv_estimator: grpo}\n",
    )
    monkeypatch.chdir(tmp_path)
    cfg = load_config(recipe, ["algorithm.adv_estimator=here.py:adv"])
    assert cfg.reward.function == f"{tmp_path}/recipes/rw.py:score"
    assert cfg.reward.by_source == {"a": f"{tmp_path}/recipes/sub/a.py:f", "b": "math_verify", "c": "pkg.m:f"}
    assert cfg.algorithm.policy_loss == f"{tmp_path}/recipes/loss.py:pl"
    assert cfg.algorithm.adv_estimator == f"{tmp_path}/here.py:adv"  # an override: the working directory


def test_load_config_checks_the_form_and_names_verls_keys(tmp_path):
    recipe = _recipe(tmp_path, "")
    cases = {
        "reward.function='score.py:'": "reward.function: 'score.py:': expected `path/to/file.py:name`",
        "reward.function=math_verify": "reward.function: expected `path/to/file.py:name` or `module:name`, got "
        "'math_verify' (a built-in checker goes in reward.backend=math_verify)",
        "reward.backend=my.py:score": "reward.backend: a function of your own goes in reward.function=my.py:score",
        "reward.by_source={x: mathdapo}": "reward.by_source.x: expected one of 'math_dapo', 'math_verify' or an "
        "import path",
        "reward.kwargs={a: 1}": "reward.kwargs: passed to functions of your own",
        "reward.batched=true": "reward.batched: applies to functions of your own",
        "algorithm.policy_loss=loss.py:1": "algorithm.policy_loss: 'loss.py:1': '1' is not a Python name",
        "custom_reward_function.path=r.py": "unknown key 'custom_reward_function' "
        "(verl's custom_reward_function.{path,name} is reward.function",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as e:
            load_config(recipe, [override])
        assert message in str(e.value), (override, str(e.value))
    ok = load_config(recipe, ["reward.function=pkg.mod:fn", "reward.kwargs={a: 1}", "reward.batched=true"])
    assert ok.reward.function == "pkg.mod:fn" and ok.reward.kwargs == {"a": 1}


def test_user_code_is_in_the_bottom_layer():
    assert user_code.__name__ == "rl.core.user_code"
