"""A COMMIT whose answer is lost (issue 30, items 1 and 2; fault table row 18): the database may
have committed, the store cannot tell from the broken connection. It must learn the truth before
anyone is answered: a write that committed is acknowledged, one that did not is refused, and a
recovery on another server agrees with every answer given.

The fault is real: a proxy that reads PostgreSQL's wire protocol sits between the store and the
database and swallows the answer to one chosen ``COMMIT`` (``"answer"``: the database committed),
or closes the connection just before it (``"request"``: the database rolled back).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers.servers import served_on

pytest.importorskip("psycopg_pool", reason="the PostgreSQL store needs psycopg_pool (onceflow[postgresql])")

from onceflow.storage.fs import OutcomeUnknown  # noqa: E402
from onceflow.storage.pgfs import PgFileSystem  # noqa: E402
from onceflow.testing.pgproxy import PgFaultProxy  # noqa: E402
from onceflow.testing.services import PostgresServer  # noqa: E402

ROOT = Path("/onceflow")
URL = "http://testserver"
JSON = {"Content-Type": "application/json"}


@pytest.fixture
def proxy(postgres_server: PostgresServer) -> Iterator[PgFaultProxy]:
    with PgFaultProxy(postgres_server.port) as p:
        yield p


@pytest.fixture
def through(pg: str, proxy: PgFaultProxy) -> Iterator[PgFileSystem]:
    """The store as a leader sees it: every connection through the fault proxy."""
    dbname = re.search(r"dbname=(\w+)", pg)
    assert dbname is not None
    fs = PgFileSystem(proxy.conninfo(dbname.group(1), user="postgres"), connect_timeout=5)
    fs.mkdir(ROOT)
    yield fs
    fs.close()


def served(fs: PgFileSystem, *, crash: bool = False) -> contextlib.AbstractAsyncContextManager[httpx.AsyncClient]:
    """A server on ``fs`` (helpers.servers.served_on), its data under /onceflow/data."""
    return served_on(fs, ROOT / "data", crash=crash)


def chunk_write(sql: str) -> bool:
    return "INSERT INTO onceflow_chunks" in sql


def a_move(sql: str) -> bool:
    return "UPDATE onceflow_files SET path" in sql


async def recovered(pg: str) -> tuple[int, list[object]]:
    """What a new leader, recovering from the database directly, serves of stream ``s``."""
    other = PgFileSystem(pg)
    try:
        async with served(other) as c:
            r = await c.get("/v1/stream/s", params={"offset": "-1"})
            return r.status_code, (r.json() if r.status_code == 200 else [])
    finally:
        other.close()


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["answer", "request"])
async def test_an_append_whose_commit_answer_is_lost_is_answered_as_what_happened(
    through: PgFileSystem, proxy: PgFaultProxy, pg: str, how: str
) -> None:
    """Item 2: the append was refused "not stored" although its COMMIT landed; a plain retry stored
    it twice, and a new leader served the refused copy. Now the store reads back what the broken
    transaction did: committed, the append is acknowledged; rolled back, it is refused, truly."""
    async with served(through, crash=True) as c:
        assert (await c.put("/v1/stream/s", headers=JSON)).status_code == 201
        assert (await c.post("/v1/stream/s", content=b'[{"m": 0}]', headers=JSON)).is_success
        proxy.arm(chunk_write, how)  # type: ignore[arg-type]
        r = await c.post("/v1/stream/s", content=b'[{"m": 1}]', headers=JSON)
        assert proxy.lost == 1
        if how == "answer":
            assert r.is_success, r.text  # it is stored: so it is acknowledged
        else:
            assert r.status_code == 503 and "not stored" in r.text, r.text
        served_then = (await c.get("/v1/stream/s", params={"offset": "-1"})).json()
    # the old leader dies before it syncs that file again: the next one holds what the answer said
    status, got = await recovered(pg)
    want = [{"m": 0}, {"m": 1}] if how == "answer" else [{"m": 0}]
    assert served_then == want
    assert (status, got) == (200, want)


@pytest.mark.anyio
@pytest.mark.parametrize("how", ["answer", "request"])
async def test_a_delete_whose_commit_answer_is_lost_loses_no_later_append(
    through: PgFileSystem, proxy: PgFaultProxy, pg: str, how: str
) -> None:
    """Item 1: the move to the trash committed, its answer was lost, the delete was refused "not
    stored" and the stream served on from memory; appends acknowledged after it went into files
    now in the trash, and the next recovery emptied the trash: acknowledged data lost. Now the
    delete is answered as what happened, and nothing acknowledged afterwards is lost."""
    async with served(through, crash=True) as c:
        assert (await c.put("/v1/stream/s", headers=JSON)).status_code == 201
        assert (await c.post("/v1/stream/s", content=b'[{"m": 0}]', headers=JSON)).is_success
        proxy.arm(a_move, how)  # type: ignore[arg-type]
        deleted = await c.delete("/v1/stream/s")
        assert proxy.lost == 1
        later = await c.post("/v1/stream/s", content=b'[{"m": 1}]', headers=JSON)
    status, got = await recovered(pg)
    if how == "answer":
        assert deleted.status_code == 204, deleted.text
        assert later.status_code == 404
        assert status == 404
    else:
        assert deleted.status_code == 503 and "not stored" in deleted.text, deleted.text
        assert later.is_success
        assert (status, got) == (200, [{"m": 0}, {"m": 1}])


def test_a_lost_answer_of_a_directory_operation_is_resolved_by_reading_back(
    through: PgFileSystem, proxy: PgFaultProxy
) -> None:
    """The file system's own contract, below the broker: a rename, an unlink, a replace_file and a
    sync whose COMMIT answer was lost return normally when the database holds their work, and
    raise (a definite failure, not :class:`OutcomeUnknown`) when it does not."""
    through.mkdir(ROOT / "d")
    proxy.arm(a_move, "answer")
    through.rename(ROOT / "d", ROOT / "e")
    assert through.exists(ROOT / "e") and not through.exists(ROOT / "d")
    proxy.arm(a_move, "request")
    with pytest.raises(OSError) as caught:
        through.rename(ROOT / "e", ROOT / "f")
    assert not isinstance(caught.value, OutcomeUnknown)
    assert through.exists(ROOT / "e") and not through.exists(ROOT / "f")
    proxy.arm(lambda sql: "INSERT INTO onceflow_chunks" in sql, "answer")
    through.replace_file(ROOT / "e" / "meta", b"v1")
    assert through.read_bytes(ROOT / "e" / "meta") == b"v1"
    f = through.open_file(ROOT / "e" / "log", create=True)
    f.pwrite(b"abc", 0)
    proxy.arm(chunk_write, "request")
    with pytest.raises(OSError):
        f.sync()
    proxy.arm(chunk_write, "answer")
    f.sync()  # the pending bytes again: this time it lands, and the lost answer is read back
    assert proxy.lost == 5 and proxy.armed == 0
    assert PgFileSystem(through.conninfo).read_bytes(ROOT / "e" / "log") == b"abc"


@pytest.mark.anyio
async def test_an_outcome_that_cannot_be_learned_is_answered_unknown_and_ends_the_writing(
    through: PgFileSystem, proxy: PgFaultProxy, pg: str
) -> None:
    """The database committed, the answer was lost, and the database cannot be reached to read it
    back until the store gives up (:attr:`PgFileSystem.alive`: for a leader, its lease's validity).
    The append is answered ``outcome_unknown`` (never "not stored": the next leader serves it), the
    store refuses every later write, and its holder is told once, to step down."""
    told: list[str] = []
    through.on_unsure = told.append
    async with served(through, crash=True) as c:
        assert (await c.put("/v1/stream/s", headers=JSON)).status_code == 201
        assert (await c.post("/v1/stream/s", content=b'[{"m": 0}]', headers=JSON)).is_success
        through.alive = lambda: False  # the lease ran out meanwhile: one attempt to read back, no more
        proxy.arm(chunk_write, "answer", then_down=True)
        r = await c.post("/v1/stream/s", content=b'[{"m": 1}]', headers=JSON)
        assert r.status_code == 503 and r.json()["error"]["code"] == "outcome_unknown", r.text
        proxy.down = False  # the database is back: this store still writes nothing
        later = await c.post("/v1/stream/s", content=b'[{"m": 2}]', headers=JSON)
        assert later.status_code == 503 and "outcome" in later.text
    assert len(told) == 1 and "unknown" in told[0]
    status, got = await recovered(pg)
    assert (status, got) == (200, [{"m": 0}, {"m": 1}])  # it had been stored: "unknown" was the truth


def test_the_commit_counts_of_servers_that_are_gone_are_forgotten_by_the_next_leader(pg: str) -> None:
    """Every connection has a row in ``onceflow_commits``; a server that took the lease removes
    those of servers with no connection left (their number would grow with every restart), and
    keeps the rows of servers still connected (a follower, or a deposed leader reading back)."""
    import psycopg

    def sessions() -> set[str]:
        with psycopg.connect(pg) as conn:
            return {r[0] for r in conn.execute("SELECT session FROM onceflow_commits").fetchall()}

    gone, alive = PgFileSystem(pg), PgFileSystem(pg)
    gone.close()
    leader = PgFileSystem(pg)
    try:
        assert {gone.session, alive.session, leader.session} <= sessions()
        assert leader.acquire("me", None, 5.0) is not None
        assert sessions() == {alive.session, leader.session}
    finally:
        alive.close()
        leader.close()
