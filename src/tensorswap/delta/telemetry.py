"""Counters of the DWE bus and listener: a thread-safe recorder and frozen snapshots of it."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from tensorswap.delta.verify import RejectReason


@dataclass(frozen=True)
class TelemetrySnapshot:
    """A consistent copy of the counters at one moment.

    ``sent`` counts (fragment, peer) deliveries written to a socket, as the crate does; ``dropped``
    counts fragments refused by a full queue (the bus queue or one peer's queue); ``received``
    counts frames read in full, of which ``accepted`` passed verification and ``applied`` were
    taken by the handler; ``rejected`` is broken down by reason in ``rejections``; ``gaps`` is the
    total number of sequences that accepted fragments skipped. ``errors`` counts failures that
    were contained rather than allowed to stop a bus or listener (a raising ``on_verdict``, an
    unexpected exception in a connection or sender task); ``idle_closed`` counts listener
    connections closed for idleness (``idle_timeout``, or evicted to make room for a new one).
    """

    queued: int = 0
    enqueued: int = 0
    sent: int = 0
    sent_bytes: int = 0
    send_failures: int = 0
    reconnects: int = 0
    dropped: int = 0
    received: int = 0
    accepted: int = 0
    applied: int = 0
    rejected: int = 0
    gaps: int = 0
    errors: int = 0
    idle_closed: int = 0
    rejections: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    last_session_id: str | None = None
    last_fragment_bytes: int = 0
    last_error: str | None = None


class DweTelemetry:
    """Mutable counters shared by a bus and a listener; every method is thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._rejections: Counter[str] = Counter()
        self._last_session_id: str | None = None
        self._last_fragment_bytes = 0
        self._last_error: str | None = None

    def _bump(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def record_enqueued(self) -> None:
        """A fragment was accepted into the bus queue."""
        self._bump("enqueued")

    def record_dropped(self, error: str) -> None:
        """A fragment was dropped by a full queue."""
        with self._lock:
            self._counts["dropped"] += 1
            self._last_error = error

    def record_sent(self, session_id: str, fragment_bytes: int) -> None:
        """One fragment of ``fragment_bytes`` bincode bytes was written to one peer."""
        with self._lock:
            self._counts["sent"] += 1
            self._counts["sent_bytes"] += fragment_bytes
            self._last_session_id = session_id
            self._last_fragment_bytes = fragment_bytes

    def record_send_failure(self, error: str) -> None:
        """A delivery to one peer was abandoned after its retries."""
        with self._lock:
            self._counts["send_failures"] += 1
            self._last_error = error

    def record_reconnect(self) -> None:
        """A sender opened a new connection to a peer."""
        self._bump("reconnects")

    def record_received(self, fragment_bytes: int) -> None:
        """A frame of ``fragment_bytes`` was read in full."""
        with self._lock:
            self._counts["received"] += 1
            self._last_fragment_bytes = fragment_bytes

    def record_accepted(self, session_id: str) -> None:
        """A fragment passed verification."""
        with self._lock:
            self._counts["accepted"] += 1
            self._last_session_id = session_id

    def record_applied(self) -> None:
        """The handler took an accepted fragment."""
        self._bump("applied")

    def record_gap(self, skipped: int) -> None:
        """A committed fragment skipped ``skipped`` sequences of its session."""
        self._bump("gaps", skipped)

    def record_rejected(self, reason: RejectReason, error: str) -> None:
        """A received fragment (or frame) was refused for ``reason``."""
        with self._lock:
            self._counts["rejected"] += 1
            self._rejections[reason.value] += 1
            self._last_error = error

    def record_failure(self, error: str) -> None:
        """A contained failure (a callback or task raised unexpectedly); counted in ``errors``."""
        with self._lock:
            self._counts["errors"] += 1
            self._last_error = error

    def record_idle_closed(self) -> None:
        """The listener closed a connection for idleness (timeout or eviction)."""
        self._bump("idle_closed")

    def record_error(self, error: str) -> None:
        """Remember an error that is counted elsewhere or not at all (e.g. a failed connect)."""
        with self._lock:
            self._last_error = error

    def snapshot(self, queued: int = 0) -> TelemetrySnapshot:
        """A frozen copy of every counter; ``queued`` is the caller's current queue depth."""
        with self._lock:
            counts = dict(self._counts)
            return TelemetrySnapshot(
                queued=queued,
                enqueued=counts.get("enqueued", 0),
                sent=counts.get("sent", 0),
                sent_bytes=counts.get("sent_bytes", 0),
                send_failures=counts.get("send_failures", 0),
                reconnects=counts.get("reconnects", 0),
                dropped=counts.get("dropped", 0),
                received=counts.get("received", 0),
                accepted=counts.get("accepted", 0),
                applied=counts.get("applied", 0),
                rejected=counts.get("rejected", 0),
                gaps=counts.get("gaps", 0),
                errors=counts.get("errors", 0),
                idle_closed=counts.get("idle_closed", 0),
                rejections=MappingProxyType(dict(self._rejections)),
                last_session_id=self._last_session_id,
                last_fragment_bytes=self._last_fragment_bytes,
                last_error=self._last_error,
            )
