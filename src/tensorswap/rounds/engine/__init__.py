"""Rounds engine: the coordinator and what it runs (intake, screening, folding, computing the
aggregate, writing the result, retrying transient failures)."""

from tensorswap.rounds.engine._open import STORE_DIRNAME
from tensorswap.rounds.engine.coordinator import DEFAULT_GC_GRACE, Coordinator
from tensorswap.rounds.engine.fold import load_pieces
from tensorswap.rounds.engine.hooks import Admission, CoordinatorHooks, HookList
from tensorswap.rounds.engine.updates import (
    UpdateFacts,
    aggregator_spec,
    count_nonfinite,
    inspect_update,
)

__all__ = [
    "DEFAULT_GC_GRACE",
    "STORE_DIRNAME",
    "Admission",
    "Coordinator",
    "CoordinatorHooks",
    "HookList",
    "UpdateFacts",
    "aggregator_spec",
    "count_nonfinite",
    "inspect_update",
    "load_pieces",
]
