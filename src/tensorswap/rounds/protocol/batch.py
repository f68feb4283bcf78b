"""Batched submits for many peers over one connection, and per-peer keys that authorise them.

A ``submit_batch`` request carries up to MAX_BATCH ``[peer, update, proof]`` items for one
round; the coordinator screens them in order and journals them in one transaction, and
answers one result per item (a status, or the refusal of that item alone). Its blocks were
sent before it on the same connection, as for ``submit``.

Authorisation. A connection's handshake proves the federation's shared key, not a peer: on
a coordinator without per-peer keys any member may name any peer (the trust model of
``submit``). A coordinator given per-peer keys (``PeerKeys``) accepts a contribution only
with ``proof = HMAC-SHA256(peer key, label || msgpack([round, initiator, peer, update]))``
(``submit_proof``), so a connection acts for a peer only with that peer's key proven for
that very contribution; the plain ``submit`` op (no proof) is then refused. A proof
authorises exactly one contribution, so a gateway may relay proofs made by its peers
without holding their keys, and replaying one can only repeat that contribution (refused
as a duplicate). Layout in ``docs/scale.md``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import msgspec

from tensorswap.cid import Cid
from tensorswap.errors import InvalidCid, TensorSwapError
from tensorswap.rounds.core.errors import PeerNotAuthorised
from tensorswap.rounds.core.model import RoundId
from tensorswap.rounds.protocol.messages import (
    MAX_NAME_BYTES,
    ErrorInfo,
    StatusWire,
    _Request,
    utf8_len,
)

__all__ = [
    "MAX_BATCH",
    "PROOF_BYTES",
    "BatchAnswer",
    "BatchItem",
    "BatchSubmitRequest",
    "ItemResult",
    "PeerKeys",
    "submit_proof",
]

MAX_BATCH = 1024
"""The most items one ``submit_batch`` request carries."""

PROOF_BYTES = 32
"""An HMAC-SHA256 proof's length."""

_LABEL = b"tensorswap/1 submit proof\x00"
_encoder = msgspec.msgpack.Encoder()


def submit_proof(key: bytes, round_id: RoundId, peer: str, update: Cid) -> bytes:
    """The proof that the holder of ``key`` (``peer``'s key) submits ``update`` to the round."""
    body = _encoder.encode([round_id.round, round_id.initiator, peer, update.to_bytes()])
    return hmac.new(key, _LABEL + body, hashlib.sha256).digest()


class BatchItem(msgspec.Struct, frozen=True, array_like=True):
    """One contribution of a batch: ``[peer, update (binary CID), proof]`` (proof may be
    empty where the coordinator holds no per-peer keys)."""

    peer: str
    update: bytes
    proof: bytes = b""

    @property
    def cid(self) -> Cid:
        return Cid.parse(self.update)


class BatchSubmitRequest(_Request, frozen=True, omit_defaults=True, tag="submit_batch"):
    """Submit each item's update for its peer to the round ``(round, initiator)``."""

    items: list[BatchItem]

    def __post_init__(self) -> None:
        self._check_round_id()
        if not 0 < len(self.items) <= MAX_BATCH:
            raise ValueError(
                f"a submit_batch request holds {len(self.items)} items; 1 to {MAX_BATCH} allowed"
            )
        for item in self.items:
            size = utf8_len(item.peer)
            if not 0 < size <= MAX_NAME_BYTES:
                raise ValueError(
                    f"a batch item's peer name is {size} bytes long; 1 to {MAX_NAME_BYTES} allowed"
                )
            if len(item.proof) not in (0, PROOF_BYTES):
                raise ValueError(f"a batch item's proof is {len(item.proof)} bytes long")
            try:
                Cid.parse(item.update)
            except InvalidCid as exc:
                raise ValueError(f"a batch item names an invalid CID: {exc.reason}") from None


class ItemResult(msgspec.Struct, frozen=True, omit_defaults=True):
    """One item's outcome: the round's status after it, or why it alone was refused."""

    status: StatusWire | None = None
    error: ErrorInfo | None = None


class BatchAnswer(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=False):
    """The answer to ``submit_batch``: ``error`` when the whole request was refused (e.g. an
    unknown round), else one result per item, in order."""

    error: ErrorInfo | None = None
    results: list[ItemResult] = []


class PeerKeys(Mapping[str, bytes]):
    """Per-peer keys a coordinator checks submit proofs against (peer name -> key bytes).

    ``load(path)`` reads a file of ``<peer> <key as hex>`` lines (``#`` comments and blank
    lines skipped); ``ValueError`` names the line of any other. ``check`` raises
    PeerNotAuthorised for a proof that does not verify.
    """

    def __init__(self, keys: Mapping[str, bytes]) -> None:
        for peer, key in keys.items():
            if not peer or not key:
                raise ValueError("every per-peer key needs a peer name and a non-empty key")
        self._keys = dict(keys)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> PeerKeys:
        keys: dict[str, bytes] = {}
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            parts = text.split()
            try:
                if len(parts) != 2:
                    raise ValueError("expected '<peer> <hex key>'")
                keys[parts[0]] = bytes.fromhex(parts[1])
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: not a peer key line: {exc}") from None
        return cls(keys)

    def __getitem__(self, peer: str) -> bytes:
        return self._keys[peer]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def check(self, round_id: RoundId, peer: str, update: Cid, proof: bytes) -> None:
        """PeerNotAuthorised unless ``proof`` is ``peer``'s proof for this contribution."""
        key = self._keys.get(peer)
        if key is None:
            raise PeerNotAuthorised(round_id.as_key(), peer, "the coordinator has no key for it")
        if not proof:
            raise PeerNotAuthorised(round_id.as_key(), peer, "no proof of the peer's key")
        if not hmac.compare_digest(proof, submit_proof(key, round_id, peer, update)):
            raise PeerNotAuthorised(round_id.as_key(), peer, "the proof does not verify")


def refusal(exc: TensorSwapError) -> ItemResult:
    """An item refused for ``exc``."""
    from tensorswap.rounds.protocol.codec import error_info

    return ItemResult(error=error_info(exc))
