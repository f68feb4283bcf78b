"""rounds/ is sub-packages behind fronts, layered bottom up (docs/architecture.md, "Rounds")."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import tensorswap

ROOT = Path(tensorswap.__file__).parent
ROUNDS = ROOT / "rounds"

LAYERS: dict[str, int] = {
    "core": 0,  # ids, specs, states, the tracker, clocks, errors, counters
    "journal": 1,  # the rounds journal in SQLite
    "storage": 2,  # block store tiers, retention, data directory locks
    "engine": 3,  # the coordinator and its intake, screen, fold, compute, result, retry
    "protocol": 4,  # messages and their codec, inline, batch, paging, push
    "server": 5,  # RoundServer (server and client share the top layer and
    "client": 5,  # import neither each other nor tensorswap.rounds itself)
}
"""A sub-package imports its own modules and lower layers' (front or modules), never a higher
layer's, another of its layer's or the room front ``tensorswap.rounds``."""

TYPING_UPWARD = {("protocol/paging.py", "client")}
"""Imports of a higher layer for type annotations only (under ``TYPE_CHECKING``: no import
at run time): ``page_rounds`` and ``page_peers`` take a ``RoundClient``."""


def _imports(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import in ``tree`` and whether it sits under ``if TYPE_CHECKING:``."""

    def walk(
        node: ast.AST, typing_only: bool
    ) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                yield child, typing_only
            elif isinstance(child, ast.If) and ast.unparse(child.test) == "TYPE_CHECKING":
                for stmt in child.body:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), True)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), typing_only)
            else:
                yield from walk(child, typing_only)

    yield from walk(tree, False)


def _rounds_targets(node: ast.Import | ast.ImportFrom) -> Iterator[tuple[str, list[str]]]:
    """The ``tensorswap.rounds...`` modules ``node`` imports, each with the names it takes."""
    if isinstance(node, ast.ImportFrom):
        module = node.module or ""
        if node.level == 0 and (
            module == "tensorswap.rounds" or module.startswith("tensorswap.rounds.")
        ):
            yield module, [alias.name for alias in node.names]
    else:
        for alias in node.names:
            if alias.name == "tensorswap.rounds" or alias.name.startswith("tensorswap.rounds."):
                yield alias.name, []


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_every_module_sits_in_a_sub_package() -> None:
    assert sorted(p.name for p in ROUNDS.glob("*.py")) == ["__init__.py"]
    subs = sorted(p.name for p in ROUNDS.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert subs == sorted(LAYERS)
    for sub in subs:
        assert (ROUNDS / sub / "__init__.py").is_file(), sub
        nested = [
            p.name for p in (ROUNDS / sub).iterdir() if p.is_dir() and p.name != "__pycache__"
        ]
        assert not nested, f"rounds/{sub} has sub-packages of its own: {nested}"


def test_each_front_exports_sorted_importable_names() -> None:
    for package in ["tensorswap.rounds", *(f"tensorswap.rounds.{sub}" for sub in LAYERS)]:
        front = importlib.import_module(package)
        names = front.__all__
        assert names, package
        assert len(set(names)) == len(names), package
        missing = [name for name in names if not hasattr(front, name)]
        assert not missing, f"{package}.__all__ names what it does not hold: {missing}"


def test_the_room_front_imports_only_the_sub_packages_fronts() -> None:
    for node, _typing in _imports(_parse(ROUNDS / "__init__.py")):
        for module, _names in _rounds_targets(node):
            assert module.removeprefix("tensorswap.rounds.") in LAYERS, module


def test_code_outside_rounds_imports_only_fronts() -> None:
    fronts = {"tensorswap.rounds", *(f"tensorswap.rounds.{sub}" for sub in LAYERS)}
    exported = {name: set(importlib.import_module(name).__all__) for name in fronts}
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        if ROUNDS in path.parents:
            continue
        for node, _typing in _imports(_parse(path)):
            for module, names in _rounds_targets(node):
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                if module not in fronts:
                    wrong.append(f"{where} imports {module}")
                elif isinstance(node, ast.Import):
                    wrong.append(f"{where} imports {module} as a module")
                else:
                    wrong += [
                        f"{where}: {module} does not export {name}"
                        for name in names
                        if name not in exported[module]
                    ]
    assert not wrong, (
        "outside rounds/, import tensorswap.rounds or its sub-packages' fronts:\n"
        + "\n".join(wrong)
    )


def test_no_sub_package_imports_a_higher_layer() -> None:
    wrong = []
    for path in sorted(ROUNDS.glob("*/*.py")):
        sub = path.parent.name
        rel = f"{sub}/{path.name}"
        for node, typing_only in _imports(_parse(path)):
            for module, _names in _rounds_targets(node):
                parts = module.split(".")
                other = parts[2] if len(parts) > 2 else "tensorswap.rounds"
                if other == sub:
                    continue
                if other in LAYERS and LAYERS[other] < LAYERS[sub]:
                    continue
                if typing_only and (rel, other) in TYPING_UPWARD:
                    continue
                wrong.append(f"rounds/{rel}:{node.lineno} ({sub}) imports {module}")
    assert not wrong, "a layer of rounds imports only lower layers:\n" + "\n".join(wrong)


def test_the_listed_typing_only_imports_still_exist() -> None:
    for rel, other in TYPING_UPWARD:
        found = [
            module
            for node, typing_only in _imports(_parse(ROUNDS / rel))
            if typing_only
            for module, _names in _rounds_targets(node)
            if module.startswith(f"tensorswap.rounds.{other}")
        ]
        assert found, (
            f"rounds/{rel} no longer imports {other} for typing: drop it from TYPING_UPWARD"
        )
