"""Damaged files of every format the CLI reads: one error line and exit code 2, or success.

Valid files are truncated, have bytes flipped, or get garbage (random bytes, or characters a
header parser tokenizes) spliced into or written over them, mostly where headers live; each
command that reads the format runs in-process on the result.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from helpers.net import make_cert
from tensorswap.cli import main
from tensorswap.codec import TensorBlock, encode_block
from tensorswap.codec.garw import GarwBlock
from tensorswap.codec.ipfrs import encode_ipfrs_gradient
from tensorswap.delta import encode_frame, extract_delta_fragment
from tensorswap.store import MemoryStore, ModelUpdate, put_update, read_manifest

VALUES = np.arange(24, dtype=np.float32).reshape(4, 6)
NOWHERE = "127.0.0.1:1"  # nothing listens: a file that reads fine ends in a refused connect


def _npy() -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, VALUES)
    return buffer.getvalue()


def _npz() -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, w=VALUES, b=np.ones(3, np.float32))
    return buffer.getvalue()


def _safetensors() -> bytes:
    from safetensors.numpy import save

    return save({"w": VALUES, "b": np.ones(3, np.float32)})


def _arrow(kind: str) -> bytes:
    table = pa.table({"step": pa.array([1, 2, 3], pa.int64()), "loss": [0.5, 0.25, 0.125]})
    sink = pa.BufferOutputStream()
    opener = pa.ipc.new_stream if kind == "stream" else pa.ipc.new_file
    with opener(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def _store_objects() -> dict[str, bytes]:
    store = MemoryStore()
    root = put_update(store, ModelUpdate({"w": VALUES}, num_samples=3))
    tensor = read_manifest(store, root).links()[0]
    chunk = read_manifest(store, tensor).links()[0]
    return {
        "update-manifest": bytes(store.get(root)),
        "tensor-manifest": bytes(store.get(tensor)),
        "chunk": bytes(store.get(chunk)),
    }


def _pem(directory: Path) -> bytes:
    cert, _ = make_cert(directory, san=False)
    return cert.read_bytes()


_BUILT: dict[str, bytes] = {}


def _valid(name: str, directory: Path) -> bytes:
    """The valid file of format ``name`` (built once)."""
    if name not in _BUILT:
        _BUILT[name] = _build(name, directory)
    return _BUILT[name]


def _build(name: str, directory: Path) -> bytes:
    if name in ("update-manifest", "tensor-manifest", "chunk"):
        return _store_objects()[name]
    builders: dict[str, Callable[[], bytes]] = {
        "block": lambda: bytes(encode_block(TensorBlock("w", VALUES, 7))),
        "garw": lambda: bytes(GarwBlock.from_values("l", VALUES.ravel(), 9).to_bytes()),
        "ipfrs": lambda: bytes(encode_ipfrs_gradient(VALUES.ravel())),
        "arrow-file": lambda: _arrow("file"),
        "arrow-stream": lambda: _arrow("stream"),
        "npy": _npy,
        "npz": _npz,
        "safetensors": _safetensors,
        "dwe": lambda: bytes(encode_frame(extract_delta_fragment("s", 1, [VALUES + 1], [VALUES]))),
        "key": lambda: b"a shared key\n",
        "pem": lambda: _pem(directory),
    }
    return builders[name]()


@dataclass(frozen=True)
class Case:
    """A command reading one format: ``argv(path, directory)`` with the damaged file at path."""

    format: str
    suffix: str
    argv: Callable[[Path, Path], list[str]]

    @property
    def id(self) -> str:
        return f"{self.argv.__name__.strip('_')}-{self.format}"


def _inspect(path: Path, _: Path) -> list[str]:
    return ["inspect", str(path)]


def _send(path: Path, _: Path) -> list[str]:
    return ["send", str(path), "--to", NOWHERE]


def _delta_send(path: Path, directory: Path) -> list[str]:
    base = directory / f"base{path.suffix}"
    return ["delta", "send", "--to", NOWHERE, "--timeout", "0.01", str(base), str(path)]


def _send_with_key(path: Path, directory: Path) -> list[str]:
    return ["send", str(directory / "ok.npy"), "--to", NOWHERE, "--key-file", str(path)]


def _send_with_ca(path: Path, directory: Path) -> list[str]:
    return ["send", str(directory / "ok.npy"), "--to", NOWHERE, "--tls-ca", str(path)]


CASES = [
    *(
        Case(fmt, ".bin", _inspect)
        for fmt in (
            "block",
            "chunk",
            "tensor-manifest",
            "update-manifest",
            "garw",
            "ipfrs",
            "arrow-file",
            "arrow-stream",
            "npy",
            "safetensors",
            "dwe",
        )
    ),
    *(Case(fmt, f".{fmt}", _send) for fmt in ("npy", "npz", "safetensors", "block", "ipfrs")),
    Case("npz", ".npz", _delta_send),
    Case("safetensors", ".safetensors", _delta_send),
    Case("key", ".key", _send_with_key),
    Case("pem", ".pem", _send_with_ca),
]

# Characters numpy's and JSON's header parsers tokenize: garbage that gets past the first check.
_HEADER_TEXT = st.text(
    alphabet="(){}[]:,'\" 0123456789.-eE<>|fiubTrueFalsNn\n\\", min_size=1, max_size=24
)


@st.composite
def damaged(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` truncated, with up to 8 bytes flipped, or with garbage spliced in or over."""
    n = len(data)

    def position() -> int:  # mostly in the first bytes, where magics and headers live
        return draw(
            st.integers(0, min(n, 128) - 1)
            | st.integers(0, min(n, 512) - 1)
            | st.integers(0, n - 1)
        )

    kind = draw(st.sampled_from(["truncate", "flip", "splice", "overwrite"]))
    if kind == "truncate":
        return data[: position()]
    if kind == "flip":
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            out[position()] ^= draw(st.integers(1, 255))
        return bytes(out)
    garbage = draw(
        _HEADER_TEXT.map(str.encode)
        | st.sampled_from([b"(", b"[", b"{", b"}", b"'", b'"', b"\x80", b"\xff"])
        | st.binary(min_size=1, max_size=64)
    )
    at = position()
    if kind == "splice":
        return data[:at] + garbage + data[at:]
    return data[:at] + garbage + data[at + len(garbage) :]


