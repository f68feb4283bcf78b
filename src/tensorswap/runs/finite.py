"""Finite models only: what a run starts from, steps to and releases is checked for NaN and
Inf before anything names it (one pass per chunk, ``rounds.engine.updates.count_nonfinite``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tensorswap.rounds.core import Contribution
from tensorswap.rounds.engine import UpdateFacts, count_nonfinite, load_pieces
from tensorswap.runs.errors import NonFiniteModel, NonFiniteStep

if TYPE_CHECKING:  # runs.model imports privacy, whose RunPrivacy imports this
    from tensorswap.runs.model import RunInfo
from tensorswap.store import BlockStore

__all__ = ["FiniteGuard", "check_initial", "check_tensors", "peers_of"]

SHOWN_PEERS = 8
"""How many peers a refusal names (then a count)."""


def peers_of(contributions: Sequence[Contribution]) -> str:
    """The contributions' peers as a refusal names them: ``'a', 'b' and 3 more``."""
    shown = ", ".join(repr(c.peer) for c in contributions[:SHOWN_PEERS])
    more = len(contributions) - SHOWN_PEERS
    return f"{shown} and {more} more" if more > 0 else shown


@dataclass(frozen=True, slots=True)
class FiniteGuard:
    """Checks the pieces one step of run ``run`` computes: round ``round`` would make
    version ``version`` from version ``current``, from the contributions of ``peers``.
    ``check`` raises NonFiniteStep (with these facts) for a piece that holds NaN or Inf."""

    run: str
    round: int
    version: int
    current: int
    peers: str

    @classmethod
    def of(cls, info: RunInfo, contributions: Sequence[Contribution]) -> FiniteGuard:
        """The guard of the step of ``info``'s round from its current version."""
        return cls(info.name, info.round, info.version + 1, info.version, peers_of(contributions))

    def check(self, stage: str, tensor: str, values: np.ndarray) -> None:
        bad = count_nonfinite(values)
        if bad:
            raise NonFiniteStep(
                self.run, self.round, self.version, self.current, stage, tensor, bad, self.peers
            )

    def check_all(self, stage: str, tensors: Mapping[str, np.ndarray]) -> None:
        for name, values in tensors.items():
            self.check(stage, name, values)


def check_tensors(run: str, tensors: Iterable[tuple[str, np.ndarray]], what: str) -> None:
    """NonFiniteModel naming the first tensor (name, values) that holds NaN or Inf."""
    for name, values in tensors:
        bad = count_nonfinite(np.asarray(values))
        if bad:
            raise NonFiniteModel(run, name, bad, what)


def check_initial(store: BlockStore, facts: UpdateFacts, run: str) -> None:
    """NonFiniteModel unless every value of the stored update ``facts`` is finite: read
    chunk by chunk (views of the stored chunks, re-hashed as read; no copies)."""
    pieces, _, _ = load_pieces(store, facts, None)
    check_tensors(run, ((key.partition("@")[2], p) for key, p in pieces.items()), "initial model")
