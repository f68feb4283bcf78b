"""The rounds layer's error leaves, all under ``RoundsError``; each carries its facts.

::

    RoundsError
    ├── RoundNotFound           (also KeyError) no round with that id
    ├── RoundAlreadyTerminal    (also RuntimeError) the round is Complete or Failed
    ├── RoundClosed             (also RuntimeError) the round takes no more contributions
    ├── DuplicateContribution   (also ValueError) this peer already contributed to this round
    ├── PeerNotAuthorised       (also PermissionError) no valid proof of the peer's own key
    ├── UnknownUpdate           (also LookupError) the update CID is not in the store
    ├── UpdateMismatch          (also ValueError) layer names, dtypes or shapes differ
    ├── InvalidUpdate           (also ValueError) the update's values cannot be aggregated
    ├── TooManySamples          (also ValueError) a contribution claims more samples than the cap
    ├── NonFiniteAggregate      a round's aggregate would hold NaN or Inf: the round fails
    ├── RoundFailed             the round ended Failed; its reason is attached
    ├── ContributionsLost       too few readable contributions left to aggregate (quorum)
    ├── InvalidRoundSpec        (also ValueError) a round configuration that cannot work
    ├── RoundTimeout            (also TimeoutError) waiting for a round's result timed out
    ├── JournalMissing          the journal is missing or empty next to a store with blocks
    ├── JournalDamaged          SQLite finds the journal damaged (quick_check, not a database)
    └── DataDirInUse            another process (a second ``serve``) holds the data directory
"""

from __future__ import annotations

from pathlib import Path

from tensorswap.errors import RoundsError

__all__ = [
    "ContributionsLost",
    "DataDirInUse",
    "DuplicateContribution",
    "InvalidRoundSpec",
    "InvalidUpdate",
    "JournalDamaged",
    "JournalMissing",
    "NonFiniteAggregate",
    "PeerNotAuthorised",
    "RoundAlreadyTerminal",
    "RoundClosed",
    "RoundFailed",
    "RoundNotFound",
    "RoundTimeout",
    "RoundsError",
    "TooManySamples",
    "UnknownUpdate",
    "UpdateMismatch",
]


class RoundNotFound(RoundsError, KeyError):
    """No round with this id exists (never started, or garbage-collected)."""

    def __init__(self, key: str) -> None:
        self.key = key
        super().__init__(f"Round not found: {key}")

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0])


class RoundAlreadyTerminal(RoundsError, RuntimeError):
    """The round is already Complete or Failed; nothing about it can change any more."""

    def __init__(self, key: str, status: str) -> None:
        self.key = key
        self.status = status
        super().__init__(f"Round {key} is already terminal (status: {status})")


class RoundClosed(RoundsError, RuntimeError):
    """The round stopped collecting: all expected peers submitted, or aggregation began."""

    def __init__(self, key: str, status: str, received: int, expected: int) -> None:
        self.key = key
        self.status = status
        self.received = received
        self.expected = expected
        super().__init__(
            f"Round {key} takes no more contributions (status: {status}, "
            f"{received} of {expected} peers submitted)"
        )


class DuplicateContribution(RoundsError, ValueError):
    """The peer already has an accepted contribution in this round; the first one stands.

    ``cid`` (an attribute only when the coordinator names it: older ones do not) is the
    update CID the round holds for the peer, so a client that resubmits after a lost answer
    can tell its own earlier submit from someone else's under the same name."""

    def __init__(self, key: str, peer: str, cid: str | None = None) -> None:
        self.key = key
        self.peer = peer
        held = ""
        if cid is not None:
            self.cid = cid
            held = f" (update {cid})"
        super().__init__(f"peer {peer!r} already contributed to round {key}{held}")


class PeerNotAuthorised(RoundsError, PermissionError):
    """The coordinator holds per-peer keys and this submit does not prove the peer's key
    (no proof, a wrong one, or a peer without a key): the connection may not act for it."""

    def __init__(self, key: str, peer: str, detail: str) -> None:
        self.key = key
        self.peer = peer
        self.detail = detail
        super().__init__(f"submit for peer {peer!r} to round {key} refused: {detail}")


class UnknownUpdate(RoundsError, LookupError):
    """A contribution names an update CID the coordinator's store does not hold."""

    def __init__(self, key: str, peer: str, cid: str, detail: str = "") -> None:
        self.key = key
        self.peer = peer
        self.cid = cid
        self.detail = detail
        more = f": {detail}" if detail else ""
        super().__init__(
            f"update {cid} from peer {peer!r} for round {key} is not in the store{more}"
        )


class UpdateMismatch(RoundsError, ValueError):
    """A contribution's layers (names, dtypes, shapes) differ from the round's."""

    def __init__(self, key: str, peer: str, detail: str) -> None:
        self.key = key
        self.peer = peer
        self.detail = detail
        super().__init__(f"update from peer {peer!r} does not fit round {key}: {detail}")


