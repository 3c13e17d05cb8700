"""The layers of the house, read from the source (every import statement, at module level or inside a
function, since a function-level import is how a cycle hides):

- the bottom layer, `rl.core` and `rl.models`: imports nothing else of `rl`;
- rollout/ and trainer/: import from `rl` only the bottom layer (they never see the CLI, the driver, its
  setup, the planner, sweeps or submission);
- no module of rl/, rollout/ or trainer/ takes part in an import cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rl", "rollout", "trainer")
BOTTOM = ("rl.core", "rl.models")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(module imported, line) for every import of a project module in `path`: `from a.b import c` names
    a.b.c where that is a module, else a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.append((full if full in known else base, node.lineno))
    return [(m, line) for m, line in out if m.split(".")[0] in PACKAGES]


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _graph() -> dict[str, list[tuple[str, int]]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def test_the_bottom_layer_imports_nothing_above_it():
    wrong = [
        f"{m} imports {dep} (line {line})"
        for m, deps in _graph().items()
        if _in(m, BOTTOM)
        for dep, line in deps
        if dep.startswith("rl") and not _in(dep, BOTTOM)
    ]
    assert not wrong, "\n".join(wrong)


def test_rollout_and_trainer_use_only_the_bottom_layer_of_rl():
    wrong = [
        f"{m} imports {dep} (line {line})"
        for m, deps in _graph().items()
        if _in(m, ("rollout", "trainer"))
        for dep, line in deps
        if _in(dep, ("rl",)) and not _in(dep, BOTTOM)
    ]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    """Tarjan's strongly connected components over the import graph; a package importing its own
    submodules (an `__init__` that re-exports) is no cycle, as Python runs the package first."""
    graph = {
        m: sorted({d for d, _ in deps if d in _modules() and not d.startswith(m + ".") and d != m})
        for m, deps in _graph().items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_checks_see_a_violation(tmp_path, monkeypatch):
    """The graph reader finds imports inside functions and relative imports (what the checks rest on)."""
    (tmp_path / "m.py").write_text("def f():\n    from rl.cli import main\n")
    known = {"rl.cli"}
    assert _imports("trainer.m", tmp_path / "m.py", known) == [("rl.cli", 2)]
    (tmp_path / "n.py").write_text("from . import worker\nfrom .spec import X\n")
    assert _imports("trainer.n", tmp_path / "n.py", {"trainer.worker"}) == [
        ("trainer.worker", 1),
        ("trainer.spec", 2),
    ]
