"""Bad input to every command is one error line and exit code 2, never a traceback."""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tensorswap.cli import main


def run_bad(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the command; assert exit code 2 and one error line; return that line."""
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.lower().startswith("error")]
    assert (rc, len(errors)) == (2, 1), err
    return errors[0]


def _npy(values: np.ndarray, *, allow_pickle: bool = False) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, values, allow_pickle=allow_pickle)
    return buffer.getvalue()


def _npz(path: Path, member: bytes, *, name: str = "a.npy") -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(name, member)
    return path


def _bad_crc_npz(path: Path) -> Path:
    _npz(path, _npy(np.arange(100, dtype=np.float32)))
    raw = bytearray(path.read_bytes())
    raw[raw.index(b"\x93NUMPY") + 200] ^= 0xFF  # in the array data: the member's CRC fails
    path.write_bytes(bytes(raw))
    return path


_GOOD = _npy(np.arange(100, dtype=np.float32))
_DAMAGED: dict[str, object] = {
    "trunc.npy": _GOOD[:200],
    "object.npy": _npy(np.array([1, "a"], dtype=object), allow_pickle=True),
    "badheader.npy": b"\x93NUMPY\x01\x00\x10\x00{'descr': 1}    \n",
    "badmember.npz": b"\x93NUMPY junk, not a version",
    "truncmember.npz": _GOOD[:150],
    "objmember.npz": _npy(np.array([1, "a"], dtype=object), allow_pickle=True),
    "crc.npz": _bad_crc_npz,
}


def _damaged(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    content = _DAMAGED[name]
    if callable(content):
        return content(path)  # type: ignore[no-any-return]
    assert isinstance(content, bytes)
    if name.endswith(".npz"):
        return _npz(path, content)
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("name", sorted(_DAMAGED))
def test_send_of_a_damaged_npy_or_npz_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    path = _damaged(tmp_path, name)
    line = run_bad(capsys, "send", str(path), "--to", "127.0.0.1:1")
    assert name in line and "not a readable" in line


@pytest.mark.parametrize("name", ["badmember.npz", "crc.npz", "objmember.npz"])
def test_delta_send_of_a_damaged_npz_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    good = tmp_path / "good.npz"
    np.savez(good, a=np.ones(3, np.float32))
    path = _damaged(tmp_path, name)
    line = run_bad(capsys, "delta", "send", "--to", "127.0.0.1:1", str(good), str(path))
    assert name in line and "not a readable" in line


def test_inspect_of_a_deeply_nested_safetensors_header_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    header = ('{"a":' + "[" * 100_000 + "]" * 100_000 + "}").encode()
    path = tmp_path / "nested.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    assert "damaged safetensors header" in run_bad(capsys, "inspect", str(path))


@pytest.mark.parametrize(
    "option", [("--chunk-bytes", "0"), ("--chunk-bytes", "-4"), ("--ipfrs", "--chunk-size", "-1")]
)
def test_send_refuses_bad_chunk_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: tuple[str, ...]
) -> None:
    path = tmp_path / "x.npy"
    np.save(path, np.ones(4, np.float32))
    line = run_bad(capsys, "send", str(path), "--to", "127.0.0.1:1", *option)
    assert option[-2] in line


def _key_and_tls_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    empty, garbage, npy = tmp_path / "empty.key", tmp_path / "garbage.pem", tmp_path / "x.npy"
    empty.write_bytes(b"\n")
    garbage.write_bytes(bytes(range(256)))
    np.save(npy, np.ones(4, np.float32))
    listen = ["--listen", "127.0.0.1:0"]
    send = ["send", str(npy), "--to", "127.0.0.1:1"]
    recv = ["recv", *listen, "--out", str(tmp_path / "store")]
    serve = ["serve", *listen, "--data", str(tmp_path / "data")]
    status = ["status", "127.0.0.1:1"]
    return [
        ([*send, "--key-file", str(empty)], "--key-file"),
        ([*recv, "--key-file", str(empty)], "--key-file"),
        ([*serve, "--key-file", str(empty)], "--key-file"),
        ([*status, "--key-file", str(empty)], "--key-file"),
        ([*send, "--tls-ca", str(garbage)], "--tls-ca"),
        ([*status, "--tls-ca", str(garbage)], "--tls-ca"),
        ([*recv, "--tls-cert", str(garbage)], "--tls-cert"),
        ([*recv, "--ipfrs", "--tls-cert", str(garbage)], "--tls-cert"),
        ([*serve, "--tls-cert", str(garbage), "--tls-key", str(garbage)], "--tls-key"),
        (["delta", "send", "--to", "127.0.0.1:1", "--key", "", str(npy), str(npy)], "--key"),
    ]


@pytest.mark.parametrize("case", range(10))
def test_a_bad_key_or_tls_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: int
) -> None:
    argv, option = _key_and_tls_cases(tmp_path)[case]
    assert f"'{option}'" in run_bad(capsys, *argv)


def test_an_empty_key_in_the_environment_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TENSORSWAP_KEY", "")
    assert "$TENSORSWAP_KEY" in run_bad(capsys, "status", "127.0.0.1:1")


def test_a_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "Could not open file" in run_bad(capsys, "cid", str(tmp_path / "nonexistent"))


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf"])
def test_timeouts_must_be_finite_and_positive(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    npy = tmp_path / "x.npy"
    np.save(npy, np.ones(4, np.float32))
    for argv in (
        ["status", "127.0.0.1:1"],
        ["send", str(npy), "--to", "127.0.0.1:1"],
        ["recv", "--listen", "127.0.0.1:0", "--out", str(tmp_path / "store")],
        ["serve", "--listen", "127.0.0.1:0", "--data", str(tmp_path / "data")],
        ["delta", "send", "--to", "127.0.0.1:1", str(npy), str(npy)],
        ["flow", "sub", "ipc:///nonexistent/flow.ipc"],
        ["bench", "nonexistent-suite"],
    ):
        assert "'--timeout'" in run_bad(capsys, *argv, "--timeout", value)


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--listen", "127.0.0.1:0", "--data", "d", "--max-wait", "nan"],
        ["serve", "--listen", "127.0.0.1:0", "--data", "d", "--gc-grace", "nan"],
        ["flow", "pub", "ipc:///nonexistent/flow.ipc", "--wait", "nan"],
        ["flow", "pub", "ipc:///nonexistent/flow.ipc", "--linger", "nan"],
        ["flow", "pub", "ipc:///nonexistent/flow.ipc", "--interval", "inf"],
        ["recv", "--listen", "127.0.0.1:0", "--out", "store", "--count", "-1"],
        ["delta", "listen", "127.0.0.1:0", "--count", "-1"],
        ["delta", "listen", "127.0.0.1:0", "--max-bytes", "0"],
        ["delta", "listen", "127.0.0.1:0", "--max-bytes", "4294967296"],
    ],
)
def test_other_numeric_options_refuse_nan_and_negatives(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    assert f"'{argv[-2]}'" in run_bad(capsys, *argv)


@pytest.mark.parametrize("kind", ["stream", "file"])
def test_inspect_refuses_a_compressed_arrow_file_that_would_inflate_past_its_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    import pyarrow as pa

    table = pa.table({"v": pa.array(np.zeros(20 << 20, np.float32))})  # 80 MiB of zeros
    sink = pa.BufferOutputStream()
    opener = pa.ipc.new_stream if kind == "stream" else pa.ipc.new_file
    with opener(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as w:
        w.write_table(table)
    path = tmp_path / f"bomb.{kind}.arrow"
    path.write_bytes(sink.getvalue().to_pybytes())
    assert path.stat().st_size < 1 << 20
    assert "decompressed bytes" in run_bad(capsys, "inspect", str(path))


def _npy_with_header(header: bytes, body: bytes = bytes(100)) -> bytes:
    """A version 1.0 .npy file whose header text is ``header`` (padded as numpy pads it)."""
    pad = -(10 + len(header) + 1) % 64
    text = header + b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + body


# numpy's header parser raises tokenize.TokenError, SyntaxError, ValueError and more.
_UNPARSABLE_HEADERS = {
    "token": b"{'descr': '<f4', 'fortran_order': False, 'shape': ((5, 5), }",
    "syntax": b"{'descr': '<f4', 'fortran_order': False, 'shape': (5,)) }",
    "not-a-dict": b"['descr', '<f4']",
    "shape-type": b"{'descr': '<f4', 'fortran_order': False, 'shape': 'five'}",
}


@pytest.mark.parametrize("case", sorted(_UNPARSABLE_HEADERS))
@pytest.mark.parametrize("command", ["inspect", "send"])
def test_a_npy_header_numpy_cannot_parse_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, case: str
) -> None:
    path = tmp_path / "bad.npy"
    path.write_bytes(_npy_with_header(_UNPARSABLE_HEADERS[case]))
    argv = [command, str(path)] + (["--to", "127.0.0.1:1"] if command == "send" else [])
    line = run_bad(capsys, *argv)
    assert str(path) in line and "npy" in line


def test_a_npz_member_whose_header_does_not_parse_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _npz(tmp_path / "bad.npz", _npy_with_header(_UNPARSABLE_HEADERS["token"]))
    line = run_bad(capsys, "send", str(path), "--to", "127.0.0.1:1")
    assert str(path) in line and "not a readable .npz file" in line
