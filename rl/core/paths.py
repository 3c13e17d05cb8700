"""Where sparkrl finds its shipped files (recipes/, launch/) and keeps its cache."""

from __future__ import annotations

import os
import sys
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[2]


def shipped_dir(name: str) -> Path:
    """`recipes` or `launch`: the checkout's copy (editable install) or <prefix>/share/sparkrl/<name>."""
    for base in (_CHECKOUT, Path(sys.prefix) / "share" / "sparkrl"):
        if (base / name).is_dir():
            return base / name
    raise FileNotFoundError(
        f"sparkrl: cannot find its {name}/ directory (looked in {_CHECKOUT} and {sys.prefix}/share/sparkrl)"
    )


def cache_dir() -> Path:
    """`$SPARKRL_CACHE`, else `$XDG_CACHE_HOME/sparkrl`, else ~/.cache/sparkrl."""
    if os.environ.get("SPARKRL_CACHE"):
        return Path(os.environ["SPARKRL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sparkrl"
