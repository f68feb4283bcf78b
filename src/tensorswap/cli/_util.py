"""Small helpers shared by CLI commands: reading files without copies, host:port parsing."""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import click

from tensorswap._netaddr import HostPortError, split_host_port


@contextlib.contextmanager
def mapped(path: str | Path) -> Iterator[memoryview]:
    """The file's bytes as a read-only memoryview over an mmap (empty files give b'').

    A pipe or other non-regular file (``/dev/stdin``, ``<(cmd)``) is read to its end instead:
    its size is not known up front and it cannot be mapped.
    """
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below, after the mapping
    except OSError as exc:
        raise click.FileError(str(path), hint=exc.strerror or str(exc)) from exc
    with f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            try:
                content = f.read()
            except OSError as exc:
                raise click.FileError(str(path), hint=exc.strerror or str(exc)) from exc
            yield memoryview(content)
            return
        size = info.st_size
        if size == 0:
            yield memoryview(b"")
            return
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        view = memoryview(mm)
        try:
            yield view
        finally:
            # A derived buffer still alive (say, held by a traceback) keeps the mapping open;
            # the garbage collector closes it then.
            with contextlib.suppress(BufferError):
                view.release()
                mm.close()


def parse_host_port(text: str, *, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[::1]:PORT`` for IPv6, ``:PORT`` for the default host).

    The rules are :func:`tensorswap._netaddr.split_host_port`'s; errors are click.BadParameter.
    """
    try:
        return split_host_port(text, default_host=default_host)
    except HostPortError as exc:
        raise click.BadParameter(str(exc)) from None
