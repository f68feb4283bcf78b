"""`tensorswap inspect`: recognise a tensor file's format and describe it as one JSON object."""

from __future__ import annotations

import json
import math
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click
import numpy as np
import pyarrow as pa

from tensorswap.cid import Cid, HashFunction, Multicodec
from tensorswap.cli._util import mapped, reading
from tensorswap.codec import check_ipc_messages, decode_block, is_tensorswap_block
from tensorswap.codec.garw import GarwBlock, compute_garw_cid, is_garw
from tensorswap.codec.ipfrs import decode_ipfrs_gradient, is_ipfrs_gradient_file
from tensorswap.delta.bincode import decode_fragment_file, looks_like_fragment_file
from tensorswap.delta.fragment import compute_state_hash, describe_fragment
from tensorswap.errors import CodecError, TensorSwapError, TruncatedData
from tensorswap.store.manifest import TensorManifest, decode_manifest, is_manifest

PREVIEW = 8
_ARROW_FILE_MAGIC = b"ARROW1"
_ARROW_CONTINUATION = b"\xff\xff\xff\xff"
_NPY_MAGIC = b"\x93NUMPY"
_MAX_SAFETENSORS_HEADER = 100 * 2**20


class UnknownFormat(CodecError):
    """No decoder recognises the file."""


def _values(values: np.ndarray, everything: bool) -> list[Any]:
    flat = values.reshape(-1)
    if not everything:
        flat = flat[:PREVIEW]
    kind = flat.dtype.kind
    if kind == "f" or str(flat.dtype) == "bfloat16":
        out: list[Any] = []
        for v in flat.astype(np.float64).tolist():
            out.append(v if math.isfinite(v) else str(v))  # JSON has no NaN/Inf
        return out
    if kind == "b":
        return [bool(v) for v in flat.tolist()]
    if kind in "iu":
        return [int(v) for v in flat.tolist()]
    return [str(v) for v in flat.tolist()]  # complex, strings, dates, records (.npy)


def _tensor_fields(
    name: str, dtype: str, shape: Any, num_samples: int | None, values: np.ndarray, all_: bool
) -> dict[str, Any]:
    return {
        "name": name,
        "dtype": dtype,
        "shape": [int(d) for d in shape],
        "num_samples": num_samples,
        "values": _values(values, all_),
    }


def _describe_manifest(data: memoryview, all_: bool) -> dict[str, Any]:
    cid = Cid.of(data, codec=Multicodec.TENSORSWAP_MANIFEST)
    manifest = decode_manifest(data, None)
    if isinstance(manifest, TensorManifest):
        return {
            "format": "tensorswap-tensor-manifest",
            "cid": str(cid),
            "name": manifest.name,
            "dtype": manifest.dtype,
            "shape": list(manifest.shape),
            "num_samples": manifest.num_samples,
            "encoding": manifest.encoding,
            "compression": manifest.compression,
            "chunks": [
                {"cid": str(c.cid), "values": c.values, "bytes": c.nbytes} for c in manifest.chunks
            ],
            "metadata": dict(manifest.metadata),
        }
    return {
        "format": "tensorswap-update-manifest",
        "cid": str(cid),
        "name": manifest.name,
        "num_samples": manifest.num_samples,
        "tensors": [{"name": t.name, "cid": str(t.cid)} for t in manifest.tensors],
        "metadata": dict(manifest.metadata),
    }


def _describe_block(data: memoryview, all_: bool) -> dict[str, Any]:
    block = decode_block(data)
    reader = pa.ipc.open_stream(pa.py_buffer(data))
    header = json.loads((reader.schema.metadata or {})[b"tensorswap.block"])
    # Manifest chunks are unnamed 1-D blocks with no samples or metadata (see store.manifest).
    is_chunk = header.get("kind") == "chunk" or (
        block.name == "" and len(block.shape) == 1 and block.num_samples == 0 and not block.metadata
    )
    return {
        "format": "tensorswap-chunk" if is_chunk else "tensorswap-block",
        "cid": str(Cid.of(data)),
        "encoding": header.get("encoding", "dense"),
        "metadata": dict(block.metadata),
        **_tensor_fields(
            block.name, block.dtype.value, block.shape, block.num_samples, block.values, all_
        ),
    }


