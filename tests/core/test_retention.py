"""Retention through the broker and the HTTP API: what goes, what must never go, and what a reader
whose offset fell off the retained range is told.

Streams here roll a new segment every ~600 bytes, so a few dozen appends make several segments;
``Broker.enforce_retention()`` is what the sweep runs every ``retention_interval`` seconds."""

from __future__ import annotations

import asyncio
import errno
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.servers import InProcess
from helpers.ticks import ticking
from helpers.txn import JSON, S, Txn, committed
from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig
from onceflow.storage.batch import HEADER_SIZE
from onceflow.storage.fs import File, OsFileSystem

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


@asynccontextmanager
async def served(data: Path, **broker_options: Any) -> AsyncIterator[InProcess]:
    broker = Broker(data, segment_bytes=600, **broker_options)
    broker.open()
    await broker.start()
    app = App(broker, AppConfig(long_poll_timeout=0.2))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        yield InProcess(broker, app, client, data)
    await broker.close()


async def create(c: InProcess, name: str, **headers: str) -> None:
    r = await c.client.put(S + name, headers={**JSON, **headers})
    assert r.status_code == 201, r.text


async def fill(c: InProcess, name: str, n: int, start: int = 0) -> list[str]:
    """Append messages ``start``..``start+n-1`` one by one; the offset after each."""
    out = []
    for i in range(start, start + n):
        r = await c.client.post(S + name, json=[{"i": i, "pad": "x" * 60}], headers=JSON)
        assert r.status_code in (200, 204), r.text
        out.append(r.headers["stream-next-offset"])
    return out


async def numbers(c: InProcess, name: str, offset: str = "-1") -> list[int]:
    r = await c.client.get(S + name, params={"offset": offset})
    assert r.status_code == 200, r.text
    return [m["i"] for m in r.json() if isinstance(m, dict) and "i" in m]


async def test_a_reader_whose_offset_fell_off_gets_410_naming_the_earliest_offset(tmp_path: Path) -> None:
    async with served(tmp_path / "d") as c:
        await create(c, "r", **{"Stream-Retention-Bytes": "1200"})
        offsets = await fill(c, "r", 40)
        freed = await c.broker.enforce_retention()
        assert freed.get("r", 0) > 0
        left = await numbers(c, "r")
        assert left == list(range(left[0], 40)) and left[0] > 0  # "-1" starts at the earliest kept
        head = await c.client.head(S + "r")
        earliest = head.headers["stream-earliest-offset"]
        assert earliest == offsets[left[0] - 1]
        for params in (
            {"offset": offsets[0]},
            {"offset": offsets[0], "format": "records"},
            {"offset": offsets[0], "live": "long-poll"},
        ):
            r = await c.client.get(S + "r", params=params)
            assert r.status_code == 410, (params, r.text)
            error = r.json()["error"]
            assert error["code"] == "offset_gone" and error["earliest_offset"] == earliest, error
            assert earliest in error["message"] and r.headers["stream-earliest-offset"] == earliest
        assert await numbers(c, "r", earliest) == left  # going on from the earliest offset works
        assert await numbers(c, "r", offsets[-5]) == [36, 37, 38, 39]
        # a fork cannot start where the data is gone
        fork = await c.client.put(
            S + "r-fork", headers={**JSON, "Stream-Forked-From": S + "r", "Stream-Fork-Offset": offsets[0]}
        )
        assert fork.status_code == 400 and "no longer kept" in fork.json()["error"]["message"]


async def test_retention_survives_a_restart_and_producers_stay_deduplicated(tmp_path: Path) -> None:
    """An idempotent producer whose appends were all deleted: its retry after a restart is still a
    duplicate (204), not new data."""

    def producer(seq: int) -> dict[str, str]:
        return {**JSON, "Producer-Id": "p1", "Producer-Epoch": "0", "Producer-Seq": str(seq)}

    async with served(tmp_path / "d") as c:
        await create(c, "r", **{"Stream-Retention-Bytes": "1200"})
        for seq in range(3):
            r = await c.client.post(S + "r", json=[{"i": -1 - seq}], headers=producer(seq))
            assert r.status_code == 200, r.text
        await fill(c, "r", 40)
        await c.broker.enforce_retention()
        before = await numbers(c, "r")
        assert before[0] > 0
        earliest = (await c.client.head(S + "r")).headers["stream-earliest-offset"]
    async with served(tmp_path / "d") as c:
        assert await numbers(c, "r") == before
        assert (await c.client.head(S + "r")).headers["stream-earliest-offset"] == earliest
        retry = await c.client.post(S + "r", json=[{"i": -3}], headers=producer(2))
        assert retry.status_code == 204, retry.text
        assert await numbers(c, "r") == before
        await fill(c, "r", 5, start=40)
        assert (await numbers(c, "r"))[-5:] == [40, 41, 42, 43, 44]


