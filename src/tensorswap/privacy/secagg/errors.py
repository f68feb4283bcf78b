"""The secagg branch of the error tree, defined in ``tensorswap.errors.secagg`` (so that importing
``tensorswap.errors`` registers every remote refusal); re-exported here."""

from __future__ import annotations

from tensorswap.errors.secagg import *  # noqa: F403
from tensorswap.errors.secagg import __all__ as __all__
