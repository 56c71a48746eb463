"""A simulated disk with a page cache: what survives a crash, and what a power loss takes.

The model (POSIX as the careful databases read it, in the manner of the ALICE study):

- A write goes to the page cache: every reader sees it at once, but it is *durable* only after a
  sync of its file. A truncate is the same.
- A directory entry (a file or directory created, renamed or removed) is durable only after a sync
  of its directory. Syncing a file does not make its name durable.
- A process crash (``kill -9``) loses nothing that reached the page cache.
- A power loss keeps, for every file, what was synced plus a prefix of the later writes, the last
  of which may be torn at a sector boundary; for every directory, what was synced plus a prefix of
  the later changes of its entries. Files whose names did not survive are gone.
- Faults: a write can fail with ``ENOSPC`` after part of it reached the cache, a sync with ``EIO``;
  after a failed sync, the writes it was to make durable are never made durable (Linux drops them:
  "fsyncgate"), though the cache still shows them.

A :class:`SimDisk` is the disk; :meth:`SimDisk.mount` gives the :class:`FileSystem` one process sees.
A process that crashed keeps its old mount, whose every operation then fails: a dead process does
nothing to the disk.
"""

from __future__ import annotations

import errno
import random
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

__all__ = ["DiskFaults", "SimDisk", "SimFileSystem"]

SECTOR = 512


@dataclass(slots=True, eq=False)
class _Inode:
    data: bytearray = field(default_factory=bytearray)  # the page cache: what reads see
    durable: bytearray = field(default_factory=bytearray)  # what a power loss keeps for sure
    pending: list[tuple[int, bytes] | tuple[int, None]] = field(
        default_factory=list
    )  # (at, bytes) or (size, None): truncate


@dataclass(slots=True, eq=False)
class _Dir:
    entries: dict[str, _Inode | _Dir] = field(default_factory=dict)
    durable: dict[str, _Inode | _Dir] = field(default_factory=dict)
    pending: list[tuple[str, _Inode | _Dir | None]] = field(
        default_factory=list
    )  # (name, node) or (name, None): removed

    def link(self, name: str, node: _Inode | _Dir | None) -> None:
        if node is None:
            self.entries.pop(name, None)
        else:
            self.entries[name] = node
        self.pending.append((name, node))

    def sync(self) -> None:
        self.durable = dict(self.entries)
        self.pending.clear()


@dataclass(slots=True)
class DiskFaults:
    """Probabilities of failing operations, changed by the simulation while it runs."""

    write_enospc: float = 0.0
    sync_eio: float = 0.0
    meta_enospc: float = 0.0  # creating files and directories, renames


