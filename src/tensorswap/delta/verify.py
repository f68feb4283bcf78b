"""Verification of received fragments: state hash, HMAC-SHA256 with key rotation, sequences."""

from __future__ import annotations

import enum
import hashlib
import hmac
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tensorswap.delta.bincode import signed_pieces
from tensorswap.delta.fragment import (
    KNOWN_SCHEMAS,
    DweFragment,
    LayerLayoutError,
    compute_state_hash,
    layer_target,
    quoted,
)
from tensorswap.errors import DeltaError


class RejectReason(enum.Enum):
    """Why a received fragment was refused; the telemetry counts rejections by this value."""

    TOO_LARGE = "too_large"
    MALFORMED = "malformed"
    TRUNCATED = "truncated"
    TIMEOUT = "timeout"
    UNKNOWN_SCHEMA = "unknown_schema"
    HMAC_MISSING = "hmac_missing"
    HMAC_MISMATCH = "hmac_mismatch"
    STATE_HASH = "state_hash"
    LAYOUT = "layout"
    NON_FINITE = "non_finite"
    REPLAY = "replay"
    STALE = "stale"
    GAP = "gap"
    APPLY_FAILED = "apply_failed"
    HANDLER_ERROR = "handler_error"
    INTERNAL_ERROR = "internal_error"


class FragmentRejected(DeltaError):
    """A fragment failed verification; it was not applied and its sequence was not recorded."""

    def __init__(
        self, reason: RejectReason, detail: str, session_id: str = "", sequence: int | None = None
    ) -> None:
        self.reason = reason
        self.detail = detail
        self.session_id = session_id
        self.sequence = sequence
        where = ""
        if sequence is not None:
            where = f" (session {quoted(session_id)}, sequence {sequence})"
        super().__init__(f"fragment rejected, {reason.value}{where}: {detail}")


class UnknownSchema(FragmentRejected):
    """The schema string is none this package reads."""


class HmacMismatch(FragmentRejected):
    """The HMAC is missing where one is required, or matches neither the current nor old key."""


class StateHashMismatch(FragmentRejected):
    """The values do not hash to the ``state_hash`` the fragment carries."""

    def __init__(self, expected: str, actual: str, session_id: str, sequence: int) -> None:
        self.expected = expected
        self.actual = actual
        super().__init__(
            RejectReason.STATE_HASH,
            f"state_hash {expected} but the layers hash to {actual}",
            session_id,
            sequence,
        )


class InvalidLayout(FragmentRejected):
    """A layer entry is inconsistent (value count vs shape, slice bounds) or holds NaN/Inf."""


class SequenceRejected(FragmentRejected):
    """A replayed, stale or (under the strict gap policy) non-contiguous sequence."""

    def __init__(
        self, reason: RejectReason, session_id: str, sequence: int, last: int | None
    ) -> None:
        self.last = last
        super().__init__(reason, f"last accepted sequence is {last}", session_id, sequence)


def hmac_hex(key: bytes, pieces: Iterable[bytes | bytearray | memoryview]) -> str:
    """Lower-case hex HMAC-SHA256 of the concatenation of ``pieces`` under ``key``."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for piece in pieces:
        mac.update(piece)
    return mac.hexdigest()


def fragment_hmac(fragment: DweFragment, key: bytes) -> str:
    """HMAC-SHA256 over the bincode of ``(schema, session_id, sequence, layers, state_hash)``.

    Computed over zero-copy pieces, without building the encoding.
    """
    return hmac_hex(key, signed_pieces(fragment))


def sign_fragment(fragment: DweFragment, key: bytes) -> DweFragment:
    """A copy of ``fragment`` whose ``hmac`` authenticates it under ``key``."""
    return fragment.with_hmac(fragment_hmac(fragment, key))


class KeyUsed(enum.Enum):
    """Which fleet key authenticated a fragment."""

    NONE = "none"
    CURRENT = "current"
    PREVIOUS = "previous"


@dataclass(frozen=True, repr=False)
class FleetKeys:
    """The fleet's HMAC keys: the current one signs; the previous one still verifies in rotation."""

    current: bytes
    previous: bytes | None = None

    def __post_init__(self) -> None:
        if not self.current:
            raise ValueError("the current fleet key must not be empty")
        if self.previous is not None and not self.previous:
            raise ValueError("the previous fleet key must not be empty (use None)")

    def __repr__(self) -> str:  # never print key material
        previous = self.previous is not None
        return f"FleetKeys(current=<{len(self.current)} bytes>, previous={previous})"

    def match(self, signed: Iterable[bytes | bytearray | memoryview], received: str) -> KeyUsed:
        """Which key, if any, produced ``received`` over ``signed`` (constant-time compares)."""
        pieces = list(signed)
        claimed = received.lower().encode("ascii", "replace")
        for key, used in ((self.current, KeyUsed.CURRENT), (self.previous, KeyUsed.PREVIOUS)):
            if key is not None and hmac.compare_digest(hmac_hex(key, pieces).encode(), claimed):
                return used
        return KeyUsed.NONE


