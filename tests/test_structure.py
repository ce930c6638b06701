"""The package's structure, read from the source with `ast` (nothing is imported or run):

- the rooms (the package's direct children) stand in one order, each importing only the rooms below it
  (`ROOMS`), so the rooms' import graph has no circle, and no modules import each other in a loop;
- at most 5 loose modules at the top level (the package face, `cli.py`);
- one worker pool: only `workers/` starts Python worker processes;
- generic code never names an op: outside `kernels/<op>/`, the registry, the layer and the public face no
  module spells an op's name or imports an op's package (it asks the op object);
- a module over 450 lines is a smell (it has more than one job); no module or type is called `spec`."""

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


# The rooms from the ground up; a room imports only rooms at or below its own place. "" is the package face
# (`moe_tune/__init__.py`, the public API): it gathers the layer and everything below it, and the rooms above it
# may use the public API.
ROOMS = ["core", "profiles", "kernels", "layer", "", "workers", "targets", "tuner", "campaign", "commands", "cli"]


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_room_is_in_the_order():
    assert sorted({_room(name) for name in _modules()} - set(ROOMS)) == []


def test_imports_only_point_down_the_rooms():
    rank = {room: i for i, room in enumerate(ROOMS)}
    up = sorted(f"{name} -> {dep}" for name, deps in _imports(_modules()).items() for dep in deps
                if rank[_room(dep)] > rank[_room(name)])
    assert up == []


def test_at_most_five_loose_modules_at_the_top():
    loose = [name for name, path in _modules().items() if name.count(".") == 1 and path.name != "__init__.py"]
    assert len(loose) <= 5, loose


def test_only_the_worker_pool_starts_worker_processes():
    """`subprocess` may run a command (pip, for the compile-only wheels); Python workers come from one pool."""
    starters = {name for name, path in _modules().items()
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Attribute) and node.attr in ("Popen", "Process", "get_context")}
    assert {name for name in starters if not name.startswith("moe_tune.workers")} == set()


OP_NAMES = {"ragged_dot", "ragged_gather", "ragged_gather_reduce", "dense_gather_reduce", "fused_moe", "moe_fusion"}
OP_PACKAGES = ("moe_tune.kernels.ragged_dot", "moe_tune.kernels.gather", "moe_tune.kernels.fused_moe")
# may name ops: the registry that lists them, the layer that composes them, the public face that exports them,
# and the demo, whose subject is one op
NAMES_OPS = ("moe_tune", "moe_tune.kernels", "moe_tune.layer", "moe_tune.commands.demo_check")


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def _names_an_op(name: str, path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    said = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and node.value in OP_NAMES
            and id(node) not in docs]
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
                and node.module.startswith(OP_PACKAGES)]
    return sorted(set(said) | set(imported))


def test_generic_code_never_names_an_op():
    wrong = {name: found for name, path in _modules().items()
             if not name.startswith(OP_PACKAGES)
             and not any(name == allowed or (allowed != "moe_tune" and name.startswith(allowed + "."))
                         for allowed in NAMES_OPS)
             and (found := _names_an_op(name, path))}
    assert wrong == {}


def test_the_op_name_finder_finds_one(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('"""ragged_dot in a docstring is prose."""\nfrom moe_tune.kernels.gather.op import x\nOP = "fused_moe"\n')
    assert _names_an_op("m", path) == ["fused_moe", "moe_tune.kernels.gather.op"]


def test_nothing_is_called_spec():
    modules = _modules()
    assert [name for name in modules if name.rpartition(".")[2] == "spec"] == []
    classes = [f"{name}.{node.name}" for name, path in modules.items() for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ClassDef) and node.name.lower().endswith("spec")]
    assert classes == []


def test_profiles_import_nothing_from_kernels_or_the_tuner():  # the order says so too; the design card pins it
    graph = _imports(_modules())
    wrong = {name: sorted(d for d in deps if d.startswith(("moe_tune.kernels", "moe_tune.tuner")))
             for name, deps in graph.items() if name.startswith("moe_tune.profiles")}
    assert {name: deps for name, deps in wrong.items() if deps} == {}
