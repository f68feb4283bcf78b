"""No two modules of one room (a package directory) import each other, directly or around a
circle: imports at module level, inside functions and under ``TYPE_CHECKING`` all count (a
type-only import still means the module knows the other). Package fronts (``__init__``) are
left out: importing a room's front is the layering tests' business."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

import tensorswap

ROOT = Path(tensorswap.__file__).parent

ALLOWED: dict[frozenset[str], str] = {
    frozenset({"tensorswap.demo.inbox", "tensorswap.demo.local"}): (
        "the demo peer's state names its inbox (type only); the inbox logs with the peer's log line"
    ),
    frozenset({"tensorswap.demo.driver", "tensorswap.demo.run_driver"}): (
        "the driver picks the runs federation per mode, lazily; it runs on the driver's "
        "_Run (type only)"
    ),
    frozenset({"tensorswap.netlab.lab", "tensorswap.netlab.reorder"}): (
        "Host.shuffle_to starts the shuffler lazily (Linux only); the shuffler drives the "
        "Host it is given (type only)"
    ),
    frozenset({"tensorswap.simulate.backends", "tensorswap.simulate.ray_backend"}): (
        "make_backend loads the Ray backend (an optional dependency) only when asked; it "
        "reuses the backends' timeouts and gather"
    ),
}
"""Circles left as they are, each with its reason (none in rounds, runs, region, privacy)."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(name: str, path: Path, tree: ast.AST, known: dict[str, Path]) -> Iterator[str]:
    """The known modules ``tree`` (module ``name``) imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


@functools.cache
def _room_cycles() -> frozenset[frozenset[str]]:
    """Every strongly connected set of two or more modules within one room."""
    known = _modules()
    room = {m: m.rpartition(".")[0] for m, p in known.items() if p.name != "__init__.py"}
    edges = {
        m: {t for t in _imported(m, known[m], ast.parse(known[m].read_text()), known)}
        & {o for o, r in room.items() if r == room[m]}
        for m in room
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[frozenset[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(frozenset(group))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return frozenset(cycles)


def test_no_import_cycles_within_a_room() -> None:
    new = sorted(sorted(c) for c in _room_cycles() - ALLOWED.keys())
    assert not new, f"modules of one room import each other: {new}"


def test_every_allowed_cycle_is_still_there() -> None:
    gone = sorted(sorted(c) for c in ALLOWED.keys() - _room_cycles())
    assert not gone, f"resolved: take these off ALLOWED: {gone}"


def test_the_check_sees_a_function_level_and_a_typing_only_import(tmp_path: Path) -> None:
    source = "if TYPE_CHECKING:\n    from a.b import X\ndef f():\n    from .c import y\n"
    known = {"a.b": tmp_path, "a.c": tmp_path, "a.d": tmp_path}
    got = set(_imported("a.d", tmp_path / "d.py", ast.parse(source), known))
    assert got == {"a.b", "a.c"}
