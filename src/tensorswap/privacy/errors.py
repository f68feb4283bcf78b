"""The privacy branch of the error tree, defined in ``tensorswap.errors.privacy`` (so that importing
``tensorswap.errors`` registers every remote refusal); re-exported here."""

from __future__ import annotations

from tensorswap.errors.privacy import *  # noqa: F403
from tensorswap.errors.privacy import __all__ as __all__