async def test_retention_never_deletes_data_of_an_open_transaction(tmp_path: Path) -> None:
    """A transaction open since before the data retention would delete: nothing from its first
    batch on may go, or its commit would publish it with parts missing."""
    async with served(tmp_path / "d") as c:
        await create(c, "t", **{"Stream-Retention-Bytes": "600"})
        await fill(c, "t", 10)
        t = Txn(c.client, "w")
        await t.init()
        assert (await t.send("t", {"i": 1000, "part": 1})).status_code == 200
        await fill(c, "t", 40, start=10)
        freed = await c.broker.enforce_retention()
        assert freed.get("t", 0) > 0  # what came before the transaction may go
        uncommitted = await c.client.get(S + "t", params={"offset": "-1", "isolation": "read_uncommitted"})
        assert {"i": 1000, "part": 1} in uncommitted.json()
        assert (await t.send("t", {"i": 1001, "part": 2})).status_code == 200
        assert (await t.end(commit=True)).status_code == 200
        assert [m for m in await committed(c, "t") if m.get("i", 0) >= 1000] == [
            {"i": 1000, "part": 1},
            {"i": 1001, "part": 2},
        ]
        await fill(c, "t", 20, start=50)
        assert (await c.broker.enforce_retention()).get("t", 0) > 0  # once it ended, it may go too
        assert 1000 not in await numbers(c, "t")


async def test_retention_keeps_what_a_named_group_has_not_consumed(tmp_path: Path) -> None:
    async with served(tmp_path / "d") as c:
        await create(c, "g", **{"Stream-Retention-Bytes": "600", "Stream-Retention-Keep-Groups": "billing, audit"})
        offsets = await fill(c, "g", 40)
        assert await c.broker.enforce_retention() == {}  # neither group has an offset yet: keep all
        for group in ("billing", "audit"):
            r = await c.client.post(f"/v1/groups/{group}/offsets", json={"offsets": {"g": offsets[9]}})
            assert r.status_code == 200, r.text
        await c.client.post("/v1/groups/billing/offsets", json={"offsets": {"g": offsets[30]}})
        assert (await c.broker.enforce_retention()).get("g", 0) > 0
        left = await numbers(c, "g")
        assert 0 < left[0] <= 10  # nothing past audit's offset (after message 9) went
        assert await numbers(c, "g", offsets[9]) == list(range(10, 40))
        await c.client.post("/v1/groups/audit/offsets", json={"offsets": {"g": offsets[39]}})
        await c.broker.enforce_retention()
        assert (await numbers(c, "g"))[0] > 10


async def test_a_stream_with_forks_keeps_its_data_until_they_are_gone(tmp_path: Path) -> None:
    async with served(tmp_path / "d") as c:
        await create(c, "p", **{"Stream-Retention-Bytes": "600"})
        offsets = await fill(c, "p", 40)
        fork = await c.client.put(
            S + "p-fork", headers={**JSON, "Stream-Forked-From": S + "p", "Stream-Fork-Offset": offsets[20]}
        )
        assert fork.status_code == 201, fork.text
        assert "p" not in await c.broker.enforce_retention()
        assert await numbers(c, "p-fork") == list(range(21))
        assert (await c.client.delete(S + "p-fork")).status_code in (200, 204)
        assert (await c.broker.enforce_retention()).get("p", 0) > 0


async def test_the_servers_default_applies_to_streams_without_their_own(tmp_path: Path) -> None:
    async with served(tmp_path / "d", retention_bytes=1200) as c:
        await create(c, "default")
        await create(c, "own", **{"Stream-Retention-Bytes": "100000"})
        await fill(c, "default", 40)
        await fill(c, "own", 40)
        freed = await c.broker.enforce_retention()
        assert "default" in freed and "own" not in freed
        assert await numbers(c, "own") == list(range(40))


