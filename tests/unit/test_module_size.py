"""Every module of the library stays small enough to read at once: at most 450 lines, and no
function over 80 lines (nested functions count within their parent). The Numba kernels are
the exception: a kernel is one loop nest that the compiler sees whole.

A module past the limit is asking to be split by what it holds (CONTRIBUTING.md, "Layout").
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.test_import_cycles import ROOT, modules

MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80
#: Modules of Numba kernels (``@njit`` loop nests), exempt from both limits.
KERNEL_MODULES = {"kernels/cpu_codec.py"}


def library_modules() -> list[Path]:
    found = sorted(modules().values())  # every module of the installed packages
    assert len(found) > 100 and (ROOT / "lynx_transport/seam.py") in found  # the walk found the tree
    return [p for p in found if p.relative_to(ROOT).as_posix() not in KERNEL_MODULES]


def long_functions(path: Path, limit: int) -> list[str]:
    """``path:line name (n lines)`` for each function of ``path`` longer than ``limit`` lines."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > limit:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return out


def test_the_function_check_finds_a_long_function() -> None:
    path = ROOT / "tests" / "unit" / Path(__file__).name
    assert long_functions(path, 3)  # this file has functions longer than 3 lines
    assert not long_functions(path, 1000)


def test_no_module_is_over_the_limit() -> None:
    long = {p.relative_to(ROOT).as_posix(): n for p in library_modules()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_over_the_limit() -> None:
    long = [f for p in library_modules() for f in long_functions(p, MAX_FUNCTION_LINES)]
    assert long == [], f"functions over {MAX_FUNCTION_LINES} lines: {long}"
