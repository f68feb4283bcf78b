"""Every module of the package stays small enough to read in one sitting (STYLE.md, habit 11)."""

from __future__ import annotations

from pathlib import Path

import tensorswap

LIMIT = 520  # "roughly under 500 lines": a room that grows past this gets split

ROOT = Path(tensorswap.__file__).parent


def test_no_module_is_over_the_line_limit() -> None:
    sizes = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    too_big = {str(path): n for path, n in sizes.items() if n > LIMIT}
    assert not too_big, f"split these into rooms of their own: {too_big}"
