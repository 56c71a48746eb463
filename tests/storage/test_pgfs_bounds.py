"""The PostgreSQL store's reads on the event loop are bounded (issue 30, items 3 and 5): a read of
bytes older than the memory cache goes to the database on the loop, so a statement stuck there (a
lock, a failover, an overloaded primary) must end at the store's ``read_timeout`` with an error that
says so, and a client is answered 503 (retry), never a 500, nor a loop held for as long as the
database takes."""

from __future__ import annotations

import asyncio
import errno
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import httpx
import pytest

from helpers.servers import served_on
from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig

pytest.importorskip("psycopg_pool", reason="the PostgreSQL store needs psycopg_pool (onceflow[postgresql])")

import psycopg  # noqa: E402

from onceflow.storage.pgfs import TAIL_CACHE, PgFile, PgFileSystem  # noqa: E402
from onceflow.testing.services import PostgresServer  # noqa: E402

ROOT = Path("/onceflow")
READ_TIMEOUT = 0.3  # seconds: short, so that the tests below end soon once it works
OCTETS = {"Content-Type": "application/octet-stream"}


@pytest.fixture
def fs(pg: str) -> Iterator[PgFileSystem]:
    f = PgFileSystem(pg)
    f.read_timeout = READ_TIMEOUT
    f.mkdir(ROOT)
    yield f
    f.close()


@contextmanager
def chunks_locked(conninfo: str, *, at_most: float = 10.0) -> Iterator[None]:
    """Every read of the chunks waits in the database while the block runs (another session holds
    the table ``ACCESS EXCLUSIVE``, as a schema change or a stuck maintenance job would), but no
    longer than ``at_most`` seconds: a bound on how long a test that fails waits, not a goal."""
    lock = threading.Lock()
    with psycopg.connect(conninfo) as holder:
        holder.execute("LOCK TABLE onceflow_chunks IN ACCESS EXCLUSIVE MODE")

        def release() -> None:
            with lock:
                if not holder.closed and holder.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    holder.rollback()

        timer = threading.Timer(at_most, release)
        timer.start()
        try:
            yield
        finally:
            timer.cancel()
            release()


