"""`netlab.lab.read_line`: a child's startup lines off a pipe, each seen though they arrive in
one write (a buffered readline would hide the second from select)."""

from __future__ import annotations

import subprocess
import sys
import time

from tensorswap.netlab.lab import read_line

_TWO_LINES = (
    "import os, sys, time\n"
    "os.write(2, b'WARNING something\\nlistening on 127.0.0.1:5\\n')\n"
    "sys.stdin.read()\n"
)


def test_two_lines_in_one_write_are_both_read() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _TWO_LINES],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        assert read_line(proc.stderr, deadline) == "WARNING something\n"
        assert read_line(proc.stderr, deadline) == "listening on 127.0.0.1:5\n"
        assert read_line(proc.stderr, time.monotonic() + 0.05) == ""  # silent: the deadline
        assert proc.stdin is not None
        proc.stdin.close()
        assert read_line(proc.stderr, deadline) == ""  # end of file
    finally:
        proc.kill()
        proc.wait(timeout=30)
        for stream in (proc.stdin, proc.stderr):
            if stream is not None:
                stream.close()


def test_a_last_line_without_newline_is_returned() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import os; os.write(2, b'partial')"], stderr=subprocess.PIPE
    )
    try:
        assert proc.stderr is not None
        assert read_line(proc.stderr, time.monotonic() + 60) == "partial"
    finally:
        proc.wait(timeout=30)
        assert proc.stderr is not None
        proc.stderr.close()
