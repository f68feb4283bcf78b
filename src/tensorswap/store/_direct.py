"""Large block files written and read with O_DIRECT: the bytes go between the process's own
(pooled, already faulted-in) memory and the disk, never through fresh page-cache pages.

Why: a buffered write puts every byte into a page-cache page the kernel must first find and
allocate; on a VM whose free memory goes back to the host (free page reporting, see
docs/wire.md) each such page costs a fault in the host too. Measured on the 2-core VM:
writing 64 MiB to a new file took 170-270 ms of CPU buffered and 2-4 ms with O_DIRECT
(45-60 ms wall either way); reading it back into a warm buffer 4 ms of CPU. A block the
process needs again is read back the same way, into a slab of the process's pool.

O_DIRECT wants the memory address, the length and the file offset aligned to the device's
logical block size: buffers from ``tensorswap._pool`` start on a page, so a received
payload is written from where it landed; anything else, and a block's last partial page,
goes through a 4 MiB staging slab taken from the pool for the write (a copy into warm
memory). The file is then cut to its exact length. A file system that refuses O_DIRECT
(some network and FUSE file systems; older kernels' tmpfs) makes ``DirectIO.supported``
False for that store, logged once, which then writes and reads through the page cache as
before.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os

import numpy as np

from tensorswap._pool import receive_buffers

__all__ = ["DIRECT_MIN_BYTES", "DirectIO"]

DIRECT_MIN_BYTES = 1 << 20
"""Blocks at least this large are written and read directly; smaller ones buffered."""

_ALIGN = 4096  # covers 512- and 4096-byte logical blocks
_STAGE = 4 << 20  # the most a staging slab holds; also the step of each write
_O_DIRECT = getattr(os, "O_DIRECT", 0)
log = logging.getLogger("tensorswap.store")


class DirectIO:
    """O_DIRECT writing and reading of one store's large block files (thread-safe)."""

    def __init__(self, enabled: bool = True) -> None:
        self.supported = enabled and _O_DIRECT != 0
        """False once the file system refused O_DIRECT (or where the OS has none)."""
        self.writes = 0
        """Block files written directly so far."""
        self.reads = 0
        """Block files read directly so far."""

    def wants(self, nbytes: int) -> bool:
        return self.supported and nbytes >= DIRECT_MIN_BYTES

    def refused(self, exc: OSError) -> None:
        """Turn direct I/O off for this store (the file system refused it), saying so once."""
        if self.supported:
            log.info("direct I/O refused here, the page cache is used instead: %s", exc)
        self.supported = False

    def set_direct(self, fd: int) -> bool:
        """Turn O_DIRECT on for ``fd`` (Linux allows it on an open file); False, and direct
        I/O off for this store, where the file system refuses it."""
        if not self.supported:
            return False
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | _O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.refused(exc)
            return False
        return True

    def write(self, fd: int, data: memoryview) -> None:
        """Write ``data`` at the start of ``fd`` (O_DIRECT set by ``set_direct``), exactly."""
        flat = data if data.format == "B" and data.ndim == 1 else data.cast("B")
        total = flat.nbytes
        aligned = _address(flat) % _ALIGN == 0
        stage = receive_buffers().take(min(_STAGE, -(-total // _ALIGN) * _ALIGN))
        done = 0
        while done < total:
            step = min(stage.nbytes, total - done)
            whole = step - step % _ALIGN
            if aligned and whole:  # straight from the caller's page-aligned memory
                _pwrite_all(fd, flat[done : done + whole], done)
                done += whole
                continue
            stage[:step] = flat[done : done + step]
            padded = -(-step // _ALIGN) * _ALIGN
            stage[step:padded] = bytes(padded - step)
            _pwrite_all(fd, stage[:padded], done)
            done += step
        if total % _ALIGN:
            os.ftruncate(fd, total)  # the last page was padded
        self.writes += 1

    def read(self, fd: int, size: int) -> memoryview:
        """The ``size`` bytes of ``fd`` (O_DIRECT set by ``set_direct``) in a pooled slab."""
        padded = -(-size // _ALIGN) * _ALIGN
        slab = receive_buffers().take(padded)
        if _address(slab) % _ALIGN:  # not from the pool's page-aligned slabs
            raise OSError(errno.EINVAL, "no page-aligned buffer for a direct read")
        done = 0
        while done < size:
            got = os.preadv(fd, [slab[done:padded]], done)
            if got == 0:
                raise OSError(errno.EIO, f"block file ended at {done} of {size} bytes")
            done += got
        self.reads += 1
        return slab[:size]


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    written = os.pwrite(fd, data, offset)
    if written != data.nbytes:  # direct writes are whole or fail; a short one is an error
        raise OSError(errno.EIO, f"short direct write ({written} of {data.nbytes} bytes)")


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data)


_WRITE_STEP = 1 << 30  # os.write moves at most ~2 GiB per call on Linux; write in 1 GiB steps


def write_file(direct: DirectIO, fd: int, data: memoryview) -> None:
    """Write ``data`` to the new, empty file ``fd``: directly if ``direct`` wants it and the
    file system takes it, else through the page cache (also after a refused direct write)."""
    if direct.wants(data.nbytes) and direct.set_direct(fd):
        try:
            direct.write(fd, data)
            return
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # accepted at open, refused on write (FUSE...)
                raise
            direct.refused(exc)
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
            os.ftruncate(fd, 0)
    done = 0
    total = data.nbytes
    while done < total:
        done += os.pwrite(fd, data[done : done + _WRITE_STEP], done)


def read_file(direct: DirectIO, fd: int, size: int) -> memoryview | None:
    """The ``size`` bytes of the block file ``fd`` read directly into pooled memory (read
    only), or None: too small, or direct I/O off or refused (the caller maps it)."""
    if not direct.wants(size) or not direct.set_direct(fd):
        return None
    try:
        return direct.read(fd, size).toreadonly()
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        direct.refused(exc)
        return None
