"""SecAgg+ (Bell et al. 2020): the coordinator learns the sum of the peers' updates, not one.

A protocol library: pure client and server state machines (``SecAggClient``,
``SecAggServer``) exchanging msgspec messages, over Shamir sharing (``shamir``), stochastic
quantization (``quantize``), a sparse neighbour graph (``graph``) and primitives from the
``cryptography`` package (``crypto``; install the ``privacy`` extra). ``coordinator`` runs
the server side of one run round by peer name, with phase deadlines; ``runs.secure`` and
``runs.secure_peer`` wire it into runs: see docs/privacy-secagg.md.
"""

from tensorswap.privacy.secagg.client import ClientPhase, SecAggClient
from tensorswap.privacy.secagg.errors import (
    BelowSurvivorFloor,
    ConflictingUnmaskRequest,
    DuplicateShareIndex,
    ForeignRound,
    KeyAdvertRejected,
    MalformedSecAggMessage,
    MalformedShare,
    NotEnoughShares,
    OutOfPhase,
    PeerDropped,
    QuantizationError,
    ReconstructionMismatch,
    ReplayedMessage,
    SecAggConfigError,
    SecAggError,
    SecureRoundFailed,
    ShamirError,
    ShareDecryptionFailed,
    ShareMisaddressed,
    TooFewShares,
    TooFewSurvivors,
    UnknownParticipant,
)
from tensorswap.privacy.secagg.protocol import SecAggConfig, decode, encode, make_config
from tensorswap.privacy.secagg.quantize import Quantizer
from tensorswap.privacy.secagg.server import SecAggResult, SecAggServer, ServerPhase

__all__ = [
    "BelowSurvivorFloor",
    "ClientPhase",
    "ConflictingUnmaskRequest",
    "DuplicateShareIndex",
    "ForeignRound",
    "KeyAdvertRejected",
    "MalformedSecAggMessage",
    "MalformedShare",
    "NotEnoughShares",
    "OutOfPhase",
    "PeerDropped",
    "QuantizationError",
    "Quantizer",
    "ReconstructionMismatch",
    "ReplayedMessage",
    "SecAggClient",
    "SecAggConfig",
    "SecAggConfigError",
    "SecAggError",
    "SecAggResult",
    "SecAggServer",
    "SecureRoundFailed",
    "ServerPhase",
    "ShamirError",
    "ShareDecryptionFailed",
    "ShareMisaddressed",
    "TooFewShares",
    "TooFewSurvivors",
    "UnknownParticipant",
    "decode",
    "encode",
    "make_config",
]
