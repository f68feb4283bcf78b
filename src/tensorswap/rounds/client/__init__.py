"""Rounds client: ``RoundClient``, its blocking wrapper, reconnecting with backoff, and many
virtual clients on one connection."""

from tensorswap.rounds.client.blocking import BlockingRoundClient
from tensorswap.rounds.client.client import RoundClient, ServerStatus, SubmitResult
from tensorswap.rounds.client.reconnect import (
    RETRYABLE,
    RETRYABLE_CODES,
    Backoff,
    retryable,
    retrying,
)
from tensorswap.rounds.client.virtual import (
    PeerSubmit,
    Update,
    VirtualClients,
    VirtualPeer,
    request_submit_batch,
)

__all__ = [
    "RETRYABLE",
    "RETRYABLE_CODES",
    "Backoff",
    "BlockingRoundClient",
    "PeerSubmit",
    "RoundClient",
    "ServerStatus",
    "SubmitResult",
    "Update",
    "VirtualClients",
    "VirtualPeer",
    "request_submit_batch",
    "retryable",
    "retrying",
]
