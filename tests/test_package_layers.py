"""No import cycle between tensorswap's top-level packages (issue 24).

Every ``import tensorswap.X`` / ``from tensorswap.X... import`` in a module of package P
(module level, in functions, under TYPE_CHECKING alike) is an edge P -> X; the graph of
those edges must have no cycle, so each room can be read, tested and replaced from the
bottom up. (Before: privacy -> runs -> privacy, the privacy ledger and run release being
runs code inside privacy/.)
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import tensorswap

ROOT = Path(tensorswap.__file__).parent


def package_edges() -> dict[str, set[str]]:
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    edges: dict[str, set[str]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if len(parts) < 2:
            continue  # tensorswap/__init__.py and top-level modules: the front, above all
        me = parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                bits = name.split(".")
                if bits[0] == "tensorswap" and len(bits) > 1 and bits[1] in packages - {me}:
                    edges[me].add(bits[1])
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as the path that closes it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_walk_sees_the_known_edges() -> None:
    edges = package_edges()
    assert "rounds" in edges["runs"] and "privacy" in edges["runs"]  # a walk that saw nothing


def test_no_cycle_between_top_level_packages() -> None:
    cycle = find_cycle(package_edges())
    assert cycle is None, "import cycle between packages: " + " -> ".join(cycle or [])


def test_privacy_is_a_pure_library() -> None:
    """privacy/ (DP mechanisms, the accountant, SecAgg+) imports no runs code."""
    assert "runs" not in package_edges()["privacy"]


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
