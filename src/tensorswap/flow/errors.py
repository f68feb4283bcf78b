"""The flow error branch: the seed's backend error kinds as classes under ``FlowError``.

::

    FlowError
    ├── InitializationError          setting a transport or backend up failed
    │   ├── InvalidConfig            (also ValueError) a config or option is unusable
    │   └── SetupError               a socket could not be created, configured, bound or connected
    ├── InvalidArgument              (also ValueError) a call argument is unusable (a NaN timeout)
    ├── ProcessingError              a backend failed while processing
    ├── ModelError                   model persistence failed
    ├── CommunicationError           the exchange failed
    │   ├── FlowClosed               a publisher, subscriber or hybrid backend was closed
    │   ├── FramingError             an empty or multipart ZeroMQ message
    │   ├── WireVersionError         an envelope version outside the supported window
    │   ├── MalformedMessage         JSON that is not a well-formed message (syntax, shape, types)
    │   ├── MalformedReadout         a readout packet with a short header or misaligned floats
    │   └── SlotOccupied             a second sibling batch arrived while one is held
    ├── InvalidInput                 (also ValueError) the content breaks a rule
    │   ├── ValidationError          a protocol limit or rule failed: path, kind, actual, limit
    │   ├── FieldTypeError           (also TypeError) a Python value of the wrong type or range
    │   └── ReadoutLimitExceeded     a readout packet carries more floats than allowed
    └── ProtocolError                a valid message arrived where another variant was expected
        └── UnexpectedVariant        found and expected variant names

Peers' failures (bytes off the wire) are ``CommunicationError``; rule violations in a
well-formed message are ``InvalidInput``; local misuse of the Python types is ``FieldTypeError``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

from tensorswap.errors import FlowError

if TYPE_CHECKING:
    from tensorswap.flow.limits import Measure


class InitializationError(FlowError):
    """A transport or backend could not be set up."""


class InvalidConfig(InitializationError, ValueError):
    """A configuration value or option is not usable; nothing was opened."""


class SetupError(InitializationError):
    """ZeroMQ refused to create, configure, bind or connect a socket."""

    def __init__(self, action: str, endpoint: str, reason: str) -> None:
        self.action = action
        self.endpoint = endpoint
        self.reason = reason
        super().__init__(f"{action} {endpoint!r} failed: {reason}")


class InvalidArgument(FlowError, ValueError):
    """A call was given an argument it cannot use (a NaN or negative timeout); nothing was done."""


class ProcessingError(FlowError):
    """A backend failed while processing a batch."""


class ModelError(FlowError):
    """Saving or loading model state failed."""


class CommunicationError(FlowError):
    """Sending or receiving failed, or what arrived is not a message."""


class FlowClosed(CommunicationError):
    """This side closed the ZeroMQ socket or hybrid backend; every later call fails the same way.

    (Not the wire layer's TransportClosed: flow endpoints are ZeroMQ sockets, not TCP streams.)
    """

    def __init__(self, what: str = "transport") -> None:
        self.what = what
        super().__init__(f"the {what} is closed")


class FramingError(CommunicationError):
    """A ZeroMQ message that is not exactly one non-empty frame."""

    def __init__(self, frames: int, size: int = 0) -> None:
        self.frames = frames
        self.size = size
        if frames == 1:
            msg = "empty ZeroMQ message: a message is one non-empty frame"
        else:
            msg = f"multipart ZeroMQ message of {frames} frames: a message is one frame"
        super().__init__(msg)


class WireVersionError(CommunicationError):
    """An envelope whose ``wire_version`` lies outside ``[min_supported, current]``."""

    def __init__(self, found: int, min_supported: int, current: int) -> None:
        self.found = found
        self.min_supported = min_supported
        self.current = current
        if found < min_supported:
            msg = (
                f"wire version {found} is too old (minimum supported is {min_supported}); "
                f"upgrade the producer to emit version {min_supported} or newer"
            )
        else:
            msg = (
                f"wire version {found} is too new (current is {current}); "
                f"upgrade tensorswap or have the producer emit version {current} or older"
            )
        super().__init__(msg)


class MalformedMessage(CommunicationError):
    """Bytes that are not a well-formed message: JSON syntax, shape, types or integer ranges."""


class MalformedReadout(CommunicationError):
    """A binary readout packet with a short header or a float area not a multiple of 4."""

    def __init__(self, message: str, size: int) -> None:
        self.size = size
        super().__init__(message)


class SlotOccupied(CommunicationError):
    """A sibling batch arrived while the one-message slot for its kind was full."""

    def __init__(self, label: str) -> None:
        self.label = label
        super().__init__(f"inbound {label} slot already holds a message")


class InvalidInput(FlowError, ValueError):
    """The content of a message or packet breaks a rule."""


class ValidationKind(StrEnum):
    """Stable names of the validation failure kinds (part of the error contract)."""

    NON_FINITE = "non_finite"
    OUT_OF_RANGE = "out_of_range"
    LENGTH_MISMATCH = "length_mismatch"
    LIMIT_EXCEEDED = "limit_exceeded"
    NESTED_METADATA = "nested_metadata"
    DUPLICATE_IDENTIFIER = "duplicate_identifier"


class ValidationError(InvalidInput):
    """A protocol rule failed at ``path``; prints as ``{kind} at `{path}`, actual=…, limit=…``."""

    def __init__(
        self,
        path: str,
        kind: ValidationKind,
        actual: Measure | None = None,
        limit: Measure | None = None,
    ) -> None:
        self.path = path
        self.kind = kind
        self.actual = actual
        self.limit = limit
        text = f"{kind} at `{path}`"
        if actual is not None:
            text += f", actual={actual}"
        if limit is not None:
            text += f", limit={limit}"
        super().__init__(text)


class FieldTypeError(InvalidInput, TypeError):
    """A Python value that the wire type cannot carry (wrong type, or integer out of range)."""

    def __init__(self, path: str, expected: str, got: object) -> None:
        self.path = path
        self.expected = expected
        self.got = got
        shown = repr(got)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        super().__init__(f"`{path}` must be {expected}, got {shown}")


class ReadoutLimitExceeded(InvalidInput):
    """A readout packet carries more floats than the configured maximum."""

    def __init__(self, count: int, limit: int) -> None:
        self.count = count
        self.limit = limit
        super().__init__(f"ZMQ readout float count {count} exceeds limit {limit}")


class ProtocolError(FlowError):
    """The peer broke the conversation: a valid message where another was expected."""


class UnexpectedVariant(ProtocolError):
    """A message of variant ``found`` arrived where ``expected`` was wanted; it was consumed."""

    def __init__(self, found: str, expected: str) -> None:
        self.found = found
        self.expected = expected
        super().__init__(f"unexpected message variant {found}, expected {expected}")


__all__ = [
    "CommunicationError",
    "FieldTypeError",
    "FlowClosed",
    "FlowError",
    "FramingError",
    "InitializationError",
    "InvalidArgument",
    "InvalidConfig",
    "InvalidInput",
    "MalformedMessage",
    "MalformedReadout",
    "ModelError",
    "ProcessingError",
    "ProtocolError",
    "ReadoutLimitExceeded",
    "SetupError",
    "SlotOccupied",
    "UnexpectedVariant",
    "ValidationError",
    "ValidationKind",
    "WireVersionError",
]
