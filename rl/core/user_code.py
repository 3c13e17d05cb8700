"""Code a user names in the config by import path: `path/to/file.py:name` or `package.module:name`.

    resolve("reward.function", "/abs/my_reward.py:compute_score")   # -> the function
    resolve("algorithm.policy_loss", "my_pkg.losses:clipped")

A value with a ':' is an import path; a registry name (`grpo`, `math_dapo`) has none. The part before the
last ':' is a file when it ends in `.py` (or holds a '/'), else a dotted module name that must be importable
in the process that resolves it (installed, or on PYTHONPATH). The part after it is an attribute, dotted
for one inside a class or namespace (`losses:Family.loss`).

A file path is relative to the directory of the recipe that sets it, and an override on the command line
to the working directory: `rl.config.load_config` makes it absolute with `absolute_file`, so the resolved
config, and every worker it reaches (Ray trainer ranks, reward processes, in other working directories),
names the same file. Each process that calls a function resolves it itself: a file is loaded once a process
(under a module name of its own, registered in `sys.modules`), a module imported as Python does.

Errors are `UserCodeError`, one line that names the config key and the file or module.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class UserCodeError(ValueError):
    """A function named by import path that cannot be had: one line naming the key and the file."""


def is_import_path(value: object) -> bool:
    """Whether a config value names code by import path (has a ':'), rather than a registry entry."""
    return isinstance(value, str) and ":" in value


def split(value: str) -> tuple[str, str]:
    """`target:name` -> (target, name), the last ':' separating them; ValueError when malformed."""
    target, _, name = value.rpartition(":")
    if not target or not name:
        raise ValueError(f"{value!r}: expected `path/to/file.py:name` or `package.module:name`")
    if not _NAME.match(name):
        raise ValueError(f"{value!r}: {name!r} is not a Python name")
    if not is_file(target) and not _NAME.match(target):
        raise ValueError(f"{value!r}: {target!r} is neither a .py file nor a dotted module name")
    return target, name


def is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def problem(value: str) -> str | None:
    """What is wrong with an import path's form (None when well formed); checked without importing."""
    try:
        split(value)
    except ValueError as e:
        return str(e)
    return None


def absolute_file(value: str, base: str | Path) -> str:
    """An import path with its file made absolute against `base` (a module path, or an absolute file, as
    it is). `~` is expanded."""
    target, name = split(value)
    if not is_file(target):
        return value
    path = Path(target).expanduser()
    if not path.is_absolute():
        path = Path(base) / path
    return f"{path.absolute()}:{name}"


def describe(value: str) -> str:
    """'file /abs/x.py' or 'module pkg.mod': what an error message names."""
    target, _ = split(value)
    return f"file {target}" if is_file(target) else f"module {target}"


@functools.cache
def _load_file(path: str):
    """A file loaded as a module once a process, under a name of its own (registered in sys.modules, so
    that dataclasses and pickling by reference inside it work)."""
    digest = hashlib.sha1(path.encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", Path(path).stem)
    module_name = f"sparkrl_user_{stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def resolve(key: str, value: str) -> Callable[..., Any]:
    """The callable `value` names (see the module docstring); UserCodeError naming `key` and the file or
    module when it is malformed, missing, fails to import, or is not callable."""
    try:
        target, name = split(value)
    except ValueError as e:
        raise UserCodeError(f"{key}: {e}") from None
    where = describe(value)
    if is_file(target):
        path = Path(target).expanduser()
        if not path.is_absolute():
            path = path.absolute()
        if not path.is_file():
            raise UserCodeError(f"{key}: {value!r}: no such file {path}")
        loader = functools.partial(_load_file, str(path))
    else:
        loader = functools.partial(importlib.import_module, target)
    try:
        module = loader()
    except Exception as e:  # the user's module failed to import: its own error, named with the key
        raise UserCodeError(f"{key}: importing {where} failed: {type(e).__name__}: {_first_line(e)}") from e
    obj: Any = module
    for part in name.split("."):
        if not hasattr(obj, part):
            have = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            listed = ", ".join(have[:8]) + (" ..." if len(have) > 8 else "")
            raise UserCodeError(f"{key}: {where} has no {name!r} (its functions: {listed or 'none'})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserCodeError(f"{key}: {where}: {name!r} is a {type(obj).__name__}, not a function")
    return obj


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