class GapPolicy(enum.Enum):
    """What a session does when a sequence skips ahead (fragments between were never seen).

    ``ACCEPT`` (default): the fragment is applied and the number of skipped sequences is counted
    as ``gaps``; deltas add up, so every fragment that does arrive still lands exactly once, and
    senders with a process-wide counter (later axiom) skip numbers per session by design.
    ``REJECT``: only ``last + 1`` is accepted; a lost fragment then stalls the session until the
    sender starts a new session id.
    """

    ACCEPT = "accept"
    REJECT = "reject"


class SequenceTracker:
    """Per-session last accepted sequence; replays (equal) and stale (lower) sequences are refused.

    The first fragment of a session is accepted at any sequence. At most ``max_sessions`` sessions
    are remembered; the least recently accepted one is forgotten beyond that (counted in
    ``evicted``), after which that session starts afresh. Thread-safe.
    """

    def __init__(self, gap_policy: GapPolicy = GapPolicy.ACCEPT, max_sessions: int = 65536) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.gap_policy = gap_policy
        self.max_sessions = max_sessions
        self.evicted = 0
        # Keyed by the session id, or by its SHA-256 when longer than 64 characters: a peer's
        # session ids may be megabytes each, and up to max_sessions of them are remembered.
        self._last: OrderedDict[str | bytes, int] = OrderedDict()
        self._lock = threading.Lock()

    def last(self, session_id: str) -> int | None:
        """The last accepted sequence of ``session_id``, or None."""
        with self._lock:
            return self._last.get(_session_key(session_id))

    def check(self, session_id: str, sequence: int) -> int:
        """Raise :class:`SequenceRejected` unless ``sequence`` may follow; return skipped count."""
        key = _session_key(session_id)
        with self._lock:
            last = self._last.get(key)
        if last is None:
            return 0
        if sequence == last:
            raise SequenceRejected(RejectReason.REPLAY, session_id, sequence, last)
        if sequence < last:
            raise SequenceRejected(RejectReason.STALE, session_id, sequence, last)
        skipped = sequence - last - 1
        if skipped and self.gap_policy is GapPolicy.REJECT:
            raise SequenceRejected(RejectReason.GAP, session_id, sequence, last)
        return skipped

    def commit(self, session_id: str, sequence: int) -> int:
        """Check ``sequence`` again and record it as accepted; return the skipped count."""
        key = _session_key(session_id)
        with self._lock:
            last = self._last.get(key)
            if last is not None and sequence <= last:
                reason = RejectReason.REPLAY if sequence == last else RejectReason.STALE
                raise SequenceRejected(reason, session_id, sequence, last)
            self._last[key] = sequence
            self._last.move_to_end(key)
            while len(self._last) > self.max_sessions:
                self._last.popitem(last=False)
                self.evicted += 1
        return 0 if last is None else sequence - last - 1


_SESSION_KEY_CHARS = 64


def _session_key(session_id: str) -> str | bytes:
    """What the tracker stores for ``session_id``: itself when short, else its SHA-256 digest
    (bytes, so it never equals a short id)."""
    if len(session_id) <= _SESSION_KEY_CHARS:
        return session_id
    return hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).digest()


