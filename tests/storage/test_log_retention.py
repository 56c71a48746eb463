"""Retention in the storage layer: whole segments deleted oldest first, by size or by age, never
past what the caller keeps; what reads, reopens and producers see afterwards."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import pytest

from helpers.logkit import ZERO, append_each, producer_specs, seg_files
from onceflow.storage.fs import OsFileSystem
from onceflow.storage.log import SNAPSHOT_NAME, OffsetGone, StreamLog
from onceflow.storage.position import Position

FAR = Position(1 << 60, 1 << 60)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def test_size_retention_deletes_whole_oldest_segments_and_reads_say_what_is_gone(tmp_path: Path) -> None:
    async def go() -> None:
        log = StreamLog.open(tmp_path, ZERO, segment_bytes=500)
        written = await append_each(log, producer_specs("p", 60, size=40))
        segs = seg_files(tmp_path)
        assert len(segs) >= 5
        total = sum(p.stat().st_size for p in segs)
        n = log.deletable(now_ms=0, max_age_ms=None, max_bytes=total // 2, keep_from=FAR)
        assert 0 < n < len(segs)
        freed = await log.delete_oldest(n)
        left = seg_files(tmp_path)
        assert len(left) == len(segs) - n and freed == total - sum(p.stat().st_size for p in left)
        assert sum(p.stat().st_size for p in left) >= total // 2  # at least max_bytes is kept
        first = log.first
        assert first.pos > 0 and any(w.start == first for w in written)
        with pytest.raises(OffsetGone) as gone:
            log.read(ZERO, 1 << 20)
        assert gone.value.earliest == first and first.token() in str(gone.value)
        with pytest.raises(OffsetGone):
            log.check_position(written[1].start)
        kept = [w for w in written if w.start.pos >= first.pos]
        assert [b.start for b in log.read(first, 1 << 30)] == [w.start for w in kept]
        # nothing more goes while the log holds no more than asked, and never the segment being written
        assert log.deletable(now_ms=0, max_age_ms=None, max_bytes=total // 2, keep_from=FAR) == 0
        every = log.deletable(now_ms=0, max_age_ms=None, max_bytes=0, keep_from=FAR)
        assert every == len(left) - 1
        await log.close()

    asyncio.run(go())


@pytest.mark.parametrize("clean_close", [True, False])
def test_after_a_reopen_the_log_starts_where_retention_left_it_and_remembers_its_producers(
    tmp_path: Path, clean_close: bool
) -> None:
    """A producer whose batches were all deleted is still known after a restart: a retry of its
    last sequence is a duplicate, not new data appended twice."""

    async def go() -> None:
        log = StreamLog.open(tmp_path, ZERO, segment_bytes=500)
        await append_each(log, producer_specs("old", 20, size=40))
        await append_each(log, producer_specs("new", 20, size=40))
        n = log.deletable(now_ms=0, max_age_ms=None, max_bytes=0, keep_from=FAR)
        await log.delete_oldest(n)
        first, end = log.first, log.durable.end
        assert not any(b.header.producer_id == "old" for b in log.read(first, 1 << 30))
        if clean_close:
            await log.close()
        else:
            await log.drain()
            log.close_files()  # as kill -9 leaves it
        again = StreamLog.open(tmp_path, ZERO, segment_bytes=500)
        assert again.first == first and again.durable.end == end
        old = again.producer("old")
        assert old is not None and old.last_seq == 19
        with pytest.raises(OffsetGone):
            again.read(ZERO, 100)
        await again.close()

    asyncio.run(go())


def test_age_retention_deletes_a_segment_once_everything_in_it_is_older(tmp_path: Path) -> None:
    clock = Clock()

    async def go() -> None:
        log = StreamLog.open(tmp_path, ZERO, segment_bytes=500, clock=clock)
        await append_each(log, producer_specs("p", 30, size=40))  # at t=1000 s
        clock.now = 2_000.0
        await append_each(log, producer_specs("p", 30, size=40, seq0=30))  # at t=2000 s
        day = 3_600_000
        # an hour after the first appends nothing is an hour old yet: the next segment's first batch
        # (appended after all of a segment) is what dates it
        assert log.deletable(now_ms=1_000_000 + 10_000, max_age_ms=day, max_bytes=None, keep_from=FAR) == 0
        n = log.deletable(now_ms=1_000_000 + day + 1, max_age_ms=day, max_bytes=None, keep_from=FAR)
        assert n > 0
        await log.delete_oldest(n)
        got = log.read(log.first, 1 << 30)
        assert got[0].header.timestamp <= 1_000_000  # some of the old ones stay: their segment is not all old
        # once everything is a day older than the last appends, all but the segment being written goes
        n = log.deletable(now_ms=2_000_000 + day + 1, max_age_ms=day, max_bytes=None, keep_from=FAR)
        assert n == len(seg_files(tmp_path)) - 1
        await log.close()

    asyncio.run(go())


def test_retention_deletes_nothing_that_ends_past_what_the_caller_keeps(tmp_path: Path) -> None:
    async def go() -> None:
        log = StreamLog.open(tmp_path, ZERO, segment_bytes=500)
        written = await append_each(log, producer_specs("p", 60, size=40))
        keep = written[25].start
        n = log.deletable(now_ms=0, max_age_ms=None, max_bytes=0, keep_from=keep)
        await log.delete_oldest(n)
        assert log.first.pos <= keep.pos
        assert [b.start for b in log.read(keep, 1 << 30)] == [w.start for w in written[25:]]
        assert log.deletable(now_ms=0, max_age_ms=None, max_bytes=0, keep_from=keep) == 0
        await log.close()

    asyncio.run(go())


class _SnapshotFailsOnce(OsFileSystem):
    """The real disk, but once ``armed`` the next write of a snapshot fails (a full disk)."""

    armed = False
    failed = False

    def replace_file(
        self, path: Path, data: bytes, *, sync: bool = True, sync_dir: bool = True, mode: int = 0o666
    ) -> None:
        if self.armed:
            self.armed, self.failed = False, True
            raise OSError(errno.ENOSPC, "no space left on device (injected)", str(path))
        super().replace_file(path, data, sync=sync, sync_dir=sync_dir, mode=mode)


def test_a_roll_whose_snapshot_cannot_be_written_fails_its_appends_and_loses_nothing_acknowledged(
    tmp_path: Path,
) -> None:
    """Every roll writes the snapshot that retention relies on. When that write fails, the appends
    waiting for the roll fail (they may be retried); they must neither hang, nor leave the log
    writing later appends at offsets the file does not hold, which a reopen would cut off."""

    async def go() -> None:
        fs = _SnapshotFailsOnce()
        log = StreamLog.open(tmp_path, ZERO, segment_bytes=300, fs=fs)
        for i in range(2):
            await log.stage(count=1, payload=bytes([65 + i]) * 100).done
        assert len(seg_files(tmp_path)) == 1
        fs.armed = True
        failed = log.stage(count=1, payload=b"x" * 100)  # the segment is full: this one rolls
        while not fs.failed:
            await asyncio.sleep(0.01)
        later = [log.stage(count=1, payload=bytes([67 + i]) * 100) for i in range(3)]
        for staged in later:
            await staged.done
        assert failed.done.done() and isinstance(failed.done.exception(), OSError)
        acknowledged = [b.payload for b in log.read(log.first, 1 << 20)]
        await log.drain()
        log.close_files()  # as kill -9 leaves it
        again = StreamLog.open(tmp_path, ZERO, segment_bytes=300)
        assert again.durable.end == later[-1].end
        assert [b.payload for b in again.read(again.first, 1 << 20)] == acknowledged
        assert acknowledged == [b"A" * 100, b"B" * 100, b"C" * 100, b"D" * 100, b"E" * 100]
        again.close_files()

    asyncio.run(go())


def test_a_lost_snapshot_after_retention_is_an_error_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The snapshot is the only record of what the deleted segments told the producers: if it is
    gone (disk damage), the log still opens, and says loudly what it forgot."""

    async def go() -> None:
        log = StreamLog.open(tmp_path, ZERO, segment_bytes=500)
        await append_each(log, producer_specs("old", 20, size=40))
        await append_each(log, producer_specs("new", 20, size=40))
        await log.delete_oldest(log.deletable(now_ms=0, max_age_ms=None, max_bytes=0, keep_from=FAR))
        await log.close()
        (tmp_path / SNAPSHOT_NAME).unlink()
        with caplog.at_level("ERROR", logger="onceflow.storage"):
            again = StreamLog.open(tmp_path, ZERO, segment_bytes=500)
        assert any("retention deleted" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)
        assert again.producer("old") is None and again.producer("new") is not None
        await again.close()

    asyncio.run(go())
