"""Where the benchmarks find Flower: the Python of a venv of its own with
``flwr[simulation]==1.42.0`` (flwr is never a dependency of tensorswap: it pulls grpcio,
Ray and ~40 other packages, and pins versions the dev environment upgrades).

``make flower-venv`` makes one at ``.venv-flower`` in the repository; the environment's
``TENSORSWAP_FLOWER_PYTHON`` names any other. Without either, the benchmarks run without
Flower and say so.
"""

from __future__ import annotations

import os
from pathlib import Path

VENV = Path(__file__).resolve().parents[1] / ".venv-flower"
ENV = "TENSORSWAP_FLOWER_PYTHON"


def flower_python() -> str | None:
    """The interpreter to run Flower with, or None when there is none."""
    named = os.environ.get(ENV) or os.environ.get("TENSORSWAP_FLWR_PYTHON")
    if named:
        return named
    python = VENV / "bin" / "python"
    return str(python) if python.exists() else None
