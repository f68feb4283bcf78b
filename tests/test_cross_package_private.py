"""No package imports another package's private module or name: a room's private parts
(``wire._budget``, ``aggregate._kernels``, ...) are reached through its front. Shared
top-level helpers (``tensorswap._eventloop``, ``_netaddr``, ...) belong to no room."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tensorswap"


def _offences(text: str, name: str, room: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(text, name)):
        if not (isinstance(node, ast.ImportFrom) and node.module):
            continue
        parts = node.module.split(".")
        if parts[0] != "tensorswap" or len(parts) < 2 or parts[1] in (room, "errors"):
            continue
        if parts[1].startswith("_"):
            continue  # a top-level shared helper module
        if any(p.startswith("_") for p in parts[2:]):
            found.append(f"{name}:{node.lineno} imports {node.module}")
        found += [
            f"{name}:{node.lineno} imports {node.module}.{a.name}"
            for a in node.names
            if a.name.startswith("_") and not a.name.startswith("__")
        ]
    return found


def test_no_package_imports_another_packages_private_parts() -> None:
    offences = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        room = rel.parts[0].removesuffix(".py")
        offences += _offences(path.read_text(), str(rel), room)
    assert offences == []


def test_the_check_sees_a_private_module_and_a_private_name() -> None:
    text = (
        "from tensorswap.wire._budget import ByteBudget\n"
        "from tensorswap.aggregate import _kernels\n"
        "from tensorswap.runs.model import RunInfo\n"
        "from tensorswap._eventloop import run\n"
    )
    assert _offences(text, "cli/x.py", "cli") == [
        "cli/x.py:1 imports tensorswap.wire._budget",
        "cli/x.py:2 imports tensorswap.aggregate._kernels",
    ]