def run_cli(argv: list[str]) -> tuple[int, str]:
    with CliRunner().isolation() as (_, err, _):
        rc = main(argv)
    return rc, err.getvalue().decode(errors="replace")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("damaged")
    np.save(directory / "ok.npy", VALUES)
    np.savez(directory / "base.npz", w=VALUES, b=np.ones(3, np.float32))
    (directory / "base.safetensors").write_bytes(_safetensors())
    return directory


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_the_valid_file_is_read(case: Case, workdir: Path) -> None:
    """The baseline: undamaged, each file gets past reading (inspect succeeds; the senders
    get as far as the refused connection)."""
    path = workdir / f"valid{case.suffix}"
    path.write_bytes(_valid(case.format, workdir))
    rc, err = run_cli(case.argv(path, workdir))
    if case.argv is _inspect:
        assert rc == 0, err
    else:
        assert rc == 2 and ("Connect call failed" in err or "connection to" in err), err


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_damaged_file_is_one_error_line_or_read(
    case: Case, workdir: Path, data: st.DataObject
) -> None:
    path = workdir / f"damaged{case.suffix}"
    path.write_bytes(data.draw(damaged(_valid(case.format, workdir)), label="content"))
    rc, err = run_cli(case.argv(path, workdir))
    event("read" if rc == 0 or "onnect" in err else "refused")
    assert "Traceback" not in err
    if rc != 0:
        errors = [line for line in err.splitlines() if line.lower().startswith("error")]
        assert (rc, len(errors)) == (2, 1), err
