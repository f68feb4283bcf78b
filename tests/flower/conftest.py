"""The Flower tests import their shared app (``apps``) by name: this folder on sys.path, so
that ``pytest tests/flower`` collects them without a PYTHONPATH of its own."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
