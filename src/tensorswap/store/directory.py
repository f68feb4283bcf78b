"""DirectoryStore: a file per block in sharded directories, written atomically, read by mmap."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import stat as statmod
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NoReturn

from tensorswap.cid import Cid
from tensorswap.errors import BlockNotFound, CorruptBlock, InvalidCid, StoreError
from tensorswap.store._direct import DirectIO, read_file, write_file
from tensorswap.store._files import fsync_dir, identity, is_shard, list_dir, syncfs
from tensorswap.store._inventory import MAX_KNOWN, Inventory
from tensorswap.store.base import BlockStore, StoreSize

__all__ = ["FORMAT_LINE", "DirectoryStore"]

FORMAT_LINE = b"tensorswap-blockstore 1\n"
"""Contents of ``<root>/FORMAT``; a directory holding anything else is refused."""

_TMP_SUFFIX = ".tmp"
EMPTY_SHARD_AGE = 600.0
"""Seconds a shard directory must have stayed empty before a rescan removes it: a delete
leaves its shard in place, since a busy store writes into it again (see ``_inventory``)."""


_READ_SMALL = 64 * 1024  # blocks up to this size are read into memory rather than mapped
_OWN_WRITES_KEPT = 1 << 16  # blocks remembered as written by this store (trust_own_writes)
# A block file is a regular file the store wrote: a symlink is never followed, and opening a
# FIFO put there must not wait for a writer (O_NONBLOCK changes nothing for regular files).
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


class DirectoryStore(BlockStore):
    """Blocks as files ``<root>/blocks/<d0>/<d1>/<cid>``, ``d0 d1`` = first two digest bytes in hex.

    - Writes go to a temp file ``.<cid>.<random>.tmp`` in the block's own directory, which is
      then renamed over the final name (``os.replace``), so a block is visible whole or not at
      all; a crash leaves at most a temp file, which every listing ignores and
      ``remove_temp_files`` (also run by garbage collection) deletes.
    - ``fsync=True`` syncs the file before the rename and the directory after it, so a put
      that returned survives a power loss.
    - ``direct_io`` (default True): blocks of 1 MiB or more are written and read with
      O_DIRECT, between the process's pooled memory and the disk, not through fresh
      page-cache pages (``store._direct``: on a VM that returns free memory to its host those
      cost more than the disk); where the file system refuses O_DIRECT, through the page
      cache.
    - ``get`` reads a large block into pooled memory (direct I/O) or maps it read-only
      (``mmap``) and, unless verification is turned off, re-hashes it before returning. A
      block that no longer matches its CID raises CorruptBlock naming the CID and the path,
      its bytes are never returned, and the file is moved to ``<root>/quarantine/`` so that
      ``has`` turns False and the block can be put (fetched) again.
    - ``trust_own_writes=True``: a block this store object wrote itself (after hashing its
      bytes in ``put`` / ``put_verified``) is not re-hashed by ``get`` while its file is
      still the one written (same inode, size, modification and status change times);
      anything else, and everything after a restart, is re-hashed as usual. For a server
      that reads its own small manifests back soon after (the rounds coordinator; the reads
      that feed an aggregate always re-hash).
    - ``inventory_limit``: the most blocks ``inventory()`` keeps an account of; a store
      holding more is walked at each call instead.
    - Lifetime: the returned memoryview owns its memory (pooled, or a mapping). It stays
      valid (also after the block is deleted: a read is a copy, and POSIX keeps an unlinked
      file's pages) until the view and every object built on it (numpy arrays, slices) are
      garbage collected. Nothing needs closing. Files are never modified in place by the
      store; a process that truncates a mapped block file behind its back makes access to a
      live view fault.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fsync: bool = False,
        verify_reads: bool = True,
        create: bool = True,
        trust_own_writes: bool = False,
        inventory_limit: int = MAX_KNOWN,
        direct_io: bool = True,
    ) -> None:
        self.root = Path(root)
        self.direct = DirectIO(direct_io)
        """Direct I/O of large blocks: ``supported`` (False once refused), ``writes``, ``reads``."""
        self.fsync = fsync
        self.verify_reads = verify_reads
        self.trust_own_writes = trust_own_writes
        self._own: OrderedDict[Cid, tuple[int, int, int, int]] = OrderedDict()
        self._own_lock = threading.Lock()
        self._inventory = Inventory(inventory_limit)
        self._blocks = os.path.join(self.root, "blocks")
        self._quarantine = os.path.join(self.root, "quarantine")
        fmt = self.root / "FORMAT"
        try:
            if fmt.exists():
                found = _read_format(fmt)
                if found != FORMAT_LINE:
                    raise StoreError(
                        f"{self.root} is not a tensorswap block store: FORMAT={found!r}"
                    )
            elif not create:
                raise StoreError(f"no block store at {self.root} (and create=False)")
            else:
                self.root.mkdir(parents=True, exist_ok=True)
                self._write_file_atomic(str(fmt), memoryview(FORMAT_LINE))
            os.makedirs(self._blocks, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot open block store at {self.root}: {exc}") from exc

    # ── paths ────────────────────────────────────────────────────────────────
    def path_of(self, cid: Cid) -> str:
        """Where the block with this CID lives (whether or not it is there)."""
        d = cid.digest
        return f"{self._blocks}{os.sep}{d[0]:02x}{os.sep}{d[1]:02x}{os.sep}{cid}"

    # ── writing ──────────────────────────────────────────────────────────────
    def _store(self, cid: Cid, data: memoryview, adopt: bool) -> None:
        path = self.path_of(cid)
        try:
            # Already held (idempotent put; damage is caught and quarantined on read): its age
            # restarts, as for ``touch``, so a collection's grace period spares it; if it went
            # away meanwhile (a collection, a delete) it is written below.
            found = os.lstat(path)
            if not statmod.S_ISREG(found.st_mode):
                # A directory, symlink, FIFO...: no block; moved aside so the block can be
                # written (os.replace cannot replace a directory).
                self._quarantine_file(path, found)
            elif found.st_size == data.nbytes and self._touch_file(cid, path):
                self._inventory.added(cid)
                return
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreError(f"cannot stat {path}: {exc}") from exc
        for attempt in range(3):
            try:
                self._makedirs(os.path.dirname(path))
                written = self._write_file_atomic(path, data)
                break
            except FileNotFoundError as exc:
                # its shard directory went between the two (a rescan removes shards left
                # empty for long, another process may remove any): made again
                if attempt == 2:
                    raise StoreError(f"cannot write block {cid} to {path}: {exc}") from exc
            except OSError as exc:
                raise StoreError(f"cannot write block {cid} to {path}: {exc}") from exc
        self._inventory.added(cid)
        if self.trust_own_writes:
            with self._own_lock:
                self._own[cid] = identity(written)
                if len(self._own) > _OWN_WRITES_KEPT:
                    self._own.popitem(last=False)

    def _makedirs(self, directory: str) -> None:
        if os.path.isdir(directory):
            return
        parent = os.path.dirname(directory)
        self._makedirs(parent)
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory)
            if self.fsync:
                fsync_dir(parent)

    def _write_file_atomic(self, path: str, data: memoryview) -> os.stat_result:
        """Write ``data`` to ``path`` atomically; the written file's stat."""
        self.fault_point("write", path)
        directory, name = os.path.split(path)
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(8)}{_TMP_SUFFIX}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            try:
                write_file(self.direct, fd, data)
                if self.fsync:
                    os.fsync(fd)
                os.replace(tmp, path)
                written = os.fstat(fd)  # after the rename, which sets the status change time
            finally:
                os.close(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.fsync:
            fsync_dir(directory)
        return written

    # ── reading ──────────────────────────────────────────────────────────────
    def get(self, cid: Cid, *, verify: bool | None = None) -> memoryview:
        """The block's bytes, memory-mapped, re-hashed first unless verification is off.

        ``verify=None`` uses the store's ``verify_reads`` (default True); ``verify=False`` is
        for trusted hot paths that have just checked the block. Raises BlockNotFound,
        CorruptBlock (the bytes are not returned) or StoreError for other OS failures.
        """
        path = self.path_of(cid)
        try:
            fd = os.open(path, _READ_FLAGS)
        except FileNotFoundError:
            raise BlockNotFound(cid) from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symlink (O_NOFOLLOW), a socket
                with contextlib.suppress(OSError):
                    self._not_a_block_file(cid, path, os.lstat(path))
            raise StoreError(f"cannot open block {cid} at {path}: {exc}") from exc
        mapping: mmap.mmap | None = None
        try:
            stat = os.fstat(fd)
            if not statmod.S_ISREG(stat.st_mode):
                os.close(fd)
                fd = -1
                self._not_a_block_file(cid, path, stat)
            direct = read_file(self.direct, fd, stat.st_size)
            if direct is not None:
                view = direct  # into pooled memory, no page-cache pages (store._direct)
            elif stat.st_size > _READ_SMALL:
                mapping = mmap.mmap(fd, stat.st_size, access=mmap.ACCESS_READ)
                view = memoryview(mapping)
            else:  # a small block: one read costs less than mapping and unmapping it
                view = memoryview(os.read(fd, stat.st_size))
        except OSError as exc:
            raise StoreError(f"cannot map block {cid} at {path}: {exc}") from exc
        finally:
            if fd >= 0:
                os.close(fd)
        check = self.verify_reads if verify is None else verify
        if check and verify is None and self.trust_own_writes:
            with self._own_lock:
                check = self._own.get(cid) != identity(stat)
        if check and not cid.matches(view):
            actual = Cid.of(view, codec=cid.codec, hash=cid.hash)
            view.release()
            if mapping is not None:
                with contextlib.suppress(BufferError):
                    mapping.close()
            moved = self._quarantine_file(path, stat)
            detail = f"content hashes to {actual} ({stat.st_size} bytes)"
            raise CorruptBlock(cid, path, detail + (f"; moved to {moved}" if moved else ""))
        return view

    def _not_a_block_file(self, cid: Cid, path: str, seen: os.stat_result) -> NoReturn:
        """Raise CorruptBlock for something other than a regular file at a block's path,
        after moving it aside (it is kept, in quarantine) so the block can be put again."""
        moved = self._quarantine_file(path, seen)
        kind = statmod.filemode(seen.st_mode)
        detail = f"not a regular file ({kind})" + (f"; moved to {moved}" if moved else "")
        raise CorruptBlock(cid, path, detail)

    def _quarantine_file(self, path: str, seen: os.stat_result) -> str | None:
        """Move a corrupt file aside unless it was replaced meanwhile; where it went, or None."""
        try:
            now = os.lstat(path)
            if (now.st_ino, now.st_dev) != (seen.st_ino, seen.st_dev):
                return None  # a writer replaced it with a fresh copy; leave that one alone
            os.makedirs(self._quarantine, exist_ok=True)
            target = os.path.join(
                self._quarantine, f"{os.path.basename(path)}.{secrets.token_hex(4)}"
            )
            os.replace(path, target)
            with contextlib.suppress(InvalidCid):
                self._inventory.removed(Cid.parse(os.path.basename(path)))
            moved = os.lstat(target)
            if (moved.st_ino, moved.st_dev) != (seen.st_ino, seen.st_dev):
                # A writer replaced the file between the check and the move: that fresh copy
                # goes back (os.link never overwrites a newer one), the quarantine keeps none.
                with contextlib.suppress(FileExistsError):
                    os.link(target, path)
                os.unlink(target)
                return None
        except OSError:
            return None
        return target

    def has(self, cid: Cid) -> bool:
        try:
            return statmod.S_ISREG(os.lstat(self.path_of(cid)).st_mode)
        except (OSError, ValueError):  # as os.path.isfile
            return False

    def _block_stat(self, cid: Cid, path: str) -> os.stat_result:
        """The block file's stat; BlockNotFound unless a regular file is there."""
        try:
            found = os.lstat(path)
        except FileNotFoundError:
            raise BlockNotFound(cid) from None
        except OSError as exc:
            raise StoreError(f"cannot stat block {cid} at {path}: {exc}") from exc
        if not statmod.S_ISREG(found.st_mode):
            raise BlockNotFound(cid)
        return found

    def age_of(self, cid: Cid) -> float:
        """Seconds since the block's file was written or touched (its modification time)."""
        mtime = self._block_stat(cid, self.path_of(cid)).st_mtime
        return max(0.0, time.time() - mtime)

    def touch(self, cids: Iterable[Cid]) -> None:
        """Set the modification time of the files of the blocks held among ``cids`` to now."""
        for cid in cids:
            self._touch_file(cid, self.path_of(cid))

    def _touch_file(self, cid: Cid, path: str) -> bool:
        """Set the file's modification time to now; False if there is no such file.

        Under the same lock as ``delete_if_older``, so the two never interleave. A touched
        block is no longer trusted as this store's own write (``trust_own_writes``): nothing
        proves the file was unchanged between the last check and the new time, so its next
        read re-hashes it.
        """
        try:
            self.fault_point("touch", path)  # outside the lock: it may delete the block
            with self._own_lock:
                self._own.pop(cid, None)
                os.utime(path, follow_symlinks=False)  # never a file outside the store
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StoreError(f"cannot touch block {cid} at {path}: {exc}") from exc
        return True

    def delete_if_older(self, cid: Cid, min_age: float) -> bool | None:
        path = self.path_of(cid)
        with self._own_lock:  # no touch between the age check and the unlink
            try:
                if time.time() - os.lstat(path).st_mtime < min_age:
                    return None
            except FileNotFoundError:
                self._inventory.removed(cid)
                return False
            except OSError as exc:
                raise StoreError(f"cannot stat block {cid} at {path}: {exc}") from exc
            return self._unlink(cid, path)

    def size_of(self, cid: Cid) -> int:
        return self._block_stat(cid, self.path_of(cid)).st_size

    def delete(self, cid: Cid) -> bool:
        with self._own_lock:
            return self._unlink(cid, self.path_of(cid))

    def _unlink(self, cid: Cid, path: str) -> bool:
        """Remove the block's file (the caller holds ``_own_lock``); False if it was not there."""
        self._own.pop(cid, None)
        try:
            os.unlink(path)
        except FileNotFoundError:
            self._inventory.removed(cid)  # gone meanwhile (another process): out of the account
            return False
        except OSError as exc:
            raise StoreError(f"cannot delete block {cid} at {path}: {exc}") from exc
        self._inventory.removed(cid)
        if self.fsync:
            fsync_dir(os.path.dirname(path))
        # The shard stays, empty or not: the next block in it needs no mkdir. A rescan
        # removes shards left empty for EMPTY_SHARD_AGE (``inventory``).
        return True

    # ── listing ──────────────────────────────────────────────────────────────
    def _scan(self, prune_before: float | None = None) -> Iterator[tuple[Cid, os.DirEntry[str]]]:
        """Every block file with its CID, shard by shard; temp and foreign files skipped.
        ``prune_before`` (a ``time.time()``): shards found empty and unchanged since then are
        removed (``rmdir`` removes only an empty directory: a block written into it meanwhile
        stays, and its writer makes a shard it finds gone again)."""
        for top in list_dir(self._blocks):
            if not is_shard(top):
                continue
            for sub in list_dir(top.path):
                if not is_shard(sub):
                    continue
                entries = list_dir(sub.path)
                if not entries and prune_before is not None:
                    with contextlib.suppress(OSError):
                        if sub.stat(follow_symlinks=False).st_mtime < prune_before:
                            os.rmdir(sub.path)
                for entry in entries:
                    if entry.name.startswith(".") or not entry.is_file(follow_symlinks=False):
                        continue
                    try:
                        cid = Cid.parse(entry.name)
                    except InvalidCid:
                        continue
                    if (f"{cid.digest[0]:02x}", f"{cid.digest[1]:02x}") == (top.name, sub.name):
                        yield cid, entry
        self.fault_point("walked", self._blocks)

    def fault_point(self, point: str, path: str) -> None:
        """A seam for fault injection and observability; does nothing here.

        Called at these points, so that a subclass (or a test patching the method on one
        store) can fail the operation with an ``OSError`` (a full disk), change the file
        system there (a concurrent delete), or count and record what the store does:

        - ``"write"``: before a file is written at ``path`` (a block, or ``FORMAT``);
        - ``"touch"``: before the modification time of the file at ``path`` is set (a
          ``touch``, or a put of a block already held);
        - ``"walked"``: after a walk of the shards (a listing, ``size``, a rescan by
          ``inventory``) has listed every block file, before the walk's result is used;
          ``path`` is the blocks directory.
        """

    def __iter__(self) -> Iterator[Cid]:
        """A live scan of the shards: blocks added or removed meanwhile may or may not appear."""
        return (cid for cid, _ in self._scan())

    def inventory(self, *, rescan: bool = False) -> list[Cid]:
        """The blocks this store object knows it holds: what its last rescan found, plus what
        it has put since, less what it has deleted (``store._inventory``). Without walking the
        shards, so its cost follows the blocks; but blocks other processes (or other store
        objects on the same directory) put since the last rescan are missing, and ones they
        deleted may be listed. ``rescan=True``, and the first call, walk the shards instead,
        removing those left empty for ``EMPTY_SHARD_AGE`` seconds."""
        if not rescan:
            known = self._inventory.snapshot()
            if known is not None:
                return known
        prune_before = time.time() - EMPTY_SHARD_AGE
        return self._inventory.rescan(lambda: (cid for cid, _ in self._scan(prune_before)))

    def size(self) -> StoreSize:
        """Counted by scanning the directory tree (cost grows with the number of blocks)."""
        blocks = nbytes = 0
        for _, entry in self._scan():
            try:
                nbytes += entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue
            blocks += 1
        return StoreSize(blocks, nbytes)

    def temp_files(self) -> list[str]:
        """Paths of temp files left in the shards (writes in progress or abandoned by a crash)."""
        found: list[str] = []
        for top in list_dir(self._blocks):
            if is_shard(top):
                for sub in list_dir(top.path):
                    if is_shard(sub):
                        found.extend(
                            e.path
                            for e in list_dir(sub.path)
                            if e.name.startswith(".")
                            and e.name.endswith(_TMP_SUFFIX)
                            and not e.is_dir(follow_symlinks=False)  # the store writes files
                        )
        return found

    def sync(self) -> None:
        """Flush every block written so far to disk: ``syncfs(2)`` on the store's file
        system (Linux), ``os.sync()`` elsewhere. One call covers any number of blocks, so
        a caller that must have blocks on disk before it records them (a coordinator's
        group commit with ``sync_blocks``) pays once per batch, not once per block."""
        try:
            fd = os.open(self._blocks, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise StoreError(f"cannot open {self._blocks} to sync it: {exc}") from exc
        try:
            if syncfs is None or syncfs(fd) != 0:
                os.sync()
        finally:
            os.close(fd)

    def remove_temp_files(self, older_than: float = 3600.0) -> int:
        """Delete temp files last modified more than ``older_than`` seconds ago; how many.

        The age limit spares writes still in progress in other threads or processes.
        """
        removed = 0
        limit = time.time() - older_than
        for path in self.temp_files():
            try:
                if os.lstat(path).st_mtime <= limit:
                    os.unlink(path)
                    removed += 1
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise StoreError(f"cannot remove temp file {path}: {exc}") from exc
        return removed

    def __repr__(self) -> str:
        return f"DirectoryStore({str(self.root)!r}, fsync={self.fsync})"


def _read_format(path: Path) -> bytes | str:
    """The FORMAT file's first bytes (one past the line at most), or what it is instead: it
    may be anything (a FIFO must not make the store wait, a huge file must not be read)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not statmod.S_ISREG(mode):
            return f"a {statmod.filemode(mode)} entry"
        return os.read(fd, len(FORMAT_LINE) + 1)
    finally:
        os.close(fd)
