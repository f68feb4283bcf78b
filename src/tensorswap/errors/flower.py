"""The Flower bridge's errors, under ``FlowerBridgeError``: what ``tensorswap.flower`` raises
when a Flower message's array reference cannot be trusted or its arrays cannot be had.

::

    FlowerBridgeError
    ├── BadReference        a reference record in a Flower message that does not decode or
    │                       breaks a bound (too many arrays, a bad CID, shape or dtype)
    ├── ReferenceMismatch   the arrays behind a reference disagree with what it claims
    │                       (names, shapes or dtypes)
    └── ArraysUnavailable   the block service (and the swarm) could not deliver a reference's
                            blocks, or take a reply's, within the attempts allowed
"""

from __future__ import annotations

from tensorswap.errors import TensorSwapError

__all__ = ["ArraysUnavailable", "BadReference", "FlowerBridgeError", "ReferenceMismatch"]


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
