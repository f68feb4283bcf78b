"""Every module of the package stays small enough to read in one sitting, and every function
does one thing (STYLE.md, habit 11): at most 500 lines a file, 80 a function."""

from __future__ import annotations

import ast
from pathlib import Path

import tensorswap

LIMIT = 500  # lines per module: a room that grows past this gets split
FUNCTION_LIMIT = 80  # lines per function or method, its decorators included

ROOT = Path(tensorswap.__file__).parent


def _modules() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted(ROOT.rglob("*.py"))}


def _function_sizes(tree: ast.AST, prefix: str = "") -> dict[str, int]:
    """Lines of each function and method below ``tree`` (nested ones too), by qualified name."""
    sizes: dict[str, int] = {}
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            assert node.end_lineno is not None
            sizes[prefix + node.name] = node.end_lineno - first + 1
            sizes.update(_function_sizes(node, f"{prefix}{node.name}."))
        elif isinstance(node, ast.ClassDef):
            sizes.update(_function_sizes(node, f"{prefix}{node.name}."))
        else:
            sizes.update(_function_sizes(node, prefix))
    return sizes


def test_no_module_is_over_the_line_limit() -> None:
    sizes = {path: len(text.splitlines()) for path, text in _modules().items()}
    too_big = {path: n for path, n in sizes.items() if n > LIMIT}
    assert not too_big, f"split these into rooms of their own (at most {LIMIT} lines): {too_big}"


def test_no_function_is_over_the_line_limit() -> None:
    too_long = {}
    for path, text in _modules().items():
        for name, n in _function_sizes(ast.parse(text)).items():
            where = f"{path}:{name}"
            if n > FUNCTION_LIMIT:
                too_long[where] = n
    assert not too_long, f"split these (at most {FUNCTION_LIMIT} lines each): {too_long}"


def test_the_counts_see_decorators_and_methods() -> None:
    source = (
        "class A:\n"
        "    @staticmethod\n"
        "    def f():\n"
        "        pass\n"
        "\n"
        "\n"
        "def g():\n"
        "    def h():\n"
        "        pass\n"
    )
    assert _function_sizes(ast.parse(source)) == {"A.f": 3, "g": 3, "g.h": 2}
