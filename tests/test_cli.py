"""The tensorswap command: cid and inspect, run in-process through main()."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from tensorswap.cid import Cid, HashFunction
from tensorswap.cli import main
from tensorswap.codec import TensorBlock, encode_block
from tensorswap.codec.garw import GarwBlock
from tensorswap.codec.ipfrs import encode_ipfrs_gradient
from tensorswap.delta import encode_frame, extract_delta_fragment
from tensorswap.store import MemoryStore, ModelUpdate, put_update, read_manifest

EMPTY_SHA256_RAW = "bafkreihdwdcefgh4dqkjv67uzcmw7ojee6xedzdetojuzjevtenxquvyku"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cid_of_empty_file_matches_the_ipfs_vector(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    rc, out, _ = run(capsys, "cid", "--hash", "sha2-256", str(empty))
    assert (rc, out.strip()) == (0, EMPTY_SHA256_RAW)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_cid_of_a_pipe_hashes_what_flows_through_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    content = b"through a pipe, whose size is 0 until read"

    def feed() -> None:
        with open(fifo, "wb") as writer:
            writer.write(content)

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        rc, out, _ = run(capsys, "cid", "--hash", "sha2-256", str(fifo))
    finally:
        feeder.join(10)
    assert rc == 0 and out.strip() == str(Cid.of(content, hash=HashFunction.SHA2_256))


def test_cid_defaults_to_blake3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"hello")
    rc, out, _ = run(capsys, "cid", str(f))
    assert rc == 0 and out.startswith("bafkr4i")


def _write(path: Path, data: object) -> Path:
    path.write_bytes(bytes(memoryview(data)))  # type: ignore[arg-type]
    return path


def _first_chunk(store: MemoryStore, update: Cid) -> Cid:
    tensor = read_manifest(store, read_manifest(store, update).links()[0])
    return tensor.links()[0]


@pytest.fixture
def samples(tmp_path: Path) -> dict[str, Path]:
    values = np.arange(12, dtype=np.float32)
    store = MemoryStore()
    manifest = put_update(store, ModelUpdate({"w": values}, num_samples=3))
    np.save(tmp_path / "x.npy", values.reshape(3, 4))
    return {
        "tensorswap-block": _write(
            tmp_path / "b.arrow", encode_block(TensorBlock("w", values.reshape(3, 4), 7))
        ),
        "garw": _write(tmp_path / "g.garw", GarwBlock.from_values("l", values, 9).to_bytes()),
        "ipfrs-gradient-arrow-file": _write(tmp_path / "i.arrow", encode_ipfrs_gradient(values)),
        "tensorswap-update-manifest": _write(tmp_path / "m.bin", store.get(manifest)),
        "npy": tmp_path / "x.npy",
        "tensorswap-chunk": _write(tmp_path / "c.blk", store.get(_first_chunk(store, manifest))),
        "dwe-fragment": _write(
            tmp_path / "f.dwe",
            encode_frame(extract_delta_fragment("s", 1, [values + 1], [values])),
        ),
    }


FORMATS = [
    "tensorswap-block",
    "garw",
    "ipfrs-gradient-arrow-file",
    "tensorswap-update-manifest",
    "npy",
    "dwe-fragment",
    "tensorswap-chunk",
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_inspect_recognises_each_format(
    fmt: str, samples: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run(capsys, "inspect", str(samples[fmt]))
    assert rc == 0, err
    info = json.loads(out)
    assert info["format"] == fmt
    assert info["cid"].startswith("b")


def test_inspect_block_fields_and_all_values(
    samples: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = run(capsys, "inspect", "--values", str(samples["tensorswap-block"]))
    info = json.loads(out)
    assert (rc, info["name"], info["dtype"], info["shape"], info["num_samples"]) == (
        0,
        "w",
        "float32",
        [3, 4],
        7,
    )
    assert info["values"] == [float(v) for v in range(12)]
    rc, out, _ = run(capsys, "inspect", str(samples["tensorswap-block"]))
    assert len(json.loads(out)["values"]) == 8


def test_inspect_fragment_checks_its_state_hash(
    samples: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = run(capsys, "inspect", str(samples["dwe-fragment"]))
    info = json.loads(out)
    assert info["state_hash_ok"] is True and info["values"][:2] == [1.0, 1.0]


def test_inspect_garw_reports_the_seed_id(
    samples: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    _, out, _ = run(capsys, "inspect", str(samples["garw"]))
    info = json.loads(out)
    assert info["num_samples"] == 9 and info["grad_id"].startswith("grad-")


@pytest.mark.parametrize("content", [b"", b"hello world", b"\xff\xff\xff\xff\x10\x00\x00\x00"])
def test_inspect_unknown_or_damaged_file_is_one_line_and_exit_2(
    tmp_path: Path, content: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    f = _write(tmp_path / "junk", content)
    rc, out, err = run(capsys, "inspect", str(f))
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error:")


def test_inspect_truncated_block_is_an_error(
    samples: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = samples["tensorswap-block"].read_bytes()
    f = _write(tmp_path / "cut", data[: len(data) // 2])
    rc, _, err = run(capsys, "inspect", str(f))
    assert rc == 2 and err.startswith("error:")


def test_inspect_missing_file_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(capsys, "inspect", str(tmp_path / "nope"))
    assert rc == 2 and "error" in err


@pytest.mark.parametrize(
    "values",
    [
        np.array([1 + 2j, 3j], np.complex64),
        np.array(["ab", "c"]),
        np.array([True, False]),
        np.zeros(2, [("a", "<i4"), ("b", "<f4")]),
    ],
)
def test_inspect_npy_of_any_plain_dtype(
    values: np.ndarray, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.save(tmp_path / "x.npy", values)
    rc, out, _ = run(capsys, "inspect", str(tmp_path / "x.npy"))
    info = json.loads(out)
    assert rc == 0 and info["format"] == "npy" and len(info["values"]) == 2


def test_inspect_npy_header_cannot_claim_more_than_the_file_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    np.save(tmp_path / "x.npy", np.zeros(2, np.float64))
    raw = (tmp_path / "x.npy").read_bytes()
    end = raw.index(b"\n")  # the header is padded with spaces up to its newline
    header = raw[:end].replace(b"(2,)", b"(1099511627776,)")  # 8 TiB of float64
    forged = header[:end] + raw[end:]  # np.load would allocate all of it before reading
    assert len(forged) == len(raw)
    f = _write(tmp_path / "big.npy", forged)
    rc, out, err = run(capsys, "inspect", str(f))
    assert rc == 2 and out == "" and err.startswith("error:") and "1099511627776" in err


# ── help texts and options a new user meets ──────────────────────────────────
def test_bench_dir_that_is_not_a_benchmarks_folder_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = run(capsys, "bench", "--dir", str(tmp_path))
    assert rc == 1 and str(tmp_path) in err and "__main__.py" in err
    assert "installed without it" not in err


@pytest.mark.parametrize("command", ["send", "recv", "serve", "status"])
def test_key_file_help_says_the_variable_holds_the_key_itself(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = run(capsys, command, "--help")
    assert rc == 0
    assert "the key itself" in " ".join(out.split())


@pytest.mark.parametrize("command", ["listen", "send"])
def test_delta_max_bytes_is_explained(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "delta", command, "--help")
    help_text = " ".join(out.split())
    assert rc == 0 and "--max-bytes" in help_text and "fragment size cap" in help_text


def test_inspect_help_promises_only_what_every_object_has(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = run(capsys, "inspect", "--help")
    assert rc == 0 and "always has format and cid" in " ".join(out.split())
    store = MemoryStore()
    root = put_update(store, ModelUpdate({"a": np.ones(2, np.float32)}, 3))
    f = _write(tmp_path / "update.bin", bytes(store.get(root)))
    rc, out, _ = run(capsys, "inspect", str(f))
    info = json.loads(out)
    assert rc == 0 and {"format", "cid"} <= info.keys() and "dtype" not in info


def test_send_progress_help_says_when_the_bar_shows(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(capsys, "send", "--help")
    assert rc == 0 and "64 MiB or more" in " ".join(out.split())


def test_send_progress_bar_keeps_stdout_to_the_result_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import re
    import subprocess
    import sys

    np.save(tmp_path / "w.npy", np.arange(70_000, dtype=np.float32))
    receiver = subprocess.Popen(
        [sys.executable, "-c", "from tensorswap.cli import main; main()", "recv",
         "--listen", "127.0.0.1:0", "--out", str(tmp_path / "store"), "--count", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert receiver.stderr is not None
        line = receiver.stderr.readline()
        port = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert port, line
        rc, out, _ = run(
            capsys, "send", str(tmp_path / "w.npy"), "--to", f"127.0.0.1:{port[1]}", "--progress"
        )
    finally:
        receiver.terminate()
        receiver.wait(timeout=10)
        receiver.stderr.close()  # type: ignore[union-attr]
    assert rc == 0
    assert len(out.splitlines()) == 1 and out.startswith("bagaybqab"), repr(out)


def _fake_benchmarks(root: Path) -> Path:
    folder = root / "fakebench"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "__main__.py").write_text(
        "import sys\n"
        "name = sys.argv[-1]\n"
        "print('RATIO speed', '0.1 >= 0.5' if name == 'slow' else '3 >= 2')\n"
    )
    for name in ("slow", "fast"):
        (folder / f"bench_{name}.py").write_text("")
    return folder


def test_bench_exit_status_and_summary_count_a_missed_goal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _fake_benchmarks(tmp_path)
    assert main(["bench", "--dir", str(folder), "fast"]) == 0
    assert "report a missed goal: none" in " ".join(capsys.readouterr().out.split())
    assert main(["bench", "--dir", str(folder)]) == 1
    assert "report a missed goal: slow" in " ".join(capsys.readouterr().out.split())
    assert main(["bench", "--dir", str(folder), "--json"]) == 1
    payload = json.loads(capsys.readouterr().out)
    assert payload["missed"] == ["slow"] and payload["failed"] == []
