"""The Flower bridge's errors, defined in ``tensorswap.errors.flower``; re-exported here."""

from __future__ import annotations

from tensorswap.errors.flower import *  # noqa: F403
from tensorswap.errors.flower import __all__ as __all__
