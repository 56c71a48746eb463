"""Catch-up reads on the PostgreSQL store leave the event loop free (issue 30, Finding 7).

A read of bytes older than the store's memory cache goes to the database. It used to do so on the
event loop, which waited for the answer (up to ``read_timeout``): forty catch-up readers held every
other client up for 10-13 s. Now the loop decides what to read, a thread fetches those bytes by file
id (at most ``cold_reads`` at once), and the loop checks and parses them: other requests are served
meanwhile, and the answers are the bytes written, whatever happens to the stream during the wait.

The database is made slow with a :class:`Gate` on the store's connections (the public
:class:`~onceflow.storage.pgfs.Connector` seam): a cold read's SELECT waits there until the test
opens it. Nothing here measures time: the tests check what was answered while a read still waited.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import signal
import struct
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("psycopg_pool", reason="the PostgreSQL store needs psycopg_pool (onceflow[postgresql])")

from helpers.sse import SSERead  # noqa: E402
from onceflow.core.broker import Broker  # noqa: E402
from onceflow.server.app import App, AppConfig  # noqa: E402
from onceflow.storage.pgfs import TAIL_CACHE, Connector, PgFileSystem  # noqa: E402
from onceflow.storage.position import Position  # noqa: E402
from onceflow.testing import PostgresServer  # noqa: E402
from onceflow.wire import FRAME  # noqa: E402

ROOT = Path("/onceflow")
OCTETS = {"Content-Type": "application/octet-stream"}
HELD = 10.0  # the longest a gate holds a read: a bound that ends a failing test, never a goal
WAIT = 30.0  # the longest a test waits for anything
PIECE = 256 << 10  # one append's bytes: four of them make a stream whose start is out of memory
# the SELECT of PgFileSystem.read_range (a cold read), told from every other statement of the store
COLD_SELECT = "FROM onceflow_chunks WHERE file = %(f)s AND at < %(hi)s"


class Gate:
    """Holds each cold read's SELECT (in whatever thread runs it) until :meth:`open` lets it on, at
    most :data:`HELD` seconds. Counts the reads inside and keeps the order of what happened."""

    def __init__(self) -> None:
        self.closed = False
        self._lock = threading.Lock()
        self.inside = 0
        self.most_inside = 0
        self.passed = 0  # cold reads that passed, held or not
        self.log: list[str] = []  # "in 0", "out 0", ... in the order they happened
        self._waits: list[threading.Event] = []
        self._count = itertools.count()

    def passing(self) -> None:
        with self._lock:
            self.passed += 1
            if not self.closed:
                return
            i = next(self._count)
            wait = threading.Event()
            self._waits.append(wait)
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
            self.log.append(f"in {i}")
        wait.wait(HELD)
        with self._lock:
            self.inside -= 1
            self.log.append(f"out {i}")

    def let_one_on(self, i: int) -> None:
        self._waits[i].set()

    def open(self) -> None:
        with self._lock:
            self.closed = False
            for wait in self._waits:
                wait.set()

    def entered(self) -> int:
        with self._lock:
            return len(self._waits)

    def opened(self, i: int) -> bool:
        return self._waits[i].is_set()


class _GatedCursor:
    def __init__(self, cur: Any, gate: Gate) -> None:
        self._cur, self._gate = cur, gate

    def __enter__(self) -> _GatedCursor:
        self._cur.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._cur.__exit__(*exc)

    def execute(self, sql: Any, *args: Any, **kwargs: Any) -> Any:
        if COLD_SELECT in str(sql):
            self._gate.passing()
        self._cur.execute(sql, *args, **kwargs)
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)


class _GatedConnection:
    def __init__(self, conn: Any, gate: Gate) -> None:
        self._conn, self._gate = conn, gate

    def cursor(self, *args: Any, **kwargs: Any) -> _GatedCursor:
        return _GatedCursor(self._conn.cursor(*args, **kwargs), self._gate)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class _GatedPool:
    def __init__(self, pool: Any, gate: Gate) -> None:
        self._pool, self._gate = pool, gate

    @contextlib.contextmanager
    def connection(self, *args: Any, **kwargs: Any) -> Iterator[_GatedConnection]:
        with self._pool.connection(*args, **kwargs) as conn:
            yield _GatedConnection(conn, self._gate)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


class GatedConnector(Connector):
    """psycopg's connections, each cold read's SELECT passing :attr:`gate` first."""

    def __init__(self) -> None:
        self.gate = Gate()

    def pool(self, conninfo: str, **kwargs: Any) -> Any:
        return _GatedPool(super().pool(conninfo, **kwargs), self.gate)


@pytest.fixture
def gated(pg: str) -> Iterator[tuple[PgFileSystem, Gate]]:
    connector = GatedConnector()
    fs = PgFileSystem(pg, read_timeout=WAIT, cold_reads=2, connector=connector)
    fs.mkdir(ROOT)
    try:
        yield fs, connector.gate
    finally:
        connector.gate.open()
        fs.close()


@contextlib.asynccontextmanager
async def serving(fs: PgFileSystem, **broker: Any) -> AsyncIterator[tuple[Broker, App, httpx.AsyncClient]]:
    b = Broker(ROOT / "data", fs=fs, **broker)
    await asyncio.get_running_loop().run_in_executor(None, b.open)
    await b.start()
    app = App(b, AppConfig(long_poll_timeout=0.2))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
        yield b, app, c
    await app.subscriptions.close()
    await b.close()


def piece(i: int, n: int = PIECE) -> bytes:
    """Append number ``i``: a pattern of its own, so that a byte in the wrong place shows."""
    return struct.pack(">I", i) * (n // 4)


async def long_stream(c: httpx.AsyncClient, name: str, appends: int = 6, **headers: str) -> bytes:
    """A stream of ``appends`` pieces, more than the memory cache: its start is read from the database."""
    assert (await c.put(f"/v1/stream/{name}", headers={**OCTETS, **headers})).status_code == 201
    for i in range(appends):
        r = await c.post(f"/v1/stream/{name}", content=piece(i), headers=OCTETS)
        assert r.status_code in (200, 204), r.text
    written = b"".join(piece(i) for i in range(appends))
    assert len(written) > TAIL_CACHE
    return written


async def until(what: Any, *, within: float = WAIT) -> None:
    """Let the loop run until ``what()`` holds (a bound, not a goal)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not what():
        assert loop.time() < deadline, "the awaited state never came"
        await asyncio.sleep(0.005)


