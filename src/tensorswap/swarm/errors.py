"""The swarm's errors: refused writes to a seeder, a fetch no source could finish, bad messages."""

from __future__ import annotations

from tensorswap.errors import StoreError, TensorSwapError

__all__ = ["BadSwarmMessage", "SwarmError", "SwarmExhausted", "SwarmReadOnly"]


class SwarmError(TensorSwapError):
    """Swarm distribution (tracker, seeder, fetcher) failed."""


class SwarmReadOnly(SwarmError, StoreError):
    """A seeder refuses to store a block: peers serve what they hold, nobody pushes to them."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"a swarm seeder is read-only: refused {what}")


class SwarmExhausted(SwarmError):
    """A swarm fetch ended with chunks that no source (the coordinator included) delivered."""

    def __init__(self, root: str, lacking: int, first: str, failures: list[str]) -> None:
        self.root = root
        self.lacking = lacking
        self.first = first
        self.failures = failures
        tail = "; ".join(failures[-4:]) or "no source failed"
        super().__init__(
            f"swarm fetch of {root}: {lacking} chunks delivered by no source (first {first}); "
            f"source failures: {tail}"
        )


class BadSwarmMessage(SwarmError):
    """A tracker or seeder message that does not decode, or breaks a swarm limit."""

    def __init__(self, reason: str, peer: str = "") -> None:
        self.reason = reason
        self.peer = peer
        where = f" from {peer}" if peer else ""
        super().__init__(f"bad swarm message{where}: {reason}")
