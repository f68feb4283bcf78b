"""The client registry: peers register with a name and a few facts, heartbeat, go inactive."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence

from tensorswap.rounds.core import Clock
from tensorswap.runs.errors import InvalidRunSpec, NotRegistered
from tensorswap.runs.journal import RunDatabase
from tensorswap.runs.model import ClientInfo, Param

__all__ = ["DEFAULT_INACTIVE_AFTER", "MAX_FACTS", "MAX_FACT_BYTES", "ClientRegistry", "check_facts"]

DEFAULT_INACTIVE_AFTER = 60.0
"""Seconds without a heartbeat (or any request) after which a registered peer is inactive."""
MAX_FACTS = 16
"""The most facts a peer registers (``num_samples``, tags, ...)."""
MAX_FACT_BYTES = 256
"""The longest fact name or string value (UTF-8 bytes)."""


def check_facts(facts: Mapping[str, object]) -> dict[str, Param]:
    """The facts as stored: at most MAX_FACTS, short names, ints / finite floats / short
    strings (InvalidRunSpec otherwise). ``num_samples``, if given, is an int >= 0."""
    if len(facts) > MAX_FACTS:
        raise InvalidRunSpec(f"at most {MAX_FACTS} facts, got {len(facts)}")
    out: dict[str, Param] = {}
    for key, value in facts.items():
        if not isinstance(key, str) or not key or len(key.encode()) > MAX_FACT_BYTES:
            raise InvalidRunSpec(f"fact names are 1..{MAX_FACT_BYTES} bytes, got {key!r:.80}")
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise InvalidRunSpec(f"fact {key!r} must be an int, float or str")
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidRunSpec(f"fact {key!r} must be finite")
        if isinstance(value, str) and len(value.encode()) > MAX_FACT_BYTES:
            raise InvalidRunSpec(f"fact {key!r} is longer than {MAX_FACT_BYTES} bytes")
        out[key] = value
    samples = out.get("num_samples")
    if samples is not None and (not isinstance(samples, int) or samples < 0):
        raise InvalidRunSpec(f"num_samples must be an int >= 0, got {samples!r}")
    return out


class ClientRegistry:
    """Registered peers, thread-safe. Registrations are journaled; heartbeats are kept in
    memory only (a write per heartbeat would cost thousands of writes a second), so after a
    restart every registered peer counts as seen at the restart and has ``inactive_after``
    seconds to show up again. A peer is active while it was seen within ``inactive_after``.
    """

    def __init__(
        self,
        journal: RunDatabase | None,
        clock: Clock,
        *,
        inactive_after: float = DEFAULT_INACTIVE_AFTER,
    ) -> None:
        if not (math.isfinite(inactive_after) and inactive_after > 0):
            raise ValueError(f"inactive_after must be > 0, got {inactive_after!r}")
        self.inactive_after = inactive_after
        self._journal = journal
        self._clock = clock
        self._lock = threading.Lock()
        self._clients: dict[str, ClientInfo] = {}
        self._listeners: list[Callable[[], None]] = []
        if journal is not None:
            for client in journal.load_clients(clock.now()):
                self._clients[client.name] = client

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after each registration (a waiting round may now start)."""
        with self._lock:
            self._listeners.append(listener)

    def register(self, name: str, facts: Mapping[str, object] | None = None) -> ClientInfo:
        """Register (or re-register, replacing its facts) ``name``; it is seen now."""
        (outcome,) = self.register_many([(name, facts)])
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def register_many(
        self, items: Sequence[tuple[str, Mapping[str, object] | None]]
    ) -> list[ClientInfo | Exception]:
        """Register each ``(name, facts)`` as ``register`` does, journaled in one transaction
        (durable when this returns); per item its ClientInfo, or the error that refused it
        (InvalidRunSpec for bad facts: that item alone; a journal failure: all of them, and
        none is registered). A name given twice ends with its last facts."""
        outcomes: list[ClientInfo | Exception | None] = [None] * len(items)
        checked: list[tuple[int, str, dict[str, Param]]] = []
        for index, (name, facts) in enumerate(items):
            try:
                checked.append((index, name, check_facts(facts or {})))
            except InvalidRunSpec as exc:
                outcomes[index] = exc
        now = self._clock.now()
        with self._lock:
            batch: dict[str, ClientInfo] = {}
            rows: list[tuple[str, dict[str, Param], float]] = []
            for index, name, facts in checked:
                known = batch.get(name) or self._clients.get(name)
                if known is None or dict(known.facts) != facts:
                    rows.append((name, facts, now))
                info = ClientInfo(name, facts, known.registered_at if known else now, now)
                batch[name] = info
                outcomes[index] = info
            if rows and self._journal is not None:
                try:
                    self._journal.register_many(rows)
                except Exception as exc:  # nothing of the batch was kept
                    for index, _, _ in checked:
                        outcomes[index] = exc
                    batch = {}
            self._clients.update(batch)
            listeners = list(self._listeners) if batch else []
        for listener in listeners:
            listener()
        return [o if o is not None else RuntimeError("no outcome") for o in outcomes]

    def seen(self, name: str) -> ClientInfo:
        """A heartbeat (or any request) from ``name``; NotRegistered if it never registered."""
        with self._lock:
            known = self._clients.get(name)
            if known is None:
                raise NotRegistered(name)
            info = self._clients[name] = ClientInfo(
                name, known.facts, known.registered_at, self._clock.now()
            )
        return info

    def get(self, name: str) -> ClientInfo | None:
        with self._lock:
            return self._clients.get(name)

    def is_active(self, name: str) -> bool:
        with self._lock:
            known = self._clients.get(name)
        return known is not None and self._clock.now() - known.last_seen < self.inactive_after

    def active(self) -> list[str]:
        """The names of the active peers, sorted."""
        now = self._clock.now()
        with self._lock:
            return sorted(
                name for name, c in self._clients.items() if now - c.last_seen < self.inactive_after
            )

    def clients(self) -> list[ClientInfo]:
        with self._lock:
            return sorted(self._clients.values(), key=lambda c: c.name)

    def __len__(self) -> int:
        with self._lock:
            return len(self._clients)