@pytest.mark.timeout(120)
@pytest.mark.anyio
async def test_a_cold_read_waiting_for_the_database_holds_up_no_other_request(
    gated: tuple[PgFileSystem, Gate],
) -> None:
    """Finding 7: the read waited for the database on the event loop, so the append and the HEAD
    below were answered only once it was (here: once the gate gave up holding it)."""
    fs, gate = gated
    async with serving(fs) as (_, _app, c):
        written = await long_stream(c, "old")
        assert (await c.put("/v1/stream/other", headers=OCTETS)).status_code == 201
        gate.closed = True
        read = asyncio.ensure_future(c.get("/v1/stream/old", params={"offset": "-1"}))
        await until(lambda: gate.entered() == 1)  # the read is in the database, held there
        append = await c.post("/v1/stream/other", content=b"meanwhile", headers=OCTETS)
        head = await c.head("/v1/stream/old")
        listed = await c.get("/v1/streams")
        answered_while_held = not gate.opened(0) and not read.done()
        gate.open()
        r = await read
    assert answered_while_held, "the other requests waited for the cold read"
    assert append.status_code in (200, 204) and head.status_code == 200 and listed.status_code == 200
    assert r.status_code == 200 and written.startswith(r.content) and len(r.content) >= PIECE


@pytest.mark.timeout(120)
@pytest.mark.anyio
async def test_no_more_than_cold_reads_wait_for_the_database_at_once(gated: tuple[PgFileSystem, Gate]) -> None:
    """``cold_reads`` (2 here) bounds the reads in the database: a third waits for its turn, and
    starts only once one of the two is done."""
    fs, gate = gated
    assert fs.cold_reads == 2
    async with serving(fs) as (_, _app, c):
        written = await long_stream(c, "old")
        gate.closed = True
        reads = [asyncio.ensure_future(c.get("/v1/stream/old", params={"offset": "-1"})) for _ in range(3)]
        await until(lambda: gate.entered() == 2 and fs.cold_waiting == 1)
        assert gate.inside == 2 and fs.cold_running == 2  # the third waits for a turn, not in the database
        gate.let_one_on(0)
        await until(lambda: gate.entered() == 3)
        gate.open()
        answers = await asyncio.gather(*reads)
    assert gate.most_inside == 2
    assert gate.log.index("in 2") > gate.log.index("out 0"), gate.log  # the third began after one ended
    for r in answers:
        assert r.status_code == 200 and written.startswith(r.content) and r.content
    assert fs.cold_running == 0 and fs.cold_waiting == 0