async def test_age_retention_deletes_what_is_older_than_asked(tmp_path: Path) -> None:
    clock = Clock()
    async with served(tmp_path / "d", clock=clock) as c:
        await create(c, "a", **{"Stream-Retention-Seconds": "3600"})
        await fill(c, "a", 30)
        clock.now += 1800
        await fill(c, "a", 30, start=30)
        assert await c.broker.enforce_retention() == {}  # nothing is an hour old yet
        clock.now += 1801
        assert (await c.broker.enforce_retention()).get("a", 0) > 0
        left = await numbers(c, "a")
        assert 0 < left[0] <= 30  # the older half went (as far as whole segments allow), the newer stays


async def test_retention_headers_are_checked_and_part_of_the_streams_configuration(onceflow: InProcess) -> None:
    for headers, word in (
        ({"Stream-Retention-Seconds": "0"}, "Stream-Retention-Seconds"),
        ({"Stream-Retention-Seconds": "1h"}, "Stream-Retention-Seconds"),
        ({"Stream-Retention-Bytes": "-5"}, "Stream-Retention-Bytes"),
        ({"Stream-Retention-Keep-Groups": "a,,b"}, "Stream-Retention-Keep-Groups"),
        ({"Stream-Retention-Keep-Groups": ",".join(f"g{i}" for i in range(17))}, "Stream-Retention-Keep-Groups"),
    ):
        r = await onceflow.client.put(S + "h", headers={**JSON, **headers})
        assert r.status_code == 400 and word in r.json()["error"]["message"], (headers, r.text)
    retention = {"Stream-Retention-Seconds": "86400", "Stream-Retention-Keep-Groups": "g"}
    assert (await onceflow.client.put(S + "h", headers={**JSON, **retention})).status_code == 201
    assert (await onceflow.client.put(S + "h", headers={**JSON, **retention})).status_code in (200, 204)
    other = await onceflow.client.put(S + "h", headers={**JSON, "Stream-Retention-Seconds": "60"})
    assert other.status_code == 409, other.text


class _GatedSync(OsFileSystem):
    """The real disk, but once ``armed`` the next directory sync waits for ``gate``: retention's
    first step, in the worker thread it deletes in, so a test can act in between."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.entered = threading.Event()
        self.gate = threading.Event()

    def sync_dir(self, path: Path) -> None:
        if self.armed:
            self.armed = False
            self.entered.set()
            self.gate.wait()
        super().sync_dir(path)


@asynccontextmanager
async def retention_paused(c: InProcess, fs: _GatedSync) -> AsyncIterator[None]:
    """Run a retention pass that stops at its directory sync for the block's duration (and
    always goes on afterwards, so no worker thread is left waiting)."""
    fs.armed = True
    sweep = asyncio.ensure_future(c.broker.enforce_retention())
    try:
        while not fs.entered.is_set():
            await asyncio.sleep(0.01)
        yield
    finally:
        fs.gate.set()
        await sweep


async def test_retention_that_overlaps_a_delete_and_recreate_leaves_the_new_streams_files_alone(
    tmp_path: Path,
) -> None:
    """Retention deletes segment files by name in a worker thread. A stream deleted and created
    again under the same name meanwhile has its directory, and its first segment's file name,
    at the very same path: the new stream's data must not be what goes."""
    fs = _GatedSync()
    async with served(tmp_path / "d", fs=fs) as c:
        await create(c, "r", **{"Stream-Retention-Bytes": "1200"})
        await fill(c, "r", 40)
        async with retention_paused(c, fs):
            assert (await c.client.delete(S + "r")).status_code in (200, 204)
            await create(c, "r", **{"Stream-Retention-Bytes": "1200"})
            await fill(c, "r", 3, start=100)
        assert await numbers(c, "r") == [100, 101, 102]
    async with served(tmp_path / "d") as c:
        assert await numbers(c, "r") == [100, 101, 102]


class _FailingReads(OsFileSystem):
    """The real disk, but every read of a file under ``failing`` (a directory) raises EIO."""

    def __init__(self) -> None:
        super().__init__()
        self.failing: Path | None = None

    def open_file(self, path: Path, *, create: bool) -> File:
        return _FlakyFile(super().open_file(path, create=create), self)


class _FlakyFile:
    def __init__(self, inner: File, fs: _FailingReads) -> None:
        self.inner, self.fs = inner, fs

    @property
    def path(self) -> Path:
        return self.inner.path

    def size(self) -> int:
        return self.inner.size()

    def pwrite(self, data: bytes, at: int) -> None:
        self.inner.pwrite(data, at)

    def pread(self, n: int, at: int) -> bytes:
        if self.fs.failing is not None and self.inner.path.parent == self.fs.failing:
            raise OSError(errno.EIO, "injected read error", str(self.inner.path))
        return self.inner.pread(n, at)

    def sync(self) -> None:
        self.inner.sync()

    def truncate(self, size: int) -> None:
        self.inner.truncate(size)

    def close(self) -> None:
        self.inner.close()


