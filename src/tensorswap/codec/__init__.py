"""Codec: TensorBlock <-> Arrow IPC; dtypes, compression, lossy encodings, legacy formats."""

from __future__ import annotations

from tensorswap.codec._ipcmeta import check_ipc_messages
from tensorswap.codec.arrow import (
    BlockHeader,
    decode_block,
    encode_block,
    encode_block_into,
    encoded_size,
    is_tensorswap_block,
    write_block,
)
from tensorswap.codec.block import TensorBlock
from tensorswap.codec.dtypes import DType, as_numpy, is_torch_tensor, to_torch
from tensorswap.codec.lossy import Encoding, LossyValueError

__all__ = [
    "BlockHeader",
    "DType",
    "Encoding",
    "LossyValueError",
    "TensorBlock",
    "as_numpy",
    "check_ipc_messages",
    "decode_block",
    "encode_block",
    "encode_block_into",
    "encoded_size",
    "is_tensorswap_block",
    "is_torch_tensor",
    "to_torch",
    "write_block",
]