@pytest.mark.timeout(300)
@pytest.mark.anyio
async def test_cold_reads_answer_the_bytes_written_across_segments_forks_and_formats(
    gated: tuple[PgFileSystem, Gate],
) -> None:
    """Every answer of a read that went to the database equals the one the loop's blocking read
    gives (today's path, ``Broker.read``) and the bytes the appends wrote: from every batch
    boundary, across segments (a segment a few pieces long), across a fork's fork point, as
    ``format=records``, as SSE, and while appends go on."""
    fs, gate = gated
    fs.cache_budget = PIECE  # a segment holds less than a file's cache: only the newest file keeps one
    async with serving(fs, segment_bytes=3 * PIECE) as (broker, app, c):
        written = await long_stream(c, "old", appends=9)
        tokens = ["-1"]
        offset = "-1"
        while True:  # every batch boundary, one piece a read
            r = await c.get("/v1/stream/old", params={"offset": offset, "max_bytes": str(PIECE)})
            assert r.status_code == 200
            if r.headers.get("stream-up-to-date") == "true":
                break
            offset = r.headers["stream-next-offset"]
            tokens.append(offset)
        assert len(tokens) == 9
        fork_at = tokens[4]
        fork = {**OCTETS, "Stream-Forked-From": "old", "Stream-Fork-Offset": fork_at}
        assert (await c.put("/v1/stream/fork", headers=fork)).status_code == 201
        forked = written[: 4 * PIECE] + b"".join(piece(100 + i) for i in range(3))
        for i in range(3):
            assert (await c.post("/v1/stream/fork", content=piece(100 + i), headers=OCTETS)).status_code in (200, 204)
        s_old, s_fork = broker.get("old"), broker.get("fork")
        assert s_old is not None and s_fork is not None
        more = 0

        async def appending() -> None:  # appends go on meanwhile, to the stream being read
            nonlocal more
            for i in range(6):
                r = await c.post("/v1/stream/old", content=piece(50 + i), headers=OCTETS)
                assert r.status_code in (200, 204)
                more += 1

        writer = asyncio.ensure_future(appending())
        grown = written + b"".join(piece(50 + i) for i in range(6))  # what "old" holds once they are done
        passed = gate.passed
        for name, s, data, starts in (("old", s_old, grown, tokens), ("fork", s_fork, forked, tokens[:5])):
            for k, token in enumerate(starts):
                at = broker.resolve_start(s, token)
                assert not isinstance(at, str)
                if k < 8:  # two pieces there whatever the appends did meanwhile
                    before = broker.read(s, at, 2 * PIECE)  # the blocking read: today's answer
                    after = await broker.aread(s, at, 2 * PIECE)
                    assert [(b.start, b.end, b.payload) for b in after.batches] == [
                        (b.start, b.end, b.payload) for b in before.batches
                    ]
                    assert after.next == before.next and len(after.batches) == 2
                r = await c.get(f"/v1/stream/{name}", params={"offset": token, "max_bytes": str(2 * PIECE)})
                assert r.status_code == 200 and data[k * PIECE :].startswith(r.content) and r.content, (name, k)
                frames = await c.get(
                    f"/v1/stream/{name}", params={"offset": token, "format": "records", "max_bytes": str(PIECE)}
                )
                assert frames.status_code == 200
                first, count, _ts, size = FRAME.unpack_from(frames.content)
                assert (first, count, size) == (k, 1, PIECE) and frames.content[FRAME.size :] == piece(
                    100 + k - 4 if name == "fork" and k >= 4 else k
                )
        await writer
        whole = await c.get("/v1/stream/fork", params={"offset": "-1"})
        assert whole.status_code == 200 and whole.content == forked
        live = SSERead(app, "old", tokens[1])
        got = b""
        while len(got) < len(grown) - PIECE:
            got += base64.b64decode(await live.next("data"))
        await live.close()
        assert live.status == 200 and got == grown[PIECE:]
    assert more == 6
    assert gate.entered() == 0 and gate.passed > passed  # nothing held: the gate stayed open, cold reads passed it


