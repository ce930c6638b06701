"""The package's structure (issue 25): no import circle among moe_tune's modules, no module over 450 lines
and cli.py under 300, no module or type called `spec`, and profiles/ importing nothing from kernels/ or
tuner/. Read from the source with `ast`; nothing is imported or run."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "moe_tune"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its `__init__.py`)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Which of the package's modules each one imports: anywhere in it (inside functions and under
    `if TYPE_CHECKING:` too), `from a.b import c` counted as `a.b.c` when that is a module."""

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {owner(a.name) for a in node.names if a.name.startswith("moe_tune")}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("moe_tune"):
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else owner(node.module)
                          for a in node.names}
        graph[name] = found - {name, None}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (as a path that starts and ends at the same module), or None."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_no_import_circle():
    assert _cycle(_imports(_modules())) is None


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_module_sizes():
    lines = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    assert {name: n for name, n in lines.items() if n > 450} == {}
    assert lines["moe_tune.cli"] < 300


def test_nothing_is_called_spec():
    modules = _modules()
    assert [name for name in modules if name.rpartition(".")[2] == "spec"] == []
    classes = [f"{name}.{node.name}" for name, path in modules.items() for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ClassDef) and node.name.lower().endswith("spec")]
    assert classes == []


def test_profiles_import_nothing_from_kernels_or_the_tuner():
    graph = _imports(_modules())
    wrong = {name: sorted(d for d in deps if d.startswith(("moe_tune.kernels", "moe_tune.tuner")))
             for name, deps in graph.items() if name.startswith("moe_tune.profiles")}
    assert {name: deps for name, deps in wrong.items() if deps} == {}
