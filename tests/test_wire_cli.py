"""`tensorswap send` / `tensorswap recv`: a receiver process, a sender in-process."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner

from tensorswap.cid import Cid
from tensorswap.cli.send_cmd import load_tensors, send
from tensorswap.codec import TensorBlock, write_block
from tensorswap.codec.ipfrs import write_ipfrs_gradient
from tensorswap.store import DirectoryStore, ModelUpdate, get_tensor, get_update
from tensorswap.wire.errors import AuthenticationFailed

RECV = "from tensorswap.cli.recv_cmd import recv; recv()"


@contextmanager
def receiver(*args: str) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """A `recv` process on a free port; yields (port, process)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", RECV, "--listen", "127.0.0.1:0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert match, line + proc.stderr.read()
        yield int(match.group(1)), proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_send_npy_then_recv_prints_the_cid(tmp_path: Path) -> None:
    values = np.arange(300_000, dtype=np.float32).reshape(600, 500)
    np.save(tmp_path / "weights.npy", values)
    out = tmp_path / "store"
    with receiver("--out", str(out), "--count", "1") as (port, proc):
        result = CliRunner().invoke(
            send, [str(tmp_path / "weights.npy"), "--to", f"127.0.0.1:{port}", "--chunk-bytes",
                   "65536"],
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        stdout, _ = proc.communicate(timeout=20)
    root = result.output.split()[0]
    assert re.search(r"bytes .* s .* GB/s", result.output)
    assert stdout.split()[0] == root
    assert "weights float32[600, 500]" in stdout
    np.testing.assert_array_equal(get_tensor(DirectoryStore(out), Cid.parse(root)).values, values)


def test_send_ipfrs_stream(tmp_path: Path) -> None:
    values = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    np.save(tmp_path / "grad.npy", values)
    out = tmp_path / "store"
    with receiver("--out", str(out), "--count", "1", "--ipfrs") as (port, proc):
        result = CliRunner().invoke(
            send, [str(tmp_path / "grad.npy"), "--to", f"127.0.0.1:{port}", "--ipfrs"]
        )
        assert result.exit_code == 0, result.output
        assert "2 chunks" in result.output
        stdout, _ = proc.communicate(timeout=20)
    root = Cid.parse(stdout.split()[0])
    np.testing.assert_array_equal(get_tensor(DirectoryStore(out), root).values, values)


def test_wrong_key_is_refused(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("right key\n")
    (tmp_path / "bad").write_text("wrong key\n")
    np.save(tmp_path / "x.npy", np.ones(10, np.float32))
    out = tmp_path / "store"
    with receiver("--out", str(out), "--key-file", str(tmp_path / "key")) as (port, _):
        args = [str(tmp_path / "x.npy"), "--to", f"127.0.0.1:{port}"]
        bad = CliRunner().invoke(send, [*args, "--key-file", str(tmp_path / "bad")])
        assert isinstance(bad.exception, AuthenticationFailed)
        good = CliRunner().invoke(send, [*args, "--key-file", str(tmp_path / "key")])
        assert good.exit_code == 0, good.output
    assert DirectoryStore(out).size().blocks == 2  # only the good send's chunk and manifest


def test_load_tensors_reads_every_format(tmp_path: Path) -> None:
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.save(tmp_path / "a.npy", values)
    np.savez(tmp_path / "b.npz", w=values, b=np.ones(2))
    write_block(TensorBlock("blk", values, num_samples=3), tmp_path / "c.arrow")
    write_ipfrs_gradient(values, tmp_path / "d.arrow")
    from safetensors.numpy import save_file

    save_file({"w": values}, str(tmp_path / "e.safetensors"))
    a = load_tensors(tmp_path / "a.npy")
    assert isinstance(a, TensorBlock) and a.name == "a"
    b = load_tensors(tmp_path / "b.npz")
    assert isinstance(b, ModelUpdate) and set(b.tensors) == {"w", "b"}
    c = load_tensors(tmp_path / "c.arrow")
    assert isinstance(c, TensorBlock) and (c.name, c.num_samples) == ("blk", 3)
    d = load_tensors(tmp_path / "d.arrow")
    assert isinstance(d, TensorBlock) and d.shape == (12,)
    e = load_tensors(tmp_path / "e.safetensors")
    assert isinstance(e, ModelUpdate)
    np.testing.assert_array_equal(e.tensors["w"], values)
    (tmp_path / "junk.bin").write_bytes(b"nothing we know")
    with pytest.raises(click.BadParameter, match=r"not a \.npy"):
        load_tensors(tmp_path / "junk.bin")


def test_send_update_over_blocks(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    tensors = {"w": np.ones((4, 4), np.float32), "b": np.zeros(4, np.float32)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    out = tmp_path / "store"
    with receiver("--out", str(out), "--count", "1") as (port, proc):
        result = CliRunner().invoke(
            send, [str(tmp_path / "m.safetensors"), "--to", f"127.0.0.1:{port}"]
        )
        assert result.exit_code == 0, result.output
        stdout, _ = proc.communicate(timeout=20)
    assert "(2 tensors)" in stdout
    update = get_update(DirectoryStore(out), Cid.parse(stdout.split()[0]))
    np.testing.assert_array_equal(update.tensors["w"], tensors["w"])
