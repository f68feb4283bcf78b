"""The runs layer's errors, under ``RunsError`` (a branch of ``RoundsError``).

::

    RunsError
    ├── InvalidRunSpec      (also ValueError) a run configuration that cannot work
    ├── RunNotFound         (also KeyError) no run with that name
    ├── RunExists           a run with that name exists already (with another spec)
    ├── NotRegistered       (also LookupError) a peer that never registered asks for work
    ├── NotSelected         a peer not sampled for this round of the run submits to it
    ├── BufferBusy          an asynchronous run has no buffer open to this contribution now
    ├── StaleContribution   an asynchronous contribution trained on too old a version
    ├── FutureVersion       a contribution tagged with a version the run has not made yet
    ├── NonFiniteModel      (also ValueError) an initial model holding NaN or Inf
    └── NonFiniteStep       a step or release would publish NaN or Inf: refused, the run
                            stays on its last finite version
"""

from __future__ import annotations

from tensorswap.errors import RoundsError, register_remote

__all__ = [
    "BufferBusy",
    "FutureVersion",
    "InvalidRunSpec",
    "NonFiniteModel",
    "NonFiniteStep",
    "NotRegistered",
    "NotSelected",
    "RunExists",
    "RunNotFound",
    "RunsError",
    "StaleContribution",
]


class RunsError(RoundsError):
    """A federated run (a global model across rounds) could not do what was asked."""


class InvalidRunSpec(RunsError, ValueError):
    """A run configuration that cannot work (no clients, a fraction outside (0, 1], ...)."""


class RunNotFound(RunsError, KeyError):
    """No run with this name exists."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"run not found: {name!r}")

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message
        return str(self.args[0])


class RunExists(RunsError):
    """A run with this name exists already, with another spec or initial model."""

    def __init__(self, name: str, detail: str) -> None:
        self.name = name
        self.detail = detail
        super().__init__(f"run {name!r} exists already: {detail}")


class NotRegistered(RunsError, LookupError):
    """A peer asked a run for work without registering first."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        super().__init__(f"peer {peer!r} is not registered (register before asking for tasks)")


class NotSelected(RunsError):
    """A peer submitted to a round of a run it was not sampled for."""

    def __init__(self, run: str, round: int, peer: str, selected: int) -> None:
        self.run = run
        self.round = round
        self.peer = peer
        self.selected = selected
        super().__init__(
            f"peer {peer!r} was not selected for round {round} of run {run!r} "
            f"({selected} peer(s) were); wait for a task that names you"
        )


class BufferBusy(RunsError):
    """An asynchronous run has no buffer open to this peer's contribution right now: the
    current one is being stepped into a version, or already holds this peer's delta. The
    runs service waits for the next buffer and retries by itself; an in-process caller
    waits for the run's next change and submits again."""

    def __init__(self, run: str, round: int, peer: str) -> None:
        self.run = run
        self.round = round
        self.peer = peer
        super().__init__(
            f"run {run!r}: buffer {round} takes no contribution from peer {peer!r} now "
            "(full, being stepped, or holding its delta already); submit again when the "
            "next buffer opens"
        )


class StaleContribution(RunsError):
    """An asynchronous contribution trained on a global version older than allowed."""

    def __init__(self, run: str, peer: str, trained_on: int, current: int, limit: int) -> None:
        self.run = run
        self.peer = peer
        self.trained_on = trained_on
        self.current = current
        self.limit = limit
        super().__init__(
            f"contribution from peer {peer!r} to run {run!r} trained on version {trained_on}, "
            f"the global model is at version {current}: staleness {current - trained_on} "
            f"exceeds max_staleness {limit}; fetch the current model and train again"
        )


class FutureVersion(RunsError):
    """A contribution says it trained on a version the run has not made yet (a peer's
    clock, cache or bug; never a version it was handed): refused."""

    def __init__(self, run: str, peer: str, trained_on: int, current: int) -> None:
        self.run = run
        self.peer = peer
        self.trained_on = trained_on
        self.current = current
        super().__init__(
            f"contribution from peer {peer!r} to run {run!r} says it trained on version "
            f"{trained_on}, but the run is at version {current}: no such version yet; "
            f"train on the task's version (fetch the current model)"
        )


class NonFiniteModel(RunsError, ValueError):
    """A model a run would start from holds NaN or infinite values (``run create``)."""

    def __init__(self, run: str, tensor: str, count: int, what: str = "initial model") -> None:
        self.run = run
        self.tensor = tensor
        self.count = count
        self.what = what
        super().__init__(
            f"run {run!r}: the {what}'s tensor {tensor!r} holds {count} non-finite value(s) "
            f"(NaN or Inf); a run starts from a finite model"
        )


class NonFiniteStep(RunsError):
    """A run's step would publish NaN or Inf: ``stage`` is where it was found (``aggregate``,
    ``DP release``, ``SecAgg release``, ``optimizer step``, ``optimizer state``). Nothing is
    published: the round fails with this as its reason (journaled, with the facts, in the
    run's refusals), the run stays on version ``current`` and goes on with a new round
    (a sync run) or buffer (async). ``peers`` names the round's contributions (a
    comma-separated list; at most 8, then a count)."""

    def __init__(
        self,
        run: str,
        round: int,
        version: int,
        current: int,
        stage: str,
        tensor: str,
        count: int,
        peers: str,
    ) -> None:
        self.run = run
        self.round = round
        self.version = version
        self.current = current
        self.stage = stage
        self.tensor = tensor
        self.count = count
        self.peers = peers
        super().__init__(
            f"run {run!r} round {round}: the {stage} would make version {version} non-finite "
            f"(tensor {tensor!r}: {count} NaN/Inf value(s)), from the contributions of "
            f"{peers or 'no peer'}; refused: the run stays on version {current} and goes on"
        )


register_remote(
    *(c for n in __all__ if isinstance(c := globals()[n], type) and issubclass(c, RunsError))
)