def _describe_ipfrs(data: memoryview, all_: bool) -> dict[str, Any]:
    values = decode_ipfrs_gradient(data)
    return {
        "format": "ipfrs-gradient-arrow-file",
        "cid": str(Cid.of(data, hash=HashFunction.SHA2_256)),
        **_tensor_fields("", "float32", values.shape, None, values, all_),
    }


def _describe_garw(data: memoryview, all_: bool) -> dict[str, Any]:
    block = GarwBlock.from_bytes(data)
    return {
        "format": "garw",
        "cid": str(Cid.of(data)),
        "grad_id": compute_garw_cid("", block.values, block.num_samples),
        **_tensor_fields("", "float32", block.shape, block.num_samples, block.values, all_),
    }


def _arrow_table_fields(table: pa.Table, all_: bool) -> dict[str, Any]:
    columns = [{"name": f.name, "type": str(f.type)} for f in table.schema]
    out: dict[str, Any] = {"columns": columns, "rows": table.num_rows}
    numeric = [
        f.name for f in table.schema if pa.types.is_floating(f.type) or pa.types.is_integer(f.type)
    ]
    if len(numeric) >= 1:
        col = table.column(numeric[-1]).to_numpy()
        out.update(_tensor_fields(numeric[-1], str(col.dtype), col.shape, None, col, all_))
    return out


def _inflation_limit(data: memoryview) -> int:
    """What a foreign, possibly compressed Arrow file may decompress to be described: 64 times
    its size (real tensors compress far less) and at least 64 MiB; a 'zip bomb' is refused."""
    return max(64 << 20, 64 * data.nbytes)


def _describe_arrow_file(data: memoryview, all_: bool) -> dict[str, Any]:
    check_ipc_messages(data[8:], _inflation_limit(data))  # messages follow the 8-byte magic
    try:
        table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise CodecError(f"damaged Arrow IPC file: {exc}") from exc
    return {
        "format": "arrow-ipc-file",
        "cid": str(Cid.of(data)),
        **_arrow_table_fields(table, all_),
    }


def _describe_arrow_stream(data: memoryview, all_: bool) -> dict[str, Any]:
    check_ipc_messages(data, _inflation_limit(data))
    try:
        table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise CodecError(f"damaged Arrow IPC stream: {exc}") from exc
    return {
        "format": "arrow-ipc-stream",
        "cid": str(Cid.of(data)),
        **_arrow_table_fields(table, all_),
    }


def _describe_npy(data: memoryview, all_: bool) -> dict[str, Any]:
    import io

    # numpy's failures on a damaged file (a header that does not parse raises TokenError,
    # SyntaxError, ValueError, ...) become one CodecError in describe()'s reading() boundary.
    fmt = np.lib.format
    stream = io.BytesIO(data)
    version = fmt.read_magic(stream)
    # Version 3 differs from 2 only in the header's text encoding (UTF-8, not latin-1).
    read_header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
    shape, _, dtype = read_header(stream)
    # np.load allocates the whole array before reading it: bound the header's shape by the
    # bytes the file holds first.
    needed = stream.tell() + math.prod(shape) * dtype.itemsize
    if needed > data.nbytes:
        raise TruncatedData(f".npy array of shape {list(shape)}", needed, data.nbytes)
    stream.seek(0)
    values = np.load(stream, allow_pickle=False)
    return {
        "format": "npy",
        "cid": str(Cid.of(data)),
        **_tensor_fields("", str(values.dtype), values.shape, None, values, all_),
    }


def _is_safetensors(data: memoryview) -> bool:
    if data.nbytes < 10:
        return False
    (n,) = struct.unpack_from("<Q", data, 0)
    return 2 <= n <= min(_MAX_SAFETENSORS_HEADER, data.nbytes - 8) and bytes(data[8:9]) == b"{"


