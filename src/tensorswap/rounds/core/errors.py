"""The rounds branch of the error tree, defined in ``tensorswap.errors.rounds`` (so that importing
``tensorswap.errors`` registers every remote refusal); re-exported here."""

from __future__ import annotations

from tensorswap.errors.rounds import *  # noqa: F403
from tensorswap.errors.rounds import __all__ as __all__
