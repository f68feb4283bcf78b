"""The Flower bridge's errors, under ``FlowerBridgeError``: what ``tensorswap.flower`` raises
when a Flower message's array reference cannot be trusted or its arrays cannot be had.

::

    FlowerBridgeError
    ├── BadReference        a reference record in a Flower message that does not decode or
    │                       breaks a bound (too many arrays, a bad CID, shape or dtype)
    ├── ReferenceMismatch   the arrays behind a reference disagree with what it claims
    │                       (names, shapes or dtypes)
    ├── ArraysUnavailable   the block service (and the swarm) could not deliver a reference's
    │                       blocks, or take a reply's, within the attempts allowed
    └── AggregateUnavailable  the block service did not aggregate a round's replies (no
                            coordinator there, a contribution refused, the round failed):
                            the strategy aggregates them in its own process instead
"""

from __future__ import annotations

from tensorswap.errors import TensorSwapError

__all__ = [
    "AggregateUnavailable",
    "ArraysUnavailable",
    "BadReference",
    "FlowerBridgeError",
    "ReferenceMismatch",
]


class FlowerBridgeError(TensorSwapError):
    """A Flower message's arrays could not travel through tensorswap's block service."""


class BadReference(FlowerBridgeError):
    """A reference record that does not decode, or breaks a bound; nothing was fetched."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"bad array reference {key!r}: {reason}")


class ReferenceMismatch(FlowerBridgeError):
    """The update behind a reference's root is not the arrays the reference describes."""

    def __init__(self, root: str, reason: str) -> None:
        self.root = root
        self.reason = reason
        super().__init__(f"arrays of {root} do not match their reference: {reason}")


class ArraysUnavailable(FlowerBridgeError):
    """Moving a reference's blocks failed on every attempt; the message is not delivered."""

    def __init__(self, what: str, address: str, attempts: int, cause: str) -> None:
        self.what = what
        self.address = address
        self.attempts = attempts
        self.cause = cause
        super().__init__(
            f"could not {what} through the block service at {address} "
            f"after {attempts} attempts: {cause}"
        )


class AggregateUnavailable(FlowerBridgeError):
    """The block service's coordinator did not give the aggregate of a round's replies
    (``round``: its key); ``BlockStrategy`` then aggregates the replies itself, as without
    the streamed path."""

    def __init__(self, round_key: str, address: str, cause: str) -> None:
        self.round = round_key
        self.address = address
        self.cause = cause
        super().__init__(
            f"the block service at {address} did not aggregate round {round_key}: {cause}"
        )