def test_a_cold_read_stuck_in_the_database_ends_at_the_read_timeout(fs: PgFileSystem) -> None:
    """On the event loop's thread; in a worker thread (recovery, a sync) a read is not bounded."""
    f = cast(PgFile, fs.open_file(ROOT / "old.log", create=True))
    blob = bytes(range(256)) * (TAIL_CACHE // 256)
    for i in range(2):  # twice the memory cache: the first half is read from the database
        f.pwrite(blob, i * len(blob))
        f.sync()
    got: list[BaseException | bytes] = []
    done = threading.Event()

    async def on_a_loop() -> bytes:
        return f.pread(100, 0)  # as the server reads: synchronously, on its event loop's thread

    def read_it() -> None:
        try:
            got.append(asyncio.run(on_a_loop()))
        except OSError as exc:
            got.append(exc)
        done.set()

    with chunks_locked(fs.conninfo):
        reader = threading.Thread(target=read_it)
        reader.start()
        ended_while_locked = done.wait(8)  # a bound, not a goal: the read's own ends after 0.3 s
    reader.join()
    assert ended_while_locked, f"the read waited for the database as long as it was locked: {got}"
    assert len(got) == 1 and isinstance(got[0], OSError), got
    assert got[0].errno == errno.ETIMEDOUT and "read_timeout" in str(got[0]), got[0]
    assert f.pread(100, 0) == blob[:100]  # the store works again once the database does


@pytest.mark.anyio
async def test_a_client_whose_cold_read_timed_out_is_answered_503_with_retry_after(fs: PgFileSystem) -> None:
    body = b"x" * (TAIL_CACHE // 2)
    octets = {"Content-Type": "application/octet-stream"}
    async with served_on(fs, ROOT / "data") as c:
        assert (await c.put("/v1/stream/long", headers=octets)).status_code == 201
        for _ in range(3):  # 1.5 MiB: the stream's start is no longer in memory
            assert (await c.post("/v1/stream/long", content=body, headers=octets)).status_code in (200, 204)
        with chunks_locked(fs.conninfo):
            r = await c.get("/v1/stream/long", params={"offset": "-1"})
            framed = await c.get("/v1/stream/long", params={"offset": "-1", "format": "records"})
        after = await c.get("/v1/stream/long", params={"offset": "-1"})
    for answer in (r, framed):
        assert answer.status_code == 503, answer.text[:300]
        assert answer.headers["retry-after"] == "1"
        error = answer.json()["error"]
        assert error["code"] == "unavailable" and "read_timeout" in error["message"], error
    assert after.status_code == 200 and after.content.startswith(body)


@contextmanager
def commits_hang(conninfo: str) -> Iterator[None]:
    """Every commit that writes waits for a synchronous standby that does not exist (as when the
    only standby is lost: PostgreSQL makes writers wait, which no statement_timeout ends) while the
    block runs; reads are served. Then the standby is no longer required and the waits end."""

    def standby(name: str) -> None:
        with psycopg.connect(conninfo, autocommit=True) as admin:
            admin.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{name}'")
            admin.execute("SELECT pg_reload_conf()")
        for _ in range(200):  # the reload reaches new sessions within moments
            with psycopg.connect(conninfo, autocommit=True) as probe:
                row = probe.execute("SHOW synchronous_standby_names").fetchone()
            if row is not None and row[0] == name:
                return
            threading.Event().wait(0.02)

    standby("ghost")
    try:
        yield
    finally:
        standby("")


@pytest.fixture
def own_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server of this test's own: the faults below act on the whole server."""
    with PostgresServer() as server:
        yield server


@pytest.mark.timeout(90)  # the loop held for as long as the database takes: the test fails here
@pytest.mark.anyio
async def test_a_write_the_database_does_not_finish_holds_the_loop_no_longer_than_the_write_timeout(
    own_server: PostgresServer,
) -> None:
    """Issue 30: "no database call on the event loop without a bound". A create is written on the
    loop (it is one step there, so that no request sees a stream half made); when its commit waits
    in the database without end, the loop, and with it every client, waited too. Now the call runs
    in a worker thread and the loop waits for it at most ``write_timeout``: the create is answered
    503 ``outcome_unknown`` (its commit may still land), the store refuses further writes and tells
    its holder (``on_unsure``: the leader steps down), and the other clients are served again."""
    fs = PgFileSystem(own_server.conninfo(), read_timeout=READ_TIMEOUT, write_timeout=0.5)
    told: list[str] = []
    fs.on_unsure = told.append
    fs.mkdir(ROOT)
    try:
        async with served_on(fs, ROOT / "data") as c:
            assert (await c.put("/v1/stream/ready", content=b"kept", headers=OCTETS)).status_code == 201
            with commits_hang(own_server.conninfo()):
                create = asyncio.ensure_future(c.put("/v1/stream/new", headers=OCTETS))
                read = await c.get("/v1/stream/ready", params={"offset": "-1"})  # from memory
                answer = await create
            assert read.status_code == 200 and read.content == b"kept"
            assert answer.status_code == 503, answer.text
            error = answer.json()["error"]
            assert error["code"] == "outcome_unknown" and "write_timeout" in error["message"], error
            assert told and "write_timeout" in told[0], told
            # and nothing more is written by this server: its memory may disagree with the database
            refused = await c.post("/v1/stream/ready", content=b"more", headers=OCTETS)
            assert refused.status_code == 503, refused.text
    finally:
        fs.close()


@pytest.mark.timeout(90)  # the loop held for as long as the database is frozen: the test fails here
def test_a_cold_read_from_a_frozen_database_ends_at_the_read_timeout(own_server: PostgresServer) -> None:
    """A database that is frozen (SIGSTOP, a paused VM) accepts the connection's bytes and answers
    nothing, so its statement_timeout never fires: the read's bound is kept on this side."""
    fs = PgFileSystem(own_server.conninfo(), read_timeout=READ_TIMEOUT)
    try:
        fs.mkdir(ROOT)
        f = cast(PgFile, fs.open_file(ROOT / "old.log", create=True))
        blob = bytes(range(256)) * (TAIL_CACHE // 256)
        for i in range(2):  # twice the memory cache: the first half is read from the database
            f.pwrite(blob, i * len(blob))
            f.sync()

        async def on_a_loop() -> bytes:
            return f.pread(100, 0)  # as the server reads: synchronously, on its event loop's thread

        assert own_server.node is not None
        own_server.node.signal(signal.SIGSTOP)
        try:
            with pytest.raises(OSError) as raised:
                asyncio.run(on_a_loop())
        finally:
            own_server.node.signal(signal.SIGCONT)
        assert raised.value.errno == errno.ETIMEDOUT and "read_timeout" in str(raised.value), raised.value
        assert f.pread(100, 0) == blob[:100]  # the store works again once the database does
    finally:
        fs.close()


@pytest.mark.anyio
async def test_a_subscription_whose_file_cannot_be_read_at_start_is_not_dropped(fs: PgFileSystem) -> None:
    """Found by review: a leader's start read each subscription's file on the event loop, and a
    read that failed or timed out (a slow database, as often at a takeover) skipped it as if the
    file were corrupt: the subscription was answered 404 and a client's PUT wrote over its stored
    state (its links, generation and uid). Now a file that cannot be read fails the start (a leader
    steps down and the next try reads it), and the leader reads them in a worker thread."""
    subs = "/v1/stream/__ds/subscriptions"
    config = {"type": "pull-wake", "pattern": "events/**", "wake_stream": "wake/a"}

    async def serving() -> tuple[Broker, App]:
        broker = Broker(ROOT / "data", fs=fs)
        await asyncio.get_running_loop().run_in_executor(None, broker.open)
        await broker.start()
        return broker, App(broker, AppConfig(long_poll_timeout=0.2))

    broker, app = await serving()
    app.subscriptions.start()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.put(f"{subs}/s1", json=config)).status_code == 201
        assert (await c.post(f"{subs}/s1/streams", json={"streams": ["other/x"]})).status_code in (200, 204)
        before = (await c.get(f"{subs}/s1")).json()
    await app.subscriptions.close()
    await broker.close()

    broker, app = await serving()  # the next leader; its database stalls while it starts
    with chunks_locked(fs.conninfo), pytest.raises(OSError):
        app.subscriptions.start()  # on the loop: bounded, and a failure, not a skipped file
    await broker.close()

    broker, app = await serving()
    await asyncio.get_running_loop().run_in_executor(None, app.subscriptions.load)  # as a leader does
    app.subscriptions.start()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        after = await c.get(f"{subs}/s1")
    await app.subscriptions.close()
    await broker.close()
    assert after.status_code == 200 and after.json() == before, (before, after.text)
