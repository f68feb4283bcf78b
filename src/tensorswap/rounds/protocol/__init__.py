"""Rounds protocol: the rounds application's messages and their codec, inline blocks, batched
submits, paged status and the result push."""

from tensorswap.rounds.protocol.batch import (
    MAX_BATCH,
    PROOF_BYTES,
    BatchItem,
    BatchSubmitRequest,
    PeerKeys,
    submit_proof,
)
from tensorswap.rounds.protocol.codec import (
    APP,
    REMOTE_TYPES,
    decode_call,
    encode_answer,
    encode_call,
    error_info,
    raise_remote,
)
from tensorswap.rounds.protocol.inline import (
    APP_INLINE,
    INLINE_SEND_BYTES,
    decode_inline,
    inline_blocks,
    put_blocks,
    reserve_inline,
)
from tensorswap.rounds.protocol.messages import (
    MAX_NAME_BYTES,
    ErrorInfo,
    Param,
    RoundAnswer,
    RoundRow,
    StatusRequest,
    StatusWire,
    SubmitRequest,
    WaitRequest,
    status_to_wire,
    utf8_len,
)
from tensorswap.rounds.protocol.paging import MAX_PAGE, PageAnswer, page_peers, page_rounds

__all__ = [
    "APP",
    "APP_INLINE",
    "INLINE_SEND_BYTES",
    "MAX_BATCH",
    "MAX_NAME_BYTES",
    "MAX_PAGE",
    "PROOF_BYTES",
    "REMOTE_TYPES",
    "BatchItem",
    "BatchSubmitRequest",
    "ErrorInfo",
    "PageAnswer",
    "Param",
    "PeerKeys",
    "RoundAnswer",
    "RoundRow",
    "StatusRequest",
    "StatusWire",
    "SubmitRequest",
    "WaitRequest",
    "decode_call",
    "decode_inline",
    "encode_answer",
    "encode_call",
    "error_info",
    "inline_blocks",
    "page_peers",
    "page_rounds",
    "put_blocks",
    "raise_remote",
    "reserve_inline",
    "status_to_wire",
    "submit_proof",
    "utf8_len",
]
