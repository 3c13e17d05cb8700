"""Config fields that carry their own documentation: a doc line, the allowed choices and bounds, in the field's
metadata. Every section of the config (rl/config.py composes them; trainer/config.py and others own
theirs) declares its keys with `option`; rl.config's validation checks choices and bounds, and
`rl.config_docs` writes docs/config.md from the docs."""

import copy
import dataclasses
from dataclasses import field
from typing import Any


class Registered:
    """The choices of a field that are the names a registry holds (`module.name`, a dict or a tuple), read
    when they are checked: one list of names, the code's own, and a config loads without importing the
    module until it is validated."""

    def __init__(self, module: str, name: str, import_paths: bool = False):
        # import_paths: a value with a ':' (`file.py:name`, `module:name`, rl.core.user_code) passes too; its
        # form is checked on load and the code itself where it runs (the preflight first).
        self.module, self.name, self.import_paths = module, name, import_paths

    def __iter__(self):
        import importlib

        return iter(tuple(getattr(importlib.import_module(self.module), self.name)))


def option(
    default: Any, doc: str, choices: "tuple | Registered" = (), *, ge=None, gt=None, le=None, lt=None
) -> Any:
    """A field with its doc line, allowed choices and bounds in its metadata (read by validate, the docs)."""
    meta = {"doc": doc, "choices": choices, "bounds": {"ge": ge, "gt": gt, "le": le, "lt": lt}}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    if isinstance(default, type) and dataclasses.is_dataclass(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)
