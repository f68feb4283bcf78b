"""The runs branch of the error tree, defined in ``tensorswap.errors.runs`` (so that importing
``tensorswap.errors`` registers every remote refusal); re-exported here."""

from __future__ import annotations

from tensorswap.errors.runs import *  # noqa: F403
from tensorswap.errors.runs import __all__ as __all__
