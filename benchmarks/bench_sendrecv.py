"""The command line's transfer: ``tensorswap send`` of a .npy to a fresh ``tensorswap recv``.

Compares, in one run, turn by turn, against raw TCP moving the same file's bytes into a file:

- raw: a receiver process that ``recv_into``s 4 MiB at a time and ``write``s each piece to a
  new file (a store's work without the hashing), fed by ``socket.sendfile`` of the .npy;
- tensorswap: a fresh ``tensorswap recv --out DIR --count 1`` per turn, fed by ``tensorswap
  send FILE --to ...`` (the README's two commands). The blocks are verified (blake3) and
  written to the directory store before ``send`` returns.

Two ratios, each raw / tensorswap per turn (median): ``transfer`` compares the seconds ``send``
prints (from connect to the receiver's confirmation that every block is stored) with the raw
transfer's (connect to the raw receiver's acknowledgement once its file is written);
``command`` compares the whole ``send`` process (start, reading the file, hashing, exit) with a
``python -c`` raw sender process. Goal: transfer >= 0.75x raw.

``python -m benchmarks sendrecv`` (or ``python benchmarks/bench_sendrecv.py [--quick] [--mib N]
[--reps N]``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

try:
    from benchmarks.__main__ import ratio_line
except ModuleNotFoundError:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.__main__ import ratio_line

GOAL_TRANSFER = 0.75
_PIECE = 4 * 1024 * 1024
_SENT = re.compile(r"\s(\d+(?:\.\d+)?) s\s")
_TENSORSWAP = [sys.executable, "-c", "from tensorswap.cli import main; main()"]
"""The ``tensorswap`` console script, as its entry point runs it."""


def serve_raw(directory: str, reps: int) -> None:
    """Accept ``reps`` connections; write each one's bytes to a new file, then acknowledge."""
    buf = memoryview(bytearray(_PIECE))
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(server.getsockname()[1], flush=True)
        for turn in range(reps):
            conn, _ = server.accept()
            with conn, open(Path(directory) / f"raw-{turn}", "wb", buffering=0) as out:
                while n := conn.recv_into(buf):
                    out.write(buf[:n])
                conn.sendall(b"k")


_RAW_SENDER = (
    "import socket,sys\n"
    "with socket.create_connection(('127.0.0.1', int(sys.argv[2]))) as c, open(sys.argv[1], 'rb')"
    " as f:\n"
    "    c.sendfile(f); c.shutdown(socket.SHUT_WR)\n"
    "    assert c.recv(1) == b'k'\n"
)


def send_raw(path: Path, port: int) -> float:
    """Seconds from connect to the raw receiver's acknowledgement (file written)."""
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as conn, open(path, "rb") as f:
        conn.sendfile(f)
        conn.shutdown(socket.SHUT_WR)
        if conn.recv(1) != b"k":
            raise RuntimeError("raw: no acknowledgement")
    return time.perf_counter() - start


def send_raw_command(path: Path, port: int) -> float:
    """Wall seconds of a raw sender process (``python -c``), start to exit."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", _RAW_SENDER, str(path), str(port)], check=True)
    return time.perf_counter() - start


@contextlib.contextmanager
def fresh_recv(out: Path) -> Iterator[int]:
    """A ``tensorswap recv --count 1`` on a free port; yields the port, waits for its exit."""
    proc = subprocess.Popen(
        [*_TENSORSWAP, "recv", "--listen", "127.0.0.1:0", "--out", str(out), "--count", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        match = re.search(r"listening on .*:(\d+)", line)
        if match is None:
            raise RuntimeError(f"tensorswap recv did not start: {line!r}")
        yield int(match.group(1))
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def send_tensorswap(path: Path, port: int) -> tuple[float, float]:
    """(seconds ``send`` printed, wall seconds of the ``send`` process)."""
    start = time.perf_counter()
    done = subprocess.run(
        [*_TENSORSWAP, "send", str(path), "--to", f"127.0.0.1:{port}", "--no-progress"],
        check=True,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    match = _SENT.search(done.stdout)
    if match is None:
        raise RuntimeError(f"unexpected send output: {done.stdout!r}")
    return float(match.group(1)), wall


def run(mib: int, reps: int) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="bench-sendrecv-"))
    try:
        path = work / "w.npy"
        values = np.random.default_rng(0).standard_normal(mib * 1024 * 1024 // 4)
        np.save(path, values.astype(np.float32))
        del values
        return _turns(work, path, reps)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _turns(work: Path, path: Path, reps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {}
    raw_dir = work / "raw"
    raw_dir.mkdir()
    receiver = subprocess.Popen(
        [sys.executable, __file__, "--serve-raw", str(raw_dir), "--reps", str(2 * reps)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert receiver.stdout is not None
        port = int(receiver.stdout.readline())
        for turn in range(reps):
            # Each output is deleted as soon as it is measured, so every method writes into
            # page cache freed moments before: on a VM that hands idle free memory back to
            # its host (free page reporting), memory freed seconds earlier costs ten times
            # more to touch again, and a method writing while another's file still stands
            # would pay that alone.
            times.setdefault("raw transfer", []).append(send_raw(path, port))
            _empty(raw_dir)
            times.setdefault("raw command", []).append(send_raw_command(path, port))
            _empty(raw_dir)
            with fresh_recv(work / f"ts-{turn}") as ts_port:
                seconds, wall = send_tensorswap(path, ts_port)
            shutil.rmtree(work / f"ts-{turn}", ignore_errors=True)
            times.setdefault("tensorswap transfer", []).append(seconds)
            times.setdefault("tensorswap command", []).append(wall)
    finally:
        receiver.kill()
        receiver.wait()
    return _report(path.stat().st_size, times)


def _empty(directory: Path) -> None:
    for old in directory.iterdir():
        old.unlink()


def _report(nbytes: int, times: dict[str, list[float]]) -> dict[str, float]:
    print(f"\n{nbytes / 2**20:.0f} MiB .npy over loopback, median of {len(times['raw transfer'])}:")
    for name, secs in times.items():
        rate = nbytes / statistics.median(secs) / 1e9
        print(f"  {name:22s} {statistics.median(secs) * 1e3:8.1f} ms  ({rate:.2f} GB/s)")
    ratios = {}
    for what in ("transfer", "command"):
        per_turn = [
            r / t for r, t in zip(times[f"raw {what}"], times[f"tensorswap {what}"], strict=True)
        ]
        ratios[what] = statistics.median(per_turn)
        print(
            f"  tensorswap / raw, {what}: median {ratios[what]:.2f}x"
            f" (min {min(per_turn):.2f}, max {max(per_turn):.2f})"
        )
    print(ratio_line("sendrecv_transfer_vs_raw", ratios["transfer"], ">=", GOAL_TRANSFER))
    print(ratio_line("sendrecv_command_vs_raw", ratios["command"]))
    return ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 MiB, 2 turns")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--serve-raw", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_raw:
        serve_raw(args.serve_raw, args.reps)
        return 0
    mib, reps = (32, 2) if args.quick else (args.mib, args.reps)
    ratios = run(mib, reps)
    return 0 if ratios["transfer"] >= GOAL_TRANSFER else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
