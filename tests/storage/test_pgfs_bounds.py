"""The PostgreSQL store's reads on the event loop are bounded (issue 30, items 3 and 5): a read of
bytes older than the memory cache goes to the database on the loop, so a statement stuck there (a
lock, a failover, an overloaded primary) must end at the store's ``read_timeout`` with an error that
says so, and a client is answered 503 (retry), never a 500, nor a loop held for as long as the
database takes."""

from __future__ import annotations

import asyncio
import errno
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import pytest

from helpers.servers import served_on

pytest.importorskip("psycopg_pool", reason="the PostgreSQL store needs psycopg_pool (onceflow[postgresql])")

import psycopg  # noqa: E402

from onceflow.storage.pgfs import TAIL_CACHE, PgFile, PgFileSystem  # noqa: E402

ROOT = Path("/onceflow")
READ_TIMEOUT = 0.3  # seconds: short, so that the tests below end soon once it works


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
