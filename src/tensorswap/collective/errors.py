"""The collective's errors, defined in ``tensorswap.errors.collective``; re-exported here."""

from __future__ import annotations

from tensorswap.errors.collective import *  # noqa: F403
from tensorswap.errors.collective import __all__ as __all__
