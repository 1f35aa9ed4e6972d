"""No import cycles within the library: a module-level import graph of every module of the
installed packages, built from their source (AST, nothing imported), must be acyclic.

Every import counts, a module-level one or one deferred into a function (a deferred import
hides a cycle from the interpreter, not from a reader). A second check counts the imports
under ``if TYPE_CHECKING:`` too: a type-only import back is still two modules that know each
other's insides (``memory.egress`` once named ``MemoryListener`` that way; it now takes
``ListenerHooks``). An import of a package counts as an edge to its ``__init__``;
``from pkg import name`` to the submodule ``pkg.name`` when there is one.

The transport's layers point one way (CONTRIBUTING.md, "The transport"), checked on the
same graph with the type-only imports: ``lynx_transport.protocol`` imports only itself and
the leaf modules ``errors`` and ``lanes``; ``ucx`` and ``memory`` never import each other;
of the top-level modules only ``__init__`` and ``testing`` import either, so no module the
twin reaches through the graph (a submodule's import is not an edge to its package's
``__init__``) is a ``ucx`` one. The subpackages' ``__init__`` files import nothing, and
importing the transport (the in-memory twin included) does not import ucxx.
"""

from __future__ import annotations

import ast
import subprocess
import sys
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


#: What each part of lynx_transport may import of lynx_transport (prefixes; see the module docstring).
PROTOCOL_MAY_IMPORT = ("lynx_transport.protocol.", "lynx_transport.errors", "lynx_transport.lanes")
#: The top-level modules that may import an implementation (the API, the testing kit).
FRONTS = {"lynx_transport", "lynx_transport.testing"}
SUBPACKAGES = ("lynx_transport.protocol", "lynx_transport.ucx", "lynx_transport.memory")


def _part(name: str) -> str:
    """``protocol``, ``ucx``, ``memory`` or ``top`` for a module of lynx_transport."""
    for package in SUBPACKAGES:
        if name == package or name.startswith(package + "."):
            return package.rpartition(".")[2]
    return "top"


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import within lynx_transport that goes against its layers, as ``a -> b``."""
    bad = []
    for name, targets in sorted(graph.items()):
        if name != "lynx_transport" and not name.startswith("lynx_transport."):
            continue
        for target in sorted(t for t in targets if t == "lynx_transport" or t.startswith("lynx_transport.")):
            part, other = _part(name), _part(target)
            if part == "protocol":
                ok = target.startswith(PROTOCOL_MAY_IMPORT) and target != "lynx_transport.protocol"
            elif part in ("ucx", "memory"):
                ok = other not in ({"ucx", "memory"} - {part})
            else:
                ok = other in ("top", "protocol") or name in FRONTS
            if not ok:
                bad.append(f"{name} -> {target}")
    return bad


def test_the_layering_check_finds_a_wrong_import() -> None:
    graph = {"lynx_transport.protocol.wire": {"lynx_transport.errors", "lynx_transport.config"},
             "lynx_transport.memory.loop": {"lynx_transport.ucx.loop", "lynx_transport.protocol.clock"},
             "lynx_transport.ucx.loop": {"lynx_transport.memory.loop"},
             "lynx_transport.config": {"lynx_transport.ucx.adapter"},
             "lynx_transport.seam": {"lynx_transport.ucx.receiver"}}
    assert layering_violations(graph) == ["lynx_transport.config -> lynx_transport.ucx.adapter",
                                          "lynx_transport.memory.loop -> lynx_transport.ucx.loop",
                                          "lynx_transport.protocol.wire -> lynx_transport.config",
                                          "lynx_transport.seam -> lynx_transport.ucx.receiver",
                                          "lynx_transport.ucx.loop -> lynx_transport.memory.loop"]


def test_the_transport_imports_one_way() -> None:
    known = modules()
    assert {"lynx_transport.protocol.wire", "lynx_transport.ucx.adapter",
            "lynx_transport.memory.transport"} <= set(known)  # the walk found the layers
    graph = {name: imports_of(name, path, known, typing_too=True) for name, path in known.items()}
    assert layering_violations(graph) == []


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_twin_reaches_no_ucx_module() -> None:
    known = modules()
    graph = {name: imports_of(name, path, known, typing_too=True) for name, path in known.items()}
    twin = [name for name in known if name.startswith("lynx_transport.memory.")]
    assert "lynx_transport.memory.transport" in twin
    assert "lynx_transport.seam" in reachable(graph, "lynx_transport.memory.transport")  # the walk works
    for name in twin:
        assert not {m for m in reachable(graph, name) if m.startswith("lynx_transport.ucx")}, name


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_a_subpackage_init_imports_nothing(package: str) -> None:
    path = modules()[package]
    assert path.name == "__init__.py"
    body = ast.parse(path.read_text()).body
    assert ast.get_docstring(ast.Module(body=body, type_ignores=[])), f"{package} has no docstring"
    assert all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body), \
        f"{package}/__init__.py does more than document its package"


def test_importing_the_transport_does_not_import_ucxx() -> None:
    probe = ("import sys\n"
             "import lynx_transport, lynx_transport.seam, lynx_transport.testing\n"
             "import lynx_transport.ucx.receiver, lynx_transport.ucx.connection, lynx_transport.ucx.egress\n"
             "from lynx_transport.testing import MemoryTransport\n"
             "MemoryTransport()\n"
             "print(sorted(n for n in sys.modules if n.split('.')[0] in ('ucxx', 'libucxx')))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