class FragmentVerifier:
    """Checks a received fragment before anything is applied; raises :class:`FragmentRejected`.

    Order: HMAC (when keys are set), schema, state hash, layer layout, finiteness, sequence. With
    keys, a fragment without an hmac is refused unless ``require_hmac`` is False; without keys an
    hmac cannot be checked and is ignored. :meth:`check_integrity` is pure and thread-safe, so
    large fragments can be hashed off the event loop; :meth:`commit` records the sequence and
    must follow a successful apply, so a failed apply can be retried under the same sequence.
    """

    def __init__(
        self,
        *,
        keys: FleetKeys | None = None,
        require_hmac: bool | None = None,
        gap_policy: GapPolicy = GapPolicy.ACCEPT,
        require_finite: bool = True,
        tracker: SequenceTracker | None = None,
    ) -> None:
        self.keys = keys
        self.require_hmac = keys is not None if require_hmac is None else require_hmac
        if self.require_hmac and keys is None:
            raise ValueError("require_hmac needs fleet keys")
        self.require_finite = require_finite
        self.tracker = tracker if tracker is not None else SequenceTracker(gap_policy)

    def check_integrity(
        self, fragment: DweFragment, signed: bytes | bytearray | memoryview | None = None
    ) -> KeyUsed:
        """Authenticate and hash-check ``fragment``; ``signed`` is its received signed region."""
        used = self._check_hmac(fragment, signed)
        sid, seq = fragment.session_id, fragment.sequence
        if fragment.schema not in KNOWN_SCHEMAS:
            raise UnknownSchema(
                RejectReason.UNKNOWN_SCHEMA, f"schema {quoted(fragment.schema)}", sid, seq
            )
        actual = compute_state_hash(fragment.layers)
        claimed = fragment.state_hash.lower().encode("ascii", "replace")
        if not hmac.compare_digest(actual.encode(), claimed):
            raise StateHashMismatch(fragment.state_hash, actual, sid, seq)
        for layer in fragment.layers:
            try:
                layer_target(fragment.schema, layer)
            except LayerLayoutError as exc:
                raise InvalidLayout(RejectReason.LAYOUT, str(exc), sid, seq) from exc
            if self.require_finite and not np.isfinite(layer.values).all():
                bad = int(layer.values.size - np.count_nonzero(np.isfinite(layer.values)))
                raise InvalidLayout(
                    RejectReason.NON_FINITE,
                    f"layer {layer.layer_index} holds {bad} NaN/Inf values",
                    sid,
                    seq,
                )
        return used

    def _check_hmac(
        self, fragment: DweFragment, signed: bytes | bytearray | memoryview | None
    ) -> KeyUsed:
        if self.keys is None:
            return KeyUsed.NONE
        sid, seq = fragment.session_id, fragment.sequence
        if fragment.hmac is None:
            if self.require_hmac:
                raise HmacMismatch(RejectReason.HMAC_MISSING, "no hmac field", sid, seq)
            return KeyUsed.NONE
        pieces = [signed] if signed is not None else signed_pieces(fragment)
        used = self.keys.match(pieces, fragment.hmac)
        if used is KeyUsed.NONE:
            raise HmacMismatch(
                RejectReason.HMAC_MISMATCH, "hmac matches neither fleet key", sid, seq
            )
        return used

    def check_sequence(self, fragment: DweFragment) -> int:
        """Raise unless the sequence may follow its session's last; return the skipped count."""
        return self.tracker.check(fragment.session_id, fragment.sequence)

    def verify(
        self, fragment: DweFragment, signed: bytes | bytearray | memoryview | None = None
    ) -> KeyUsed:
        """Every check, without recording the sequence (call :meth:`commit` after applying)."""
        used = self.check_integrity(fragment, signed)
        self.check_sequence(fragment)
        return used

    def commit(self, fragment: DweFragment) -> int:
        """Record the fragment's sequence as accepted; return how many sequences it skipped."""
        return self.tracker.commit(fragment.session_id, fragment.sequence)
