"""One round's cut-through state (``rounds.engine.cut``'s, guarded by its ``lock``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from tensorswap.aggregate import AggregatorSpec
from tensorswap.cid import Cid
from tensorswap.rounds.core.state import Layout
from tensorswap.rounds.engine._cut_pace import Pacing
from tensorswap.rounds.engine._cut_parse import Announced
from tensorswap.store import ChunkRef

__all__ = ["Piece", "RoundCut"]

Piece = tuple[int, int]  # (tensor index in layout order, chunk index)


@dataclass(slots=True)
class RoundCut:
    """What a coordinator knows of one cut-through round: its announcements, the pieces
    present, the values held for their folds, the result's pieces so far."""

    spec: AggregatorSpec
    expected: int
    layout: Layout | None
    announced: dict[str, Announced] = field(default_factory=dict)
    present: dict[Piece, set[str]] = field(default_factory=dict)
    held: dict[tuple[Piece, str], np.ndarray] = field(default_factory=dict)
    nonfinite: dict[str, dict[Piece, int]] = field(default_factory=dict)
    results: dict[Piece, ChunkRef] = field(default_factory=dict)
    progress: list[Cid] = field(default_factory=list)
    abandoned: str | None = None
    ended: bool = False
    order: tuple[str, ...] = ()  # the announced peers by name, once all have announced
    pacing: Pacing = field(default_factory=Pacing)
    lock: threading.Lock = field(default_factory=threading.Lock)
    settled: threading.Condition = field(init=False)  # a claimed piece stored or let go

    def __post_init__(self) -> None:
        self.settled = threading.Condition(self.lock)

    @property
    def pieces(self) -> int:
        first = next(iter(self.announced.values()), None)
        return 0 if first is None else sum(len(t.chunks) for t in first.tensors)
