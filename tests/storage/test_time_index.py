"""The stream log's time index (``StreamLog.index_times`` / ``find_time``, issue 28 item 2): a lookup
by time finds what a scan of every batch from the log's first kept position finds (the first batch,
in log order, appended at or after the time) on any history of append times, the server's clock
stepping back and group commits stamping many batches alike included; the index reads each byte
of the log once and a lookup one piece.

Pieces, segments and index steps are made tiny here so that a few dozen batches cross every
boundary there is."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.logkit import ZERO
from onceflow.storage.batch import HEADER_SIZE, CorruptBatch
from onceflow.storage.log import StreamLog
from onceflow.storage.position import Position


class Stamps:
    """A clock that gives each batch the next append time of a list (milliseconds)."""

    def __init__(self, times_ms: list[int]) -> None:
        self.times: Iterator[int] = iter(times_ms)

    def __call__(self) -> float:
        return next(self.times) / 1000 + 0.0001  # int(...*1000) gives the time back exactly


class CountedFile:
    """A segment file that counts the bytes read through it."""

    def __init__(self, real: Any, counts: list[int]) -> None:
        self.real, self.counts = real, counts

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def pread(self, n: int, at: int) -> bytes:
        data: bytes = self.real.pread(n, at)
        self.counts[0] += len(data)
        return data


def write(directory: Path, times_ms: list[int], sizes: list[int], segment_bytes: int) -> StreamLog:
    """A log of one batch per append time, of the given payload sizes, each its own group commit."""

    async def go() -> StreamLog:
        log = StreamLog.open(directory, ZERO, segment_bytes=segment_bytes, clock=Stamps(times_ms), policy="never")
        for size in sizes:
            await log.stage(count=2, payload=b"p" * size).done
        await log.drain()
        return log

    return asyncio.run(go())


def scanned(log: StreamLog, time_ms: int, limit: Position) -> Position | None:
    """The answer by a scan of every batch from the first kept position: what the index must give."""
    for b in log.read(log.first, 1 << 30, limit):
        if b.header.timestamp >= time_ms:
            return b.start
    return None


def index(log: StreamLog, until: Position, step: int) -> int:
    """Index the log up to ``until`` one step at a time, as the broker does; the steps it took."""
    steps = 0
    while not log.index_times(until, step):
        steps += 1
        assert steps < 10_000
    return steps + 1


def boundaries(log: StreamLog) -> list[Position]:
    batches = log.read(log.first, 1 << 30)
    return [log.first, *(b.end for b in batches)]


_times = st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=60)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    times=_times,
    data=st.data(),
    segment_bytes=st.sampled_from([200, 700, 1 << 20]),
    piece=st.sampled_from([1, 150, 400, 1 << 16]),
    step=st.sampled_from([1, 90, 333, 1 << 20]),
)
def test_a_lookup_finds_what_a_scan_finds_for_any_history_of_append_times(
    times: list[int], data: st.DataObject, segment_bytes: int, piece: int, step: int
) -> None:
    sizes = data.draw(st.lists(st.sampled_from([0, 5, 40, 300]), min_size=len(times), max_size=len(times)))
    with tempfile.TemporaryDirectory() as tmp:
        log = write(Path(tmp), [1000 + t for t in times], sizes, segment_bytes)
        log.time_index_bytes = piece
        try:
            ends = boundaries(log)
            # limits in any order: the index grows to the furthest asked so far, and shorter
            # views of it (a fork's view of its source) are answered from it too
            for limit in data.draw(st.permutations(ends))[:6]:
                index(log, limit, step)
                for t in range(998, 1043):
                    assert log.find_time(t, limit) == scanned(log, t, limit), (t, limit)
        finally:
            log.close_files()


def test_the_index_reads_each_byte_once_and_a_lookup_one_piece(tmp_path: Path) -> None:
    """Indexing reads the log once (a batch longer than a step only by its header); every lookup
    afterwards reads at most one piece and a header, wherever its answer lies."""
    times = [(i * 7919) % 1000 for i in range(3000)]  # all over the place, every time stamped thrice
    sizes = [20_000 if i % 500 == 250 else 30 for i in range(3000)]
    log = write(tmp_path, times, sizes, segment_bytes=60_000)
    try:
        counts = [0]
        for seg in log._segments:
            seg.file = CountedFile(seg.file, counts)  # type: ignore[assignment]
        end = log.durable.end
        big = [s for s in sizes if s == 20_000]
        steps = index(log, end, 4096)
        # every byte once but the big batches' payloads beyond a step, and a header's worth again
        # at most per step (the end of one read that did not hold a whole header)
        most = end.pos - sum(big) + len(big) * 4096 + steps * HEADER_SIZE
        assert counts[0] <= most, (counts[0], end.pos)
        for t in range(-1, 1001, 7):
            counts[0] = 0
            assert log.find_time(t, end) == scanned_without_counting(log, t, end, counts)
            assert counts[0] <= log.time_index_bytes + HEADER_SIZE
    finally:
        log.close_files()


def scanned_without_counting(log: StreamLog, time_ms: int, limit: Position, counts: list[int]) -> Position | None:
    before = counts[0]
    try:
        return scanned(log, time_ms, limit)
    finally:
        counts[0] = before


def test_retention_takes_its_segments_index_with_them(tmp_path: Path) -> None:
    """Segments deleted from the start take their part of the index along: a lookup afterwards
    searches what is kept (a time before all of it gives its first batch), and the index of the
    segments kept is neither read again nor wrong."""
    times = [50 - i % 50 for i in range(200)]  # falling: the oldest batches were stamped latest
    log = write(tmp_path, times, [100] * 200, segment_bytes=3000)
    try:
        end = log.durable.end
        index(log, end, 1 << 20)
        assert log.find_time(50, end) == log.first
        n = log.deletable(now_ms=0, max_age_ms=None, max_bytes=end.pos // 2, keep_from=end)
        assert n > 0
        assert asyncio.run(log.delete_oldest(n)) > 0
        assert log.times_indexed(end)
        for t in range(0, 52):
            assert log.find_time(t, end) == scanned(log, t, end), t
        assert log.find_time(0, end) == log.first
    finally:
        log.close_files()


def test_the_index_grows_with_the_log(tmp_path: Path) -> None:
    """Appends after the index was built are not in it until a lookup that needs them extends it:
    it says so (``times_indexed``), and a lookup whose view ends before them needs nothing more."""
    times = [5, 3, 8, 1, 9, 2, 2, 7]

    async def go() -> None:
        log = StreamLog.open(tmp_path, ZERO, segment_bytes=400, clock=Stamps([1000 + t for t in times]))
        try:
            for _ in range(4):
                await log.stage(count=1, payload=b"x" * 100).done
            half = log.durable.end
            index(log, half, 1 << 20)
            for _ in range(4):
                await log.stage(count=1, payload=b"x" * 100).done
            end = log.durable.end
            assert log.times_indexed(half) and not log.times_indexed(end)
            assert log.find_time(1009, half) is None  # stamped at 1009, but past half
            index(log, end, 1 << 20)
            for t in range(999, 1011):
                assert log.find_time(t, half) == scanned(log, t, half), t
                assert log.find_time(t, end) == scanned(log, t, end), t
        finally:
            log.close_files()

    asyncio.run(go())


def test_bytes_that_are_not_the_logs_batches_leave_the_index_as_it_was(tmp_path: Path) -> None:
    """A header that does not belong where the index expects the next batch (a damaged byte) is a
    CorruptBatch, as for a read, and the index keeps covering what it covered before that step."""
    log = write(tmp_path, [3, 9, 1, 7, 5, 2, 8, 4, 6, 0], [50] * 10, segment_bytes=1 << 20)
    try:
        ends = boundaries(log)
        log.time_index_bytes = 1  # a piece per batch: a failed step has opened pieces to take back
        index(log, ends[4], 1 << 20)
        before = [log.find_time(t, ends[4]) for t in range(1000, 1011)]
        times = log._segments[0].times
        assert times is not None
        state = (list(times.starts), list(times.highs), times.done, times.next_offset)
        (segment,) = sorted(tmp_path.glob("*.seg"))
        with segment.open("r+b") as f:
            f.seek(ends[8].pos + 8)  # the magic byte of the ninth batch's header
            f.write(b"\x00")
        with pytest.raises(CorruptBatch, match="no batch of offset 16"):
            log.index_times(ends[10], 1 << 20)
        assert (list(times.starts), list(times.highs), times.done, times.next_offset) == state
        assert log.times_indexed(ends[4]) and not log.times_indexed(ends[5])
        assert [log.find_time(t, ends[4]) for t in range(1000, 1011)] == before
        log.index_times(ends[8], 1 << 20)  # up to the damage, the index grows as before
        for t in range(999, 1011):
            assert log.find_time(t, ends[8]) == scanned(log, t, ends[8]), t
    finally:
        log.close_files()
