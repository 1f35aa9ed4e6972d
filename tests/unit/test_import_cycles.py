"""No import cycles within the library: a module-level import graph of every module of the
installed packages, built from their source (AST, nothing imported), must be acyclic.

Every import counts, a module-level one or one deferred into a function (a deferred import
hides a cycle from the interpreter, not from a reader). A second check counts the imports
under ``if TYPE_CHECKING:`` too: a type-only import back is still two modules that know each
other's insides (``memory.egress`` once named ``MemoryListener`` that way; it now takes
``ListenerHooks``). An import of a package counts as an edge to its ``__init__``;
``from pkg import name`` to the submodule ``pkg.name`` when there is one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: folder -> installed package name (pyproject.toml [tool.setuptools.package-dir])
PACKAGES = {"lynx_transport": "lynx_transport", "lynx_decode": "lynx_decode", "kernels": "lynx_kernels",
            "bench": "lynx_bench", "lynx_vllm": "lynx_vllm"}


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder, name in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [name, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(node: ast.AST, typing_too: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif not typing_too and isinstance(child, ast.If) and (
                (isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING")
                or (isinstance(child.test, ast.Attribute) and child.test.attr == "TYPE_CHECKING")):
            for stmt in child.orelse:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]))
        else:
            yield from _imports(child, typing_too)


def imports_of(name: str, path: Path, known: dict[str, Path], typing_too: bool = False) -> set[str]:
    """The modules of ``known`` that ``name`` imports (with ``typing_too``, under
    ``if TYPE_CHECKING:`` as well)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    edges: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path)), typing_too):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        for target in targets:
            while target and target not in known:  # `import a.b.c`: the deepest module we have
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
    return edges


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_checker_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_type_only_imports_are_seen_only_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "b.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\nimport pkg.c\n")
    known = {"pkg.a": path, "pkg.b": path, "pkg.c": path}
    assert imports_of("pkg.b", path, known) == {"pkg.c"}
    assert imports_of("pkg.b", path, known, typing_too=True) == {"pkg.a", "pkg.c"}


@pytest.mark.parametrize("typing_too", [False, True], ids=["runtime", "with-type-only"])
def test_the_library_has_no_import_cycle(typing_too: bool) -> None:
    known = modules()
    assert "lynx_transport.seam" in known and "lynx_kernels.cuda" in known  # the walk found the tree
    graph = {name: imports_of(name, path, known, typing_too) for name, path in known.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