class SimDisk:
    """The disk (see the module docstring); ``rng`` decides faults and what a power loss keeps."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.root = _Dir()
        self.root.sync()
        self.faults = DiskFaults()
        self.generation = 0  # bumped by every crash: mounts of earlier generations are dead
        self.stats = {"writes": 0, "syncs": 0, "failed_writes": 0, "failed_syncs": 0, "power_losses": 0, "torn": 0}

    def mount(self) -> SimFileSystem:
        return SimFileSystem(self, self.generation)

    def crash(self) -> None:
        """The process using the disk died (``kill -9``): the page cache survives."""
        self.generation += 1

    def power_loss(self) -> None:
        """The machine lost power: keep what is durable, a prefix of the rest, maybe a torn write."""
        self.generation += 1
        self.stats["power_losses"] += 1
        self._settle_dir(self.root)

    def _settle_dir(self, d: _Dir) -> None:
        keep = self.rng.randint(0, len(d.pending))
        entries = dict(d.durable)
        for name, node in d.pending[:keep]:
            if node is None:
                entries.pop(name, None)
            else:
                entries[name] = node
        d.entries = entries
        d.sync()
        for node in entries.values():
            if isinstance(node, _Dir):
                self._settle_dir(node)
            else:
                self._settle_file(node)

    def _settle_file(self, f: _Inode) -> None:
        data = bytearray(f.durable)
        keep = self.rng.randint(0, len(f.pending))
        kept = f.pending[:keep]
        if kept and kept[-1][1] is not None and len(kept[-1][1] or b"") > SECTOR and self.rng.random() < 0.5:
            # the last write kept is torn: only its first sectors reached the platter
            at, chunk = kept[-1]
            assert chunk is not None
            cut = (at // SECTOR + 1) * SECTOR - at + SECTOR * self.rng.randint(0, len(chunk) // SECTOR)
            kept = [*kept[:-1], (at, chunk[: max(0, min(len(chunk), cut))])]
            self.stats["torn"] += 1
        _apply(data, kept)
        f.data = data
        f.durable = bytearray(data)
        f.pending.clear()


def _apply(data: bytearray, ops: list[tuple[int, bytes] | tuple[int, None]]) -> None:
    """Replay writes ``(at, bytes)`` and truncates ``(size, None)`` onto ``data``."""
    for at, chunk in ops:
        if chunk is None:
            del data[at:]
            continue
        if len(data) < at:
            data.extend(b"\0" * (at - len(data)))
        data[at : at + len(chunk)] = chunk


class _SimFile:
    __slots__ = ("_closed", "_fs", "inode", "path")

    def __init__(self, fs: SimFileSystem, inode: _Inode, path: Path) -> None:
        self._fs = fs
        self.inode = inode
        self.path = path
        self._closed = False

    def _check(self) -> _Inode:
        self._fs.alive()
        if self._closed:
            raise OSError(errno.EBADF, "file is closed", str(self.path))
        return self.inode

    def size(self) -> int:
        return len(self._check().data)

    def pwrite(self, data: bytes, at: int) -> None:
        f = self._check()
        disk = self._fs.disk
        disk.stats["writes"] += 1
        chunk = bytes(data)
        failed = disk.faults.write_enospc and disk.rng.random() < disk.faults.write_enospc
        if failed:
            chunk = chunk[: disk.rng.randint(0, len(chunk))]  # part of it may reach the cache
        if len(f.data) < at:
            f.data.extend(b"\0" * (at - len(f.data)))
        f.data[at : at + len(chunk)] = chunk
        f.pending.append((at, chunk))
        if failed:
            disk.stats["failed_writes"] += 1
            raise OSError(errno.ENOSPC, "No space left on device (simulated)", str(self.path))

    def pread(self, n: int, at: int) -> bytes:
        return bytes(self._check().data[at : at + n])

    def sync(self) -> None:
        f = self._check()
        disk = self._fs.disk
        disk.stats["syncs"] += 1
        if disk.faults.sync_eio and disk.rng.random() < disk.faults.sync_eio:
            disk.stats["failed_syncs"] += 1
            f.pending.clear()  # those writes will never be made durable; the cache still has them
            raise OSError(errno.EIO, "Input/output error (simulated)", str(self.path))
        _apply(f.durable, f.pending)  # what reached the platter: the writes since the last sync
        f.pending.clear()

    def truncate(self, size: int) -> None:
        f = self._check()
        del f.data[size:]
        f.pending.append((size, None))

    def close(self) -> None:
        self._closed = True


class SimFileSystem:
    """The :class:`~onceflow.storage.fs.FileSystem` of one process on a :class:`SimDisk`."""

    def __init__(self, disk: SimDisk, generation: int) -> None:
        self.disk = disk
        self.generation = generation

    def alive(self) -> None:
        if self.generation != self.disk.generation:
            raise OSError(errno.EIO, "the process that mounted this disk is dead")

    # ------------------------------------------------------------------ names

    @staticmethod
    def _parts(path: Path) -> tuple[str, ...]:
        return PurePosixPath(path).parts[1:] if PurePosixPath(path).is_absolute() else PurePosixPath(path).parts

    def _walk(self, path: Path) -> _Dir | _Inode | None:
        node: _Dir | _Inode = self.disk.root
        for part in self._parts(path):
            if not isinstance(node, _Dir):
                return None
            nxt = node.entries.get(part)
            if nxt is None:
                return None
            node = nxt
        return node

    def _parent(self, path: Path) -> tuple[_Dir, str]:
        parts = self._parts(path)
        parent = self._walk(Path("/", *parts[:-1]))
        if not isinstance(parent, _Dir):
            raise FileNotFoundError(errno.ENOENT, "No such directory", str(Path(path).parent))
        return parent, parts[-1]

    def _meta_fault(self, path: Path) -> None:
        faults = self.disk.faults
        if faults.meta_enospc and self.disk.rng.random() < faults.meta_enospc:
            raise OSError(errno.ENOSPC, "No space left on device (simulated)", str(path))

    # ------------------------------------------------------------------ the FileSystem interface

    def open_file(self, path: Path, *, create: bool) -> _SimFile:
        self.alive()
        node = self._walk(path)
        if isinstance(node, _Dir):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        if node is None:
            if not create:
                raise FileNotFoundError(errno.ENOENT, "No such file", str(path))
            self._meta_fault(path)
            parent, name = self._parent(path)
            node = _Inode()
            parent.link(name, node)
        return _SimFile(self, node, Path(path))

    def listdir(self, path: Path) -> list[str]:
        self.alive()
        node = self._walk(path)
        if not isinstance(node, _Dir):
            raise FileNotFoundError(errno.ENOENT, "No such directory", str(path))
        return list(node.entries)

    def mkdir(self, path: Path) -> None:
        self.alive()
        node: _Dir | _Inode = self.disk.root
        for part in self._parts(path):
            if not isinstance(node, _Dir):
                raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(path))
            nxt = node.entries.get(part)
            if nxt is None:
                self._meta_fault(path)
                nxt = _Dir()
                node.link(part, nxt)
            node = nxt
        if not isinstance(node, _Dir):
            raise FileExistsError(errno.EEXIST, "File exists", str(path))

    def exists(self, path: Path) -> bool:
        self.alive()
        return self._walk(path) is not None

    def unlink(self, path: Path) -> None:
        self.alive()
        node = self._walk(path)
        if node is None:
            return
        if isinstance(node, _Dir):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        parent, name = self._parent(path)
        parent.link(name, None)

    def rename(self, src: Path, dst: Path) -> None:
        self.alive()
        node = self._walk(src)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(src))
        self._meta_fault(dst)
        sparent, sname = self._parent(src)
        dparent, dname = self._parent(dst)
        if isinstance(dparent.entries.get(dname), _Dir) and dparent.entries[dname] is not node:
            target = dparent.entries[dname]
            assert isinstance(target, _Dir)
            if target.entries:
                raise OSError(errno.ENOTEMPTY, "Directory not empty", str(dst))
        sparent.link(sname, None)
        dparent.link(dname, node)

    def rmtree(self, path: Path) -> None:
        if self.generation != self.disk.generation:
            return
        node = self._walk(path)
        if node is None:
            return
        parent, name = self._parent(path)
        parent.link(name, None)

    def sync_dir(self, path: Path) -> None:
        self.alive()
        node = self._walk(path)
        if not isinstance(node, _Dir):
            raise FileNotFoundError(errno.ENOENT, "No such directory", str(path))
        node.sync()

    def read_bytes(self, path: Path) -> bytes:
        self.alive()
        node = self._walk(path)
        if node is None:
            raise FileNotFoundError(errno.ENOENT, "No such file", str(path))
        if isinstance(node, _Dir):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        return bytes(node.data)

    def replace_file(
        self, path: Path, data: bytes, *, sync: bool = True, sync_dir: bool = True, mode: int = 0o666
    ) -> None:
        tmp = Path(path).with_name(Path(path).name + ".tmp")
        f = self.open_file(tmp, create=True)
        try:
            f.truncate(0)
            f.pwrite(data, 0)
            if sync:
                f.sync()
        finally:
            f.close()
        self.rename(tmp, path)
        if sync and sync_dir:
            self.sync_dir(Path(path).parent)
