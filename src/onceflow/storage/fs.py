"""The file system the storage layer runs on, as an object that can be replaced.

Everything the storage and core layers do to disk goes through a :class:`FileSystem`: the server
uses :class:`OsFileSystem`; the deterministic simulator (``onceflow sim``) substitutes a disk that
models the page cache, power loss and failing writes. The interface is what a crash-safe log needs
and no more: positional reads and writes, explicit syncs of files and of directories, atomic
renames, and whole-file replacement.

Open files are bounded. A :class:`File` is a handle, not a descriptor: :class:`OsFileSystem` opens
the descriptor when the handle is used and keeps at most ``max_open`` descriptors open, closing the
least recently used idle one when it needs another. A descriptor is *pinned* for the duration of
each operation (which may run in a worker thread), so it is never closed under a read, a write or a
sync. So the number of streams a server holds is not bounded by the process's open-file limit, and
a restart opens the data directory whatever the stream count. (A durable write followed by a close
and a reopen loses nothing: syncs are explicit, and ``fdatasync`` before a close is what makes data
durable, never the close itself.)
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from .._files import fsync_dir, replace_file
from ..errors import OnceflowError

__all__ = ["DEFAULT_MAX_OPEN", "File", "FileSystem", "OsFileSystem", "OutcomeUnknown", "raise_open_file_limit"]

DEFAULT_MAX_OPEN = 512


class OutcomeUnknown(OnceflowError, OSError):
    """A write whose outcome could not be learned: it may be durable or not (a store whose answer to
    a commit was lost, and that could not read back what happened before it had to give up). Every
    other ``OSError`` of a write means it did not happen. A caller must never answer this as "not
    stored": the data may be served later. A file system that raised it refuses every later write
    (its holder's memory may disagree with what is stored): the server must stop serving from it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="outcome_unknown")
        self.errno = errno.EIO
        self.strerror = message


class File(Protocol):
    """An open file of a :class:`FileSystem`. Every method may raise ``OSError``; a write is
    durable only after :meth:`sync`.

    A file whose reads may wait for a network (the PostgreSQL store's ``PgFile``) may also have
    ``async def apread(n, at) -> bytes``: what :meth:`pread` returns, awaited by an event loop that
    serves others meanwhile (``StreamLog.aread``); files without it are read with :meth:`pread`."""

    @property
    def path(self) -> Path: ...
    def size(self) -> int: ...
    def pwrite(self, data: bytes, at: int) -> None: ...  # all of ``data``, at byte ``at``
    def pread(self, n: int, at: int) -> bytes: ...
    def sync(self) -> None: ...  # the data (fdatasync)
    def truncate(self, size: int) -> None: ...
    def close(self) -> None: ...


class FileSystem(Protocol):
    """What the storage layer does to disk. Every method may raise ``OSError``.

    Durability: the creation, renaming or removal of a directory entry is durable only after
    :meth:`sync_dir` of its directory (``replace_file`` does that itself unless told not to)."""

    def open_file(self, path: Path, *, create: bool) -> File: ...
    def listdir(self, path: Path) -> list[str]: ...
    def mkdir(self, path: Path) -> None: ...  # parents too; an existing directory is fine
    def exists(self, path: Path) -> bool: ...
    def unlink(self, path: Path) -> None: ...  # a missing file is fine
    def rename(self, src: Path, dst: Path) -> None: ...  # replaces dst
    def rmtree(self, path: Path) -> None: ...  # best effort, errors ignored
    def sync_dir(self, path: Path) -> None: ...
    def read_bytes(self, path: Path) -> bytes: ...  # FileNotFoundError when missing
    def replace_file(
        self, path: Path, data: bytes, *, sync: bool = True, sync_dir: bool = True, mode: int = 0o666
    ) -> None: ...


class _OsFile:
    """A file of :class:`OsFileSystem`: its descriptor comes and goes (see the module docstring)."""

    __slots__ = ("_fs", "closed", "fd", "path", "pins")

    def __init__(self, fs: OsFileSystem, path: Path) -> None:
        self._fs = fs
        self.path = path
        self.fd = -1
        self.pins = 0
        self.closed = False

    def __repr__(self) -> str:
        return f"<file {self.path} fd={self.fd}>"

    def size(self) -> int:
        with self._fs.pinned(self) as fd:
            return os.fstat(fd).st_size

    def pwrite(self, data: bytes, at: int) -> None:
        with self._fs.pinned(self) as fd:
            view = memoryview(data)
            while view:
                n = os.pwrite(fd, view, at)
                view = view[n:]
                at += n

    def pread(self, n: int, at: int) -> bytes:
        with self._fs.pinned(self) as fd:
            return os.pread(fd, n, at)

    def sync(self) -> None:
        with self._fs.pinned(self) as fd:
            os.fdatasync(fd)

    def truncate(self, size: int) -> None:
        with self._fs.pinned(self) as fd:
            os.ftruncate(fd, size)

    def close(self) -> None:
        self._fs.release(self)


class OsFileSystem:
    """The real file system, with at most ``max_open`` file descriptors open at once (see the
    module docstring). Thread-safe: reads and writes run in worker threads."""

    def __init__(self, max_open: int = DEFAULT_MAX_OPEN) -> None:
        if max_open < 2:
            raise ValueError("max_open must be at least 2")
        self.max_open = max_open
        self._open: OrderedDict[_OsFile, None] = OrderedDict()  # files with a descriptor, LRU first
        self._lock = threading.Lock()
        self.reopened = 0  # descriptors opened again after being closed to stay under max_open

    @property
    def open_count(self) -> int:
        return len(self._open)

    # ------------------------------------------------------------------ descriptors

    @contextlib.contextmanager
    def pinned(self, f: _OsFile) -> Iterator[int]:
        """The descriptor of ``f``, opened if need be and kept open until the block ends."""
        with self._lock:
            if f.closed:
                raise OSError(errno.EBADF, "file handle is closed", str(f.path))
            if f.fd < 0:
                self._make_room()
                f.fd = os.open(f.path, os.O_RDWR)
                self.reopened += 1
            f.pins += 1
            self._open[f] = None
            self._open.move_to_end(f)
        try:
            yield f.fd
        finally:
            with self._lock:
                f.pins -= 1
                fd = -1
                if f.closed and f.pins == 0:  # closed while in use: the last user closes it
                    fd, f.fd = f.fd, -1
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _make_room(self) -> None:
        """Close least recently used idle descriptors until one more fits (the lock is held)."""
        if len(self._open) < self.max_open:
            return
        for victim in list(self._open):
            if victim.pins == 0:
                del self._open[victim]
                with contextlib.suppress(OSError):
                    os.close(victim.fd)
                victim.fd = -1
                if len(self._open) < self.max_open:
                    return
        # every descriptor is in use: go over the bound rather than fail an operation

    def release(self, f: _OsFile) -> None:
        with self._lock:
            f.closed = True
            self._open.pop(f, None)
            if f.pins:
                return  # in use by another thread: the last user closes it
            fd, f.fd = f.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def open_file(self, path: Path, *, create: bool) -> File:
        f = _OsFile(self, path)
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        with self._lock:
            self._make_room()
            f.fd = os.open(path, flags, 0o644)
            self._open[f] = None
        return f

    # ------------------------------------------------------------------ directories and whole files

    def listdir(self, path: Path) -> list[str]:
        return os.listdir(path)

    def mkdir(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)

    def exists(self, path: Path) -> bool:
        return path.exists()

    def unlink(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def rename(self, src: Path, dst: Path) -> None:
        os.replace(src, dst)

    def rmtree(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def sync_dir(self, path: Path) -> None:
        fsync_dir(path)

    def read_bytes(self, path: Path) -> bytes:
        return path.read_bytes()

    def replace_file(
        self, path: Path, data: bytes, *, sync: bool = True, sync_dir: bool = True, mode: int = 0o666
    ) -> None:
        replace_file(path, data, sync=sync, sync_dir=sync_dir, mode=mode)


def raise_open_file_limit() -> tuple[int, int]:
    """Raise this process's soft limit on open files to its hard limit (as far as allowed);
    returns the (soft, hard) limits in force afterwards. A server holds a descriptor per
    connection and a bounded number per stream log, so the common soft default of 1,024 is low."""
    try:
        import resource
    except ImportError:  # not on this platform
        return (-1, -1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft, hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        return soft, hard
    return want, hard