class InvalidUpdate(RoundsError, ValueError):
    """An update whose values cannot enter the aggregate (non-finite, unsupported dtype)."""

    def __init__(self, key: str, peer: str, detail: str) -> None:
        self.key = key
        self.peer = peer
        self.detail = detail
        super().__init__(f"update from peer {peer!r} refused for round {key}: {detail}")


class TooManySamples(RoundsError, ValueError):
    """A contribution claims more samples (its update's num_samples, its FedAvg weight)
    than the cap allows (``max_samples_per_peer``): refused, nothing recorded. A claim is
    the peer's word; the cap bounds how far one peer can outweigh the others."""

    def __init__(self, key: str, peer: str, claimed: int, cap: int) -> None:
        self.key = key
        self.peer = peer
        self.claimed = claimed
        self.cap = cap
        super().__init__(
            f"update from peer {peer!r} for round {key} claims {claimed} samples, above the "
            f"cap of {cap} (max_samples_per_peer); submit with num_samples <= {cap}"
        )


class NonFiniteAggregate(RoundsError):
    """A round's aggregate of finite contributions would hold NaN or Inf (a sum that
    overflowed its dtype): nothing is stored or published, the round fails with this."""

    def __init__(self, key: str, tensor: str, count: int, peers: str) -> None:
        self.key = key
        self.tensor = tensor
        self.count = count
        self.peers = peers
        super().__init__(
            f"round {key}: the aggregate of tensor {tensor!r} would hold {count} non-finite "
            f"value(s) (NaN or Inf: a sum overflowed); nothing published; contributions from "
            f"{peers}"
        )


class RoundFailed(RoundsError):
    """A round whose result was asked for ended Failed."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"round {key} failed: {reason}")


class InvalidRoundSpec(RoundsError, ValueError):
    """A round configuration that cannot work (no peers, quorum above expected, ...)."""


class RoundTimeout(RoundsError, TimeoutError):
    """Waiting for a round to reach a terminal status took longer than allowed."""

    def __init__(self, key: str, timeout: float, status: str) -> None:
        self.key = key
        self.timeout = timeout
        self.status = status
        super().__init__(f"round {key} not finished after {timeout:g} s (status: {status})")


class ContributionsLost(RoundsError):
    """Accepted contributions were left out of the aggregate (a block of theirs failed its
    hash check or vanished) and fewer than the round's quorum remain; the round fails."""

    def __init__(self, key: str, left: int, quorum: int, dropped: dict[str, str]) -> None:
        self.key = key
        self.left = left
        self.quorum = quorum
        self.dropped = dict(dropped)
        reasons = "; ".join(f"peer {p!r}: {why}" for p, why in list(self.dropped.items())[:4])
        super().__init__(
            f"round {key}: {left} readable contribution(s) left after dropping "
            f"{len(self.dropped)} (quorum {quorum}): {reasons}"
        )


class JournalMissing(RoundsError):
    """The round journal is missing or empty (``state``) while the block store holds blocks.

    Starting over it would silently forget every round and accepted contribution, so nothing
    was opened or created; start with ``reset=True`` (``tensorswap serve --reset``) to begin a
    fresh journal over the store on purpose.
    """

    def __init__(self, path: Path, state: str, store: str) -> None:
        self.path = path
        self.state = state
        self.store = store
        super().__init__(
            f"round journal {path} is {state} but the block store {store} holds blocks: "
            f"its rounds and contributions would be lost; refusing to start (reset starts "
            f"a fresh journal on purpose: tensorswap serve --reset)"
        )


class JournalDamaged(RoundsError):
    """SQLite finds the round journal damaged: ``PRAGMA quick_check`` failed, the file is not
    a database, or a row does not parse. ``detail`` is what SQLite (or the parser) said.
    """

    def __init__(self, path: Path, detail: str) -> None:
        self.path = path
        self.detail = detail
        super().__init__(
            f"round journal {path} is damaged: {detail} (restore it from a backup, or start "
            f"a fresh journal with tensorswap serve --reset, which keeps this one aside)"
        )


class DataDirInUse(RoundsError):
    """Another process (a second ``tensorswap serve``) holds the data directory's lock: two
    coordinators over one journal and store would corrupt each other's rounds."""

    def __init__(self, path: Path, lock: Path, pid: int | None) -> None:
        self.path = str(path)
        self.lock = str(lock)
        self.pid = pid
        holder = f"process {pid}" if pid is not None else "another process"
        super().__init__(
            f"data directory {path} is in use by {holder}, which holds its lock {lock}; "
            f"stop that server first, or give another data directory"
        )
