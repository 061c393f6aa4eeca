"""The package's import graph has no cycle, and every module imports on its own.

A cycle (``cli`` importing ``trainer`` importing ``cli`` for the version line, as it once was) works only as
long as every import in it stays inside a function; the next top-level import turns it into a half-initialised
module error that depends on which module a program happens to import first. Imports inside functions count
here too: they are the same dependency, only deferred. Imports under ``if TYPE_CHECKING:`` do not: they never
run.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import open_diloco

PACKAGE = Path(open_diloco.__file__).parent
NOT_IMPORTABLE = {"open_diloco.__main__"}  # runs the command line when imported


def module_names() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports, anywhere in the file; ``from a import b`` counts as
    importing ``a.b`` when that is a module, else ``a``."""
    found = set()
    for node in runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
    return {name for name in found if name in modules}


def runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:``, which never run: an annotation may
    name a type of a module that imports this one."""
    nodes, todo = [], [tree]
    while todo:
        node = todo.pop()
        nodes.append(node)
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return nodes


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes (first == last), or None (depth first, colouring nodes)."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_in_the_package():
    modules = module_names()
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_every_module_imports_in_a_fresh_interpreter():
    names = sorted(set(module_names()) - NOT_IMPORTABLE)
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    result = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
