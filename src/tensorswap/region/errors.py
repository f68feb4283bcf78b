"""The region branch of the error tree, defined in ``tensorswap.errors.region`` (so that importing
``tensorswap.errors`` registers every remote refusal); re-exported here."""

from __future__ import annotations

from tensorswap.errors.region import *  # noqa: F403
from tensorswap.errors.region import __all__ as __all__