async def test_a_read_error_in_one_stream_stops_neither_retention_of_the_others_nor_the_sweep(
    tmp_path: Path,
) -> None:
    """Retention by age reads the first batch header of a segment. An I/O error there is that
    stream's problem: the others are still trimmed, and the pass returns normally (it runs inside
    the server's sweep, which also times transactions out and expires streams: an exception out of
    it would end the sweep for good)."""
    clock = Clock()
    fs = _FailingReads()
    async with served(tmp_path / "d", clock=clock, fs=fs) as c:
        for name in ("bad", "good"):
            await create(c, name, **{"Stream-Retention-Seconds": "3600"})
            await fill(c, name, 30)
        clock.now += 7200
        for name in ("bad", "good"):
            await fill(c, name, 10, start=30)
        bad = c.broker.get("bad")
        assert bad is not None
        fs.failing = bad.directory
        freed = await c.broker.enforce_retention()
        assert "bad" not in freed and freed.get("good", 0) > 0


async def test_a_fork_made_while_retention_syncs_keeps_its_sources_data(tmp_path: Path) -> None:
    """Retention syncs the directory (the snapshot's name) before it deletes. A fork created
    meanwhile, at a point in the data retention had chosen, is either refused or keeps that data:
    never made, and then left reading nothing."""
    fs = _GatedSync()
    async with served(tmp_path / "d", fs=fs) as c:
        await create(c, "p", **{"Stream-Retention-Bytes": "600"})
        offsets = await fill(c, "p", 40)
        async with retention_paused(c, fs):
            fork = await c.client.put(
                S + "p-fork", headers={**JSON, "Stream-Forked-From": S + "p", "Stream-Fork-Offset": offsets[5]}
            )
        if fork.status_code == 201:  # made before the deletion: it keeps what it forked
            assert await numbers(c, "p-fork") == list(range(6))
            assert await numbers(c, "p") == list(range(40))
        else:  # or refused, the data being gone already
            assert fork.status_code == 400 and "no longer kept" in fork.text, fork.text


class _SlowHeaders(OsFileSystem):
    """The real disk, but once ``ticks`` is set every read of a segment's first batch header (what
    retention by age reads, one per stream) blocks for ``delay`` seconds, as a database round trip
    would, and notes how far a ticker task (``ticks[0]``) had got when it began."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay
        self.ticks: list[int] | None = None
        self.seen: list[int] = []

    def open_file(self, path: Path, *, create: bool) -> File:
        return _SlowHeaderFile(super().open_file(path, create=create), self)


class _SlowHeaderFile(_FlakyFile):
    def __init__(self, inner: File, fs: _SlowHeaders) -> None:
        self.inner, self.slow = inner, fs

    def pread(self, n: int, at: int) -> bytes:
        if self.slow.ticks is not None and at == 0 and n == HEADER_SIZE:
            self.slow.seen.append(self.slow.ticks[0])
            time.sleep(self.slow.delay)  # noqa: ASYNC251 - a blocking store call on the loop is what is tested
        return self.inner.pread(n, at)


async def test_a_retention_sweep_over_many_streams_lets_other_tasks_run_meanwhile(tmp_path: Path) -> None:
    """A sweep that reads a segment header of each of many streams (retention by age, none old
    enough to go: no deletion, so nothing awaits) must not hold the event loop for all of them: a
    ticker task runs between the first header read and the last. (Structural, not timed: each read
    takes 3 ms here, 40 of them far more than the sweep's slice of the loop.)"""
    clock = Clock()
    fs = _SlowHeaders(delay=0.003)
    names = [f"s{i}" for i in range(40)]
    async with served(tmp_path / "d", clock=clock, fs=fs) as c:
        for name in names:
            await create(c, name, **{"Stream-Retention-Seconds": "3600"})
            await fill(c, name, 12)
        async with ticking() as ticks:
            fs.ticks = ticks
            assert await c.broker.enforce_retention() == {}  # nothing is an hour old
            fs.ticks = None
        assert len(fs.seen) == len(names), fs.seen  # one header read per stream
        assert fs.seen[-1] > fs.seen[0], f"the ticker never ran during the sweep: {fs.seen}"
