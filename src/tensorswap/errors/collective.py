"""The collective branch of the error tree (peers averaging among themselves).

::

    CollectiveError
    ├── BadCollectiveMessage   a rendezvous or peer message that does not decode, or breaks
    │                          a limit (names, groups, members, sizes)
    ├── JoinTimedOut           the group did not reach its size before the join's timeout
    ├── GroupMismatch          a join whose size (or a call whose layout) disagrees with the
    │                          group's
    ├── CommitmentMismatch     a peer sent slice bytes that are not the ones it committed to
    │                          (the peer is named and excluded)
    ├── PeerExcluded           this peer was dropped from the call (found dead, or excluded)
    ├── RelayRefused           the rendezvous did not take a block to relay (``liar``: one
    │                          its sender never committed to)
    ├── TooFewPeers            fewer survivors than the call's quorum: it cannot complete
    └── ResultMismatch         two members ended a call with different result roots
"""

from __future__ import annotations

from tensorswap.errors import TensorSwapError

__all__ = [
    "BadCollectiveMessage",
    "CollectiveError",
    "CommitmentMismatch",
    "GroupMismatch",
    "JoinTimedOut",
    "PeerExcluded",
    "RelayRefused",
    "ResultMismatch",
    "TooFewPeers",
]


class CollectiveError(TensorSwapError):
    """A collective call (join, all-reduce) among peers could not complete as asked."""


class BadCollectiveMessage(CollectiveError):
    """A collective message that does not decode, or breaks one of the collective's limits."""

    def __init__(self, reason: str, peer: str = "") -> None:
        self.reason = reason
        self.peer = peer
        where = f" from {peer}" if peer else ""
        super().__init__(f"bad collective message{where}: {reason}")


class JoinTimedOut(CollectiveError, TimeoutError):
    """The group stayed below its size for the whole join timeout."""

    def __init__(self, group: str, have: int, size: int, waited: float) -> None:
        self.group = group
        self.have = have
        self.size = size
        self.waited = waited
        super().__init__(
            f"group {group!r} had {have} of {size} peers after {waited:.1f} s of waiting"
        )


class GroupMismatch(CollectiveError):
    """A peer's join or call disagrees with its group (size, tensor names/shapes)."""

    def __init__(self, group: str, reason: str) -> None:
        self.group = group
        self.reason = reason
        super().__init__(f"group {group!r}: {reason}")


class CommitmentMismatch(CollectiveError):
    """A peer's slice bytes do not match the CIDs it committed to; it is excluded."""

    def __init__(self, peer: str, call: int, detail: str) -> None:
        self.peer = peer
        self.call = call
        self.detail = detail
        super().__init__(f"peer {peer!r} broke its commitment in call {call}: {detail}")


class PeerExcluded(CollectiveError):
    """This peer was dropped from a call by its group (found dead, late, or a liar)."""

    def __init__(self, peer: str, call: int, reason: str) -> None:
        self.peer = peer
        self.call = call
        self.reason = reason
        super().__init__(f"peer {peer!r} was dropped from call {call}: {reason}")


class TooFewPeers(CollectiveError):
    """Fewer peers are left in a call than its quorum; ``dropped`` says who and why."""

    def __init__(self, call: int, left: int, quorum: int, dropped: dict[str, str]) -> None:
        self.call = call
        self.left = left
        self.quorum = quorum
        self.dropped = dict(dropped)
        why = "; ".join(f"{p}: {r}" for p, r in sorted(dropped.items())) or "none dropped"
        super().__init__(f"call {call}: {left} peers left, quorum {quorum} ({why})")


class ResultMismatch(CollectiveError):
    """Two members of a call ended with different result roots (never silently diverge)."""

    def __init__(self, call: int, mine: str, theirs: str, peer: str) -> None:
        self.call = call
        self.mine = mine
        self.theirs = theirs
        self.peer = peer
        super().__init__(f"call {call}: result root {mine} differs from {peer!r}'s {theirs}")


class RelayRefused(CollectiveError):
    """A block the rendezvous did not take to relay; ``liar`` when it is not a block its sender
    committed to (the rendezvous then drops the sender)."""

    def __init__(self, reason: str, *, liar: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.liar = liar
