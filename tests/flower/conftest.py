"""The Flower tests import their shared app (``apps``) by name: this folder on sys.path, so
that ``pytest tests/flower`` collects them without a PYTHONPATH of its own. Ray is told not
to warn about accelerators it does not see (the suite runs with warnings as errors)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
