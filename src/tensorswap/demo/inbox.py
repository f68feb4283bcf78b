"""The demo peers' p2p inbox: the parts of other peers' deltas, by round, until each is whole."""

from __future__ import annotations

from collections.abc import Mapping
from math import prod
from typing import Any

import numpy as np

from tensorswap.demo.local import log

__all__ = ["SEQ_STRIDE", "DeltaInbox"]

# p2p fragments of round r carry sequence r * SEQ_STRIDE (room for the parts of a split delta).
SEQ_STRIDE = 1000


class DeltaInbox:
    """The parts of other peers' deltas, by round and sender, until each delta is whole.

    A delta above the size cap arrives as several parts (`split_fragment`) with consecutive
    sequences from ``round * SEQ_STRIDE``, possibly in any order and ahead of their round. A
    sender's delta is complete once its parts, from the first one on without a hole, carry as
    many values as the model has; `take` then reassembles it (checking that the slices join)
    and lays it out as name -> array like ``template``.
    """

    def __init__(self, template: Mapping[str, np.ndarray]) -> None:
        self.template = {k: np.asarray(v) for k, v in template.items()}
        self._values = sum(int(prod(v.shape)) for v in self.template.values())
        self._parts: dict[int, dict[str, dict[int, Any]]] = {}  # round -> sender -> seq -> part
        self._carried: dict[tuple[int, str], int] = {}

    def add(self, fragment: Any) -> None:
        """File one verified part under its round and sender (a repeated sequence is ignored)."""
        number = int(fragment.sequence) // SEQ_STRIDE
        parts = self._parts.setdefault(number, {}).setdefault(fragment.session_id, {})
        if fragment.sequence in parts:
            return
        parts[fragment.sequence] = fragment
        key = (number, fragment.session_id)
        self._carried[key] = self._carried.get(key, 0) + int(fragment.value_count)

    def complete(self, number: int, sender: str) -> bool:
        """True once every part of ``sender``'s delta for round ``number`` has arrived."""
        parts = self._parts.get(number, {}).get(sender)
        if not parts or self._carried.get((number, sender), 0) < self._values:
            return False
        first = number * SEQ_STRIDE
        return all(first + i in parts for i in range(len(parts)))

    def take(self, number: int) -> dict[str, dict[str, np.ndarray]]:
        """The complete deltas of round ``number`` by sender; forgets that round and older ones.

        A sender whose parts are incomplete (the deadline passed) or do not reassemble into
        one delta of the model's layers is left out, with a line on stderr.
        """
        from tensorswap.delta import apply_fragment, reassemble
        from tensorswap.errors import DeltaError

        deltas: dict[str, dict[str, np.ndarray]] = {}
        for sender, parts in sorted(self._parts.get(number, {}).items()):
            if not self.complete(number, sender):
                log(f"round {number}: {sender}'s delta is incomplete ({len(parts)} parts)")
                continue
            try:
                whole = reassemble([parts[seq] for seq in sorted(parts)])
                indices = sorted(layer.layer_index for layer in whole.layers)
                if indices != list(range(len(self.template))):
                    raise DeltaError(f"layers {indices} do not match the model's")
                states = [np.zeros_like(v) for v in self.template.values()]
                apply_fragment(states, whole)  # checks every layer's index and shape first
            except DeltaError as exc:
                log(f"round {number}: {sender}'s delta is refused: {exc}")
                continue
            deltas[sender] = dict(zip(self.template, states, strict=True))
        for old in [r for r in self._parts if r <= number]:
            for sender in self._parts.pop(old):
                self._carried.pop((old, sender), None)
        return deltas
