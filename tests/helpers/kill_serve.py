"""`tensorswap serve` that SIGKILLs itself at a chosen point of its own work, for the restart
tests: ``python tests/helpers/kill_serve.py <serve options>``.

Environment:

- ``TS_KILL_ON``: a regular expression searched in every message the coordinator, its intake
  and the run manager log (debug included); the first match arms the kill.
- ``TS_KILL_WRITES``: once armed, die at the n-th block file the data directory's store
  starts to write (0, the default: at the matching message itself). The store calls its
  ``fault_point("write", path)`` seam before each file it writes, so n = 1 dies as the next
  result (an aggregate's chunk, the optimizer state, the new global model) begins to land.
- ``TS_KILL_TRACE``: a file to which every such message and write is appended (to find
  the points), nothing killed unless ``TS_KILL_ON`` is set too.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading

from tensorswap.cli.serve_cmd import serve
from tensorswap.store import DirectoryStore

WATCHED = (
    "tensorswap.rounds.engine.intake",
    "tensorswap.rounds.engine.coordinator",
    "tensorswap.runs.manager",
)

_pattern = re.compile(os.environ["TS_KILL_ON"]) if os.environ.get("TS_KILL_ON") else None
_writes_left = int(os.environ.get("TS_KILL_WRITES", "0"))
_trace = os.environ.get("TS_KILL_TRACE")
_armed = threading.Event()
_lock = threading.Lock()


def _note(line: str) -> None:
    if _trace:
        with open(_trace, "a") as out:
            out.write(line + "\n")


def _die() -> None:
    _note("killed")
    os.kill(os.getpid(), signal.SIGKILL)


class _Trigger(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        _note(f"log {message}")
        if record.levelno >= logging.WARNING:
            logging.getLogger().handle(record)  # what serve would have printed anyway
        if _pattern is not None and not _armed.is_set() and _pattern.search(message):
            _armed.set()
            if _writes_left == 0:
                _die()


def _fault_point(self: DirectoryStore, point: str, path: str) -> None:
    global _writes_left
    if point != "write":
        return
    _note(f"write {os.path.basename(path)}")
    if _armed.is_set():
        with _lock:
            _writes_left -= 1
            if _writes_left == 0:
                _die()


if __name__ == "__main__":
    for name in WATCHED:
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # debug lines would fill the test's unread stderr pipe
        logger.addHandler(_Trigger())
    DirectoryStore.fault_point = _fault_point  # type: ignore[method-assign]
    sys.argv[0] = "tensorswap serve"
    serve()