@pytest.mark.timeout(120)
@pytest.mark.anyio
async def test_a_segment_that_retention_deletes_during_the_read_answers_as_a_read_after_it(
    gated: tuple[PgFileSystem, Gate],
) -> None:
    """The read waits in the database while retention deletes the segment it reads (its chunks
    go, so the database has nothing left to give): the answer is the 410 a read begun after the
    deletion gets, naming the same earliest offset, never zeros taken for data (a 400) or a 500."""
    fs, gate = gated
    fs.cache_budget = PIECE  # a segment holds less than a file's cache: only the newest file keeps one
    async with serving(fs, segment_bytes=2 * PIECE) as (broker, _app, c):
        retention = {"Stream-Retention-Bytes": str(4 * PIECE)}
        written = await long_stream(c, "old", appends=8, **retention)
        gate.closed = True
        read = asyncio.ensure_future(c.get("/v1/stream/old", params={"offset": "-1"}))
        framed = asyncio.ensure_future(c.get("/v1/stream/old", params={"offset": "-1", "format": "records"}))
        await until(lambda: gate.entered() == 2)
        freed = await broker.enforce_retention()
        assert freed.get("old"), freed  # the segments being read went, their chunks with them
        gate.open()
        r, f = await read, await framed
        after = await c.get("/v1/stream/old", params={"offset": "-1"})
        gone = await c.get("/v1/stream/old", params={"offset": Position(0, 0).token()})
    assert after.status_code == 200 and written.endswith(after.content)
    for answer in (r, f, gone):
        assert answer.status_code == 410, answer.text[:300]
        assert answer.json()["error"]["code"] == "offset_gone"
        assert answer.headers["stream-earliest-offset"] == gone.headers["stream-earliest-offset"]


@pytest.mark.timeout(120)
@pytest.mark.anyio
async def test_a_stream_deleted_during_the_read_answers_as_a_read_after_the_delete(
    gated: tuple[PgFileSystem, Gate],
) -> None:
    fs, gate = gated
    async with serving(fs) as (broker, _app, c):
        await long_stream(c, "old")
        tokens = []
        r = await c.get("/v1/stream/old", params={"offset": "-1", "max_bytes": str(PIECE)})
        tokens.append(r.headers["stream-next-offset"])
        gate.closed = True
        read = asyncio.ensure_future(c.get("/v1/stream/old", params={"offset": "-1"}))
        framed = asyncio.ensure_future(c.get("/v1/stream/old", params={"offset": tokens[0], "format": "records"}))
        scan = asyncio.ensure_future(c.get("/v1/stream/old", params={"offset": "-1", "format": "boundaries"}))
        await until(lambda: gate.entered() == 2)  # two reads in the database, the third waits for a turn
        assert (await c.delete("/v1/stream/old")).status_code == 204
        gate.open()
        answers = [await read, await framed, await scan]
        after = await c.get("/v1/stream/old", params={"offset": "-1"})
    assert after.status_code == 404
    for answer in answers[:2]:
        assert answer.status_code == 404, answer.text[:300]
        assert answer.json()["error"]["code"] == "not_found"
    assert answers[2].status_code in (400, 404), answers[2].text[:300]  # a scan says "deleted", as after a pause
    assert broker.get("old") is None


@pytest.mark.timeout(120)
@pytest.mark.anyio
async def test_a_read_from_a_frozen_database_is_answered_503_at_the_read_timeout_and_the_rest_is_served() -> None:
    """A frozen database (SIGSTOP, a paused VM) answers nothing, so no statement_timeout ends the
    read's query: the loop's own bound on its wait does. The client gets 503 (retry), the others
    are served meanwhile, and once the database is back the read gets its bytes."""
    with PostgresServer() as server:
        fs = PgFileSystem(server.conninfo(), read_timeout=0.5)
        try:
            fs.mkdir(ROOT)
            async with serving(fs) as (_, _app, c):
                written = await long_stream(c, "old")
                assert server.node is not None
                server.node.signal(signal.SIGSTOP)
                try:
                    read = asyncio.ensure_future(c.get("/v1/stream/old", params={"offset": "-1"}))
                    head = await c.head("/v1/stream/old")  # from memory: answered while the read waits
                    r = await read
                finally:
                    server.node.signal(signal.SIGCONT)
                after = await c.get("/v1/stream/old", params={"offset": "-1"})
        finally:
            fs.close()
    assert head.status_code == 200
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text[:300]
    assert "read_timeout" in r.json()["error"]["message"]
    assert after.status_code == 200 and written.startswith(after.content) and after.content