def _describe_safetensors(data: memoryview, all_: bool) -> dict[str, Any]:
    (n,) = struct.unpack_from("<Q", data, 0)
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
    except (ValueError, RecursionError) as exc:  # RecursionError: a deeply nested header
        raise CodecError(f"damaged safetensors header: {exc}") from exc
    tensors = [
        {"name": k, "dtype": v.get("dtype"), "shape": v.get("shape")}
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict)
    ]
    return {"format": "safetensors", "cid": str(Cid.of(data)), "tensors": tensors}


@dataclass(frozen=True)
class _Format:
    name: str
    sniff: Callable[[memoryview], bool]
    describe: Callable[[memoryview, bool], dict[str, Any]]


def _starts(magic: bytes) -> Callable[[memoryview], bool]:
    return lambda data: bytes(data[: len(magic)]) == magic


def _describe_fragment(data: memoryview, all_: bool) -> dict[str, Any]:
    fragment = decode_fragment_file(data)
    info = describe_fragment(fragment)
    info["cid"] = str(Cid.of(data))
    info["state_hash_ok"] = compute_state_hash(fragment.layers) == fragment.state_hash
    if fragment.layers:
        info["values"] = _values(np.asarray(fragment.layers[0].values), all_)
    return info


# Most specific first: the first format whose sniff accepts the bytes describes them.
FORMATS: list[_Format] = [
    _Format("tensorswap manifest", is_manifest, _describe_manifest),
    _Format("garw", is_garw, _describe_garw),
    _Format("ipfrs gradient file", is_ipfrs_gradient_file, _describe_ipfrs),
    _Format("arrow ipc file", _starts(_ARROW_FILE_MAGIC), _describe_arrow_file),
    _Format("tensorswap block", is_tensorswap_block, _describe_block),
    _Format("arrow ipc stream", _starts(_ARROW_CONTINUATION), _describe_arrow_stream),
    _Format("npy", _starts(_NPY_MAGIC), _describe_npy),
    _Format("safetensors", _is_safetensors, _describe_safetensors),
    _Format("dwe fragment", looks_like_fragment_file, _describe_fragment),
]


def describe(data: memoryview, *, all_values: bool = False) -> dict[str, Any]:
    """Describe `data` with the first format that recognises it; UnknownFormat otherwise.

    Every failure of a format's parser on damaged bytes is a CodecError (a TensorSwapError).
    """
    for fmt in FORMATS:
        with reading(fmt.name):
            if fmt.sniff(data):
                return fmt.describe(data, all_values)
    raise UnknownFormat(
        "unrecognised format (not a tensorswap block or manifest, Arrow IPC, ipfrs gradient, "
        "GARW, DWE fragment, .npy or safetensors file)"
    )


@click.command("inspect")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option(
    "--values", "all_values", is_flag=True, help=f"Print every value, not the first {PREVIEW}."
)
def inspect(file: str, all_values: bool) -> int:
    """Recognise FILE's encoding and print one JSON object describing it.

    Recognised: tensorswap blocks and manifests, Arrow IPC streams and files (including the
    ipfrs gradient file), GARW blocks, axiom DWE fragments, .npy and safetensors files.
    The object always has format and cid (of the file's bytes); for one tensor also name,
    dtype, shape, num_samples and the first values; for a manifest, a safetensors file or a
    fragment, its parts.
    An unknown or damaged file prints one error line and exits with code 2.
    """
    try:
        with mapped(file) as data:
            info = describe(data, all_values=all_values)
    except click.FileError as exc:
        click.echo(f"error: {exc.format_message()}", err=True)
        return 2
    except TensorSwapError as exc:
        click.echo(f"error: {file}: {exc}", err=True)
        return 2
    json.dump(info, sys.stdout, separators=(",", ":") if all_values else (", ", ": "))
    sys.stdout.write("\n")
    return 0
