"""What the log tells of its I/O (the seam /metrics reads: ``IoEvents``), and a failed snapshot or
segment roll on the write path, which fails the group like a failed write and leaves the log's
writer going."""

from __future__ import annotations

import asyncio
import errno
import threading
from pathlib import Path
from typing import Literal

import pytest

import onceflow.storage.log as storage_log
from onceflow.storage.fs import File
from onceflow.storage.log import IoEvents, StreamLog
from onceflow.storage.position import Position

pytestmark = pytest.mark.anyio
ZERO = Position(0, 0)


def _no_space(*_args: object, **_kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


async def test_a_snapshot_that_fails_on_the_write_path_fails_the_group_and_the_log_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = StreamLog.open(tmp_path / "s", ZERO, policy="always", snapshot_bytes=1)
    try:
        await log.stage(count=1, payload=b"a").done  # the next group is due for a snapshot
        monkeypatch.setattr(log.fs, "replace_file", _no_space)
        staged = log.stage(count=1, payload=b"b")
        await log.drain()
        assert staged.done.done(), "the append waits forever: the log's writer stopped"
        assert isinstance(staged.done.exception(), OSError)
        assert log.pending == log.durable  # rolled back, as after a failed write
        monkeypatch.undo()
        again = log.stage(count=1, payload=b"b")
        await again.done
        assert [b.payload for b in log.read(ZERO, 1 << 20)] == [b"a", b"b"]
    finally:
        await log.close()


async def test_a_segment_roll_that_fails_fails_the_group_and_the_log_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = StreamLog.open(tmp_path / "s", ZERO, policy="always", segment_bytes=1)
    try:
        await log.stage(count=1, payload=b"a").done  # the segment is full: the next group rolls
        monkeypatch.setattr(log.fs, "open_file", _no_space)
        staged = log.stage(count=1, payload=b"b")
        await log.drain()
        assert staged.done.done(), "the append waits forever: the log's writer stopped"
        assert isinstance(staged.done.exception(), OSError)
        monkeypatch.undo()
        await log.stage(count=1, payload=b"b").done
        assert [b.payload for b in log.read(ZERO, 1 << 20)] == [b"a", b"b"]
    finally:
        await log.close()
    reopened = StreamLog.open(tmp_path / "s", ZERO)
    try:
        assert [b.payload for b in reopened.read(ZERO, 1 << 20)] == [b"a", b"b"]
    finally:
        await reopened.close()


class Seen:
    """An IoObserver that keeps what it is told."""

    def __init__(self) -> None:
        self.written: list[tuple[int, int, float | None]] = []
        self.synced: list[float] = []
        self.failed: list[str] = []


class Observer:
    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    def written(self, batches: int, nbytes: int, sync_seconds: float | None) -> None:
        self.seen.written.append((batches, nbytes, sync_seconds))

    def synced(self, seconds: float) -> None:
        self.seen.synced.append(seconds)

    def failed(self, op: str) -> None:
        self.seen.failed.append(op)


def observed(tmp_path: Path, policy: Literal["always", "interval", "never"]) -> tuple[StreamLog, Seen]:
    io, seen = IoEvents(), Seen()
    io.add(Observer(seen))
    return StreamLog.open(tmp_path / "s", ZERO, policy=policy, io=io), seen


async def test_a_group_is_told_with_its_batches_bytes_and_sync_time(tmp_path: Path) -> None:
    log, seen = observed(tmp_path, "always")
    try:
        staged = [log.stage(count=1, payload=b"x" * n) for n in (10, 20, 30)]  # one group: nothing awaited
        for s in staged:
            await s.done
        assert len(seen.written) == 1
        batches, nbytes, took = seen.written[0]
        assert batches == 3
        assert nbytes == log.durable.end.pos  # every byte of the three framed batches
        assert took is not None and took >= 0
        await log.stage(count=1, payload=b"y").done
        assert [w[0] for w in seen.written] == [3, 1]
        assert seen.failed == []
    finally:
        await log.close()


async def test_without_a_sync_per_group_the_interval_sync_is_told(tmp_path: Path) -> None:
    log, seen = observed(tmp_path, "interval")
    try:
        await log.stage(count=1, payload=b"x").done
        assert seen.written[0][2] is None  # written, not synced
        await log.sync()
        assert len(seen.synced) == 1 and seen.synced[0] >= 0
    finally:
        await log.close()


async def test_failures_are_told_by_operation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log, seen = observed(tmp_path, "interval")
    try:
        await log.stage(count=1, payload=b"x").done
        monkeypatch.setattr(storage_log, "_write_all", _no_space)
        staged = log.stage(count=1, payload=b"y")
        with pytest.raises(OSError):
            await staged.done
        monkeypatch.setattr(storage_log, "_timed_sync", _no_space)
        with pytest.raises(OSError):
            await log.sync()
        assert seen.failed == ["write", "sync"]
        monkeypatch.undo()
    finally:
        await log.close()
    fresh = StreamLog.open(tmp_path / "t", ZERO, io=log.io)
    try:
        real = fresh._segments[-1].file
        fresh._segments[-1].file = FullFile(real)
        with pytest.raises(OSError):
            fresh.write_initial([(b"z", 1, 0)])
        assert seen.failed == ["write", "sync", "create"]
        fresh._segments[-1].file = real
    finally:
        monkeypatch.undo()
        await fresh.close()


class FullFile:
    """A segment file on a full disk: writes fail, the rest is the real file's."""

    def __init__(self, real: File) -> None:
        self.real = real

    @property
    def path(self) -> Path:
        return self.real.path

    def size(self) -> int:
        return self.real.size()

    def pwrite(self, data: bytes, at: int) -> None:
        _no_space()

    def pread(self, n: int, at: int) -> bytes:
        return self.real.pread(n, at)

    def sync(self) -> None:
        self.real.sync()

    def truncate(self, size: int) -> None:
        self.real.truncate(size)

    def close(self) -> None:
        self.real.close()


async def test_an_observer_that_raises_does_not_stop_the_log(tmp_path: Path) -> None:
    """A broken observer (a metrics bug) must not leave a written group uncommitted: its
    appends are answered and the log goes on; the error is only logged."""

    class Broken:
        def written(self, batches: int, nbytes: int, sync_seconds: float | None) -> None:
            raise RuntimeError("observer bug")

        def synced(self, seconds: float) -> None:
            raise RuntimeError("observer bug")

        def failed(self, op: str) -> None:
            raise RuntimeError("observer bug")

    io, seen = IoEvents(), Seen()
    io.add(Broken())
    io.add(Observer(seen))
    log = StreamLog.open(tmp_path / "s", ZERO, policy="always", io=io)
    try:
        for n in range(3):
            await log.stage(count=1, payload=b"z" * (n + 1)).done  # each one answered
        assert len(seen.written) == 3  # the observers after the broken one are still told
        assert [b.payload for b in log.read(ZERO, 1 << 20)] == [b"z", b"zz", b"zzz"]
    finally:
        await log.close()


async def test_an_append_staged_before_its_stream_was_deleted_is_answered(tmp_path: Path) -> None:
    """Found by the cluster simulator (seed 115179): a DELETE handled after an append was staged
    and before the log's writer took it released the log's files (``close_files``); the writer then
    stopped on the missing segment and the append was never answered. Its request waited until
    the server process ended. It fails now, as after a failed write."""
    log = StreamLog.open(tmp_path / "s", ZERO, policy="always")
    staged = log.stage(count=1, payload=b"a")
    log.close_files()  # the stream's delete, before the writer ran
    await log.drain()
    assert staged.done.done(), "the append waits forever: the log's writer stopped"
    assert isinstance(staged.done.exception(), OSError)


async def test_an_append_whose_write_the_delete_cut_short_is_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same delete while the group's write waits in the worker thread: the write fails on the
    closed file, and the failure, which looked for the segment to cut back, stopped the writer too."""
    log = StreamLog.open(tmp_path / "s", ZERO, policy="always")
    entered, go = threading.Event(), threading.Event()
    write_all = storage_log._write_all

    def held(f: File, data: bytes, at: int, sync: bool) -> float | None:
        entered.set()
        go.wait(5)
        return write_all(f, data, at, sync)

    monkeypatch.setattr(storage_log, "_write_all", held)
    staged = log.stage(count=1, payload=b"a")
    assert await asyncio.get_running_loop().run_in_executor(None, entered.wait, 5)
    log.close_files()  # the stream's delete, while the writer's thread holds the group
    go.set()
    await log.drain()
    assert staged.done.done(), "the append waits forever: the log's writer stopped"
    assert isinstance(staged.done.exception(), OSError)
