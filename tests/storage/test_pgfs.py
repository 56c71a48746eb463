"""The PostgreSQL store's file system (storage/pgfs.py): the FileSystem contract the logs rely on,
what survives a crash of the process (only what was synced), fencing by the lease's token, and the
whole broker run on it: data, producer state and transactions survive a restart on another process's
file system instance (a second server taking over)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.servers import served_on

pytest.importorskip("psycopg_pool", reason="the PostgreSQL store needs psycopg_pool (onceflow[postgresql])")

from onceflow.client.transactions import AsyncTransactionalProducer  # noqa: E402
from onceflow.storage.pgfs import TAIL_CACHE, LeaseLost, PgFile, PgFileSystem  # noqa: E402

ROOT = Path("/onceflow")
URL = "http://testserver"
JSON = {"Content-Type": "application/json"}
_files = itertools.count()


@pytest.fixture
def fs(pg: str) -> Iterator[PgFileSystem]:
    f = PgFileSystem(pg)
    f.mkdir(ROOT)
    yield f
    f.close()


def again(fs: PgFileSystem) -> PgFileSystem:
    """Another process's view of the same database (what a restarted or second server sees)."""
    return PgFileSystem(fs.conninfo)


def test_the_servers_share_one_secret_also_on_a_store_made_before_its_table(fs: PgFileSystem) -> None:
    """The secret that seals the headers a follower passes on lives in the store's schema; a store
    made by a version without its table gets it at the next start, and every server reads the same."""
    import psycopg

    with psycopg.connect(fs.conninfo, autocommit=True) as admin:
        admin.execute("DROP TABLE onceflow_cluster")  # as a store made before it
    first, second = again(fs), again(fs)
    try:
        secret = first.cluster_secret()
        assert len(secret) == 32 and second.cluster_secret() == secret == fs.cluster_secret()
    finally:
        first.close()
        second.close()


def test_a_role_with_data_access_only_opens_a_store_made_for_it(fs: PgFileSystem) -> None:
    """Found by review: the start's upgrade ran CREATE TABLE IF NOT EXISTS, which PostgreSQL refuses
    without CREATE on the schema even when the table exists; since PostgreSQL 15 ordinary roles
    have none on ``public``, so a server whose role may only use the store's tables never started."""
    import psycopg

    role = f"app{next(_files)}"
    with psycopg.connect(fs.conninfo, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
        admin.execute(f"GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA public TO {role}")
        admin.execute(f"REVOKE CREATE ON SCHEMA public FROM PUBLIC, {role}")
    opened = PgFileSystem(fs.conninfo.replace("user=postgres", f"user={role}"))
    try:
        assert len(opened.cluster_secret()) == 32
        f = opened.open_file(ROOT / "by-app.log", create=True)
        f.pwrite(b"ok", 0)
        f.sync()
    finally:
        opened.close()


def test_synced_bytes_survive_and_unsynced_ones_do_not(fs: PgFileSystem) -> None:
    f = fs.open_file(ROOT / "a.log", create=True)
    f.pwrite(b"hello ", 0)
    f.pwrite(b"world", 6)
    f.sync()
    f.pwrite(b" and more", 11)  # never synced: a crash loses it, as a power loss loses unsynced pages
    assert f.pread(100, 0) == b"hello world and more"
    other = again(fs)
    try:
        g = other.open_file(ROOT / "a.log", create=False)
        assert g.size() == 11
        assert g.pread(100, 0) == b"hello world"
        assert g.pread(5, 6) == b"world"
    finally:
        other.close()


def test_truncate_and_rewrite_replace_the_tail_durably(fs: PgFileSystem) -> None:
    f = fs.open_file(ROOT / "t.log", create=True)
    f.pwrite(b"0123456789", 0)
    f.sync()
    f.pwrite(b"abcdef", 10)
    f.sync()
    f.truncate(4)  # a torn tail cut off by recovery, then written again
    f.pwrite(b"XY", 4)
    f.sync()
    assert f.pread(100, 0) == b"0123XY"
    other = again(fs)
    try:
        assert other.open_file(ROOT / "t.log", create=False).pread(100, 0) == b"0123XY"
        assert other.read_bytes(ROOT / "t.log") == b"0123XY"
    finally:
        other.close()


def test_a_write_inside_durable_bytes_keeps_those_around_it(fs: PgFileSystem) -> None:
    f = fs.open_file(ROOT / "m.log", create=True)
    f.pwrite(b"a" * 100, 0)
    f.sync()
    f.pwrite(b"b" * 100, 100)
    f.sync()
    f.pwrite(b"XX", 50)
    assert f.pread(4, 49) == b"aXXa"
    f.sync()
    other = again(fs)
    try:
        got = other.open_file(ROOT / "m.log", create=False).pread(300, 0)
    finally:
        other.close()
    assert got == b"a" * 50 + b"XX" + b"a" * 48 + b"b" * 100


def test_reads_beyond_the_memory_cache_come_from_the_database(fs: PgFileSystem) -> None:
    f = fs.open_file(ROOT / "big.log", create=True)
    blob = bytes(range(256)) * (TAIL_CACHE // 256 // 4)
    at = 0
    for _ in range(6):  # 1.5x the cache
        f.pwrite(blob, at)
        f.sync()
        at += len(blob)
    assert f.pread(len(blob), 0) == blob  # long evicted from memory
    assert f.pread(10, len(blob) - 5) == blob[-5:] + blob[:5]  # across two chunks
    assert f.pread(10, at - 4) == blob[-4:]  # short at the end
    assert f.pread(10, at + 10) == b""


def test_a_failed_sync_keeps_its_bytes_pending_and_the_next_sync_writes_them(fs: PgFileSystem) -> None:
    f = fs.open_file(ROOT / "x.log", create=True)
    f.pwrite(b"first", 0)
    f.sync()
    f.pwrite(b"second", 5)
    fs.token = 7  # fenced with a token the lease does not hold (there is no lease row): refused
    with pytest.raises(OSError) as caught:
        f.sync()
    assert isinstance(caught.value, LeaseLost)
    fs.token = None
    f.sync()
    other = again(fs)
    try:
        assert other.read_bytes(ROOT / "x.log") == b"firstsecond"
    finally:
        other.close()


def test_a_server_that_lost_the_lease_can_write_nothing(fs: PgFileSystem) -> None:
    import psycopg

    with psycopg.connect(fs.conninfo, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO onceflow_lease (id, token, holder, expires) VALUES (1, 1, 'one', now() + interval '1 min')"
        )
    fs.token = 1
    f = fs.open_file(ROOT / "l.log", create=True)
    f.pwrite(b"mine", 0)
    f.sync()
    fs.mkdir(ROOT / "kept")
    with psycopg.connect(fs.conninfo, autocommit=True) as conn:  # another server takes over
        conn.execute("UPDATE onceflow_lease SET token = 2, holder = 'two'")
    f.pwrite(b" zombie", 4)
    for write in (
        f.sync,
        lambda: fs.replace_file(ROOT / "snap", b"{}"),
        lambda: fs.mkdir(ROOT / "d"),
        lambda: fs.unlink(ROOT / "l.log"),
        lambda: fs.rename(ROOT / "l.log", ROOT / "m.log"),
        lambda: fs.open_file(ROOT / "new.log", create=True),
    ):
        with pytest.raises(LeaseLost, match="took over"):
            write()
    fs.rmtree(ROOT / "kept")  # best effort: refused quietly
    fs.token = None
    assert fs.read_bytes(ROOT / "l.log") == b"mine"
    assert fs.exists(ROOT / "kept")
    assert not fs.exists(ROOT / "snap") and not fs.exists(ROOT / "d") and not fs.exists(ROOT / "new.log")


def test_directories_behave_as_the_logs_expect(fs: PgFileSystem) -> None:
    fs.mkdir(ROOT / "streams" / "a%b_c")  # names with LIKE's wildcards in them
    fs.mkdir(ROOT / "streams" / "ab")
    fs.replace_file(ROOT / "streams" / "a%b_c" / "meta.json", b'{"x": 1}')
    f = fs.open_file(ROOT / "streams" / "a%b_c" / "0.log", create=True)
    f.pwrite(b"data", 0)
    f.sync()
    assert sorted(fs.listdir(ROOT / "streams")) == ["a%b_c", "ab"]
    assert sorted(fs.listdir(ROOT / "streams" / "a%b_c")) == ["0.log", "meta.json"]
    with pytest.raises(FileNotFoundError):
        fs.open_file(ROOT / "nowhere" / "x", create=True)
    with pytest.raises(FileNotFoundError):
        fs.open_file(ROOT / "streams" / "missing", create=False)
    with pytest.raises(FileNotFoundError):
        fs.read_bytes(ROOT / "missing")
    # a directory renamed (a deleted stream goes to the trash) takes what it holds with it
    fs.mkdir(ROOT / "trash")
    fs.rename(ROOT / "streams" / "a%b_c", ROOT / "trash" / "1")
    assert fs.listdir(ROOT / "streams") == ["ab"]
    assert fs.read_bytes(ROOT / "trash" / "1" / "meta.json") == b'{"x": 1}'
    assert fs.open_file(ROOT / "trash" / "1" / "0.log", create=False).pread(10, 0) == b"data"
    fs.rmtree(ROOT / "trash" / "1")
    assert fs.listdir(ROOT / "trash") == []
    assert fs.exists(ROOT / "streams" / "ab")
    # replace_file replaces, rename of a file onto another replaces it
    fs.replace_file(ROOT / "streams" / "ab" / "s", b"one")
    fs.replace_file(ROOT / "streams" / "ab" / "s", b"two")
    fs.replace_file(ROOT / "streams" / "ab" / "t", b"three")
    fs.rename(ROOT / "streams" / "ab" / "t", ROOT / "streams" / "ab" / "s")
    assert fs.read_bytes(ROOT / "streams" / "ab" / "s") == b"three"
    fs.unlink(ROOT / "streams" / "ab" / "s")
    fs.unlink(ROOT / "streams" / "ab" / "s")  # missing is fine
    assert not fs.exists(ROOT / "streams" / "ab" / "s")
    fs.mkdir(ROOT / "full" / "x")
    with pytest.raises(OSError) as caught:
        fs.rename(ROOT / "streams", ROOT / "full")  # onto a directory that is not empty
    assert caught.value.errno == errno.ENOTEMPTY
    fs.rename(ROOT / "streams", ROOT / "trash")  # onto an empty one: replaces it
    assert fs.listdir(ROOT / "trash") == ["ab"]
    assert not fs.exists(ROOT / "streams")


def test_a_write_to_a_removed_file_goes_nowhere(fs: PgFileSystem) -> None:
    f = fs.open_file(ROOT / "gone.log", create=True)
    fs.unlink(ROOT / "gone.log")
    f.pwrite(b"late", 0)
    f.sync()
    assert not fs.exists(ROOT / "gone.log")


def served(fs: PgFileSystem, *, crash: bool = False) -> contextlib.AbstractAsyncContextManager[httpx.AsyncClient]:
    """A server on ``fs`` (helpers.servers.served_on), its data under /onceflow/data."""
    return served_on(fs, ROOT / "data", crash=crash)


@pytest.mark.anyio
async def test_the_broker_runs_on_it_and_a_second_server_takes_over_its_state(fs: PgFileSystem) -> None:
    """Data, a producer's dedup state and a committed transaction, as a new leader recovers them."""
    append = {"Content-Type": "application/json", "Producer-Id": "checkout", "Producer-Epoch": "0", "Producer-Seq": "0"}
    async with served(fs) as c:
        for name in ("orders", "audit", "shipped"):
            assert (await c.put(f"/v1/stream/{name}", headers=JSON)).status_code == 201
        assert (await c.post("/v1/stream/orders", content=b'[{"id": 1}]', headers=append)).status_code == 200
        tx = AsyncTransactionalProducer(URL, "copier", client=c)
        await tx.init()
        await tx.append("audit", {"seen": 1})
        await tx.append("shipped", {"id": 1})
        await tx.commit()
        await tx.append("audit", {"seen": "aborted"})
        await tx.abort()

    other = again(fs)
    try:
        async with served(other) as c:
            retry = await c.post("/v1/stream/orders", content=b'[{"id": 1}]', headers=append)
            assert retry.status_code == 204  # through the new leader: a duplicate, not a second copy
            nxt = await c.post("/v1/stream/orders", content=b'[{"id": 2}]', headers={**append, "Producer-Seq": "1"})
            assert nxt.status_code == 200
            orders = (await c.get("/v1/stream/orders", params={"offset": "-1"})).json()
            audit = (await c.get("/v1/stream/audit", params={"offset": "-1", "isolation": "read_committed"})).json()
            shipped = (await c.get("/v1/stream/shipped", params={"offset": "-1"})).json()
    finally:
        other.close()
    assert orders == [{"id": 1}, {"id": 2}]
    assert audit == [{"seen": 1}]
    assert shipped == [{"id": 1}]


@pytest.mark.anyio
async def test_a_second_server_takes_over_subscriptions_and_their_keys(fs: PgFileSystem) -> None:
    """A subscription, its claim (lease and holder), the webhook signing key and the wake-token key
    are in the database too (core/subscriptions.py writes through the broker's file system), so the
    new leader keeps the JWKS receivers fetched and accepts the token the old one issued."""
    subs = "/v1/stream/__ds/subscriptions"
    async with served(fs) as c:
        jwks = (await c.get("/v1/stream/__ds/jwks.json")).json()
        assert (await c.put("/v1/stream/wake", headers=JSON)).status_code == 201
        r = await c.put(f"{subs}/s", json={"type": "pull-wake", "pattern": "orders/*", "wake_stream": "wake"})
        assert r.status_code == 201, r.text
        assert (await c.put("/v1/stream/orders/1", content=b'{"id": 1}', headers=JSON)).status_code == 201
        for _ in range(200):  # the wake is issued in the background
            claim = await c.post(f"{subs}/s/claim", json={"worker": "w1"})
            if claim.status_code == 200:
                break
            await asyncio.sleep(0.02)
        assert claim.status_code == 200, claim.text
        claimed = claim.json()
    names = ["subs", "token.key", "webhook-ed25519.pem"]
    assert sorted(fs.listdir(ROOT / "data" / "subscriptions")) == names  # in the database, not on this machine

    other = again(fs)
    try:
        async with served(other) as c:
            assert (await c.get("/v1/stream/__ds/jwks.json")).json() == jwks
            r = await c.post(f"{subs}/s/claim", json={"worker": "w2"})
            assert r.status_code == 409 and r.json()["error"]["current_holder"] == "w1"
            r = await c.post(
                f"{subs}/s/ack",
                headers={"Authorization": f"Bearer {claimed['token']}"},
                json={"wake_id": claimed["wake_id"], "generation": claimed["generation"], "done": True},
            )
            assert r.status_code == 200, r.text
    finally:
        other.close()


def test_errors_are_oserrors_the_log_understands(pg: str) -> None:
    fs = PgFileSystem(pg)
    fs.close()
    with pytest.raises(OSError) as caught:
        fs.exists(ROOT)
    assert caught.value.errno == errno.EIO


def test_the_memory_cache_of_all_files_stays_within_its_budget(pg: str) -> None:
    fs = PgFileSystem(pg, cache_budget=300_000)
    try:
        fs.mkdir(ROOT)
        files = [cast(PgFile, fs.open_file(ROOT / f"{i}.log", create=True)) for i in range(10)]
        for i, f in enumerate(files):
            f.pwrite(bytes([i]) * 100_000, 0)
            f.sync()
        assert sum(len(f._cache) for f in files) <= 300_000  # the last three written
        assert all(f.pread(100_000, 0) == bytes([i]) * 100_000 for i, f in enumerate(files))  # from the database
        for f in files:
            f.close()
        assert fs._cache_total == 0
    finally:
        fs.close()


def test_chunks_are_compressed_with_lz4_where_the_database_has_it(fs: PgFileSystem) -> None:
    import psycopg

    with psycopg.connect(fs.conninfo) as conn:
        row = conn.execute(
            "SELECT attcompression FROM pg_attribute WHERE attrelid = 'onceflow_chunks'::regclass AND attname = 'data'"
        ).fetchone()
        lz4 = conn.execute(
            "SELECT count(*) FROM pg_settings WHERE name = 'default_toast_compression' AND 'lz4' = ANY(enumvals)"
        ).fetchone()
    assert row is not None and lz4 is not None
    assert row[0] == ("l" if lz4[0] else "")


def test_a_read_of_durable_bytes_does_not_wait_for_a_sync_stuck_in_the_database(fs: PgFileSystem) -> None:
    import threading
    import time

    import psycopg

    f = cast(PgFile, fs.open_file(ROOT / "r.log", create=True))
    f.pwrite(b"durable", 0)
    f.sync()
    f.pwrite(b" pending", 7)
    read: list[bytes] = []
    done = threading.Event()
    with psycopg.connect(fs.conninfo) as blocker, psycopg.connect(fs.conninfo, autocommit=True) as watch:
        # the file's row locked by another transaction: the next sync waits in the database, as a
        # sync does while the primary is gone or the standby is being promoted
        blocker.execute("SELECT 1 FROM onceflow_files WHERE id = %s FOR UPDATE", (f.id,))
        syncing = threading.Thread(target=f.sync)
        syncing.start()
        try:
            while watch.execute(  # until the sync waits for the row lock
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
            ).fetchone() != (1,):
                time.sleep(0.01)

            def read_it() -> None:
                read.append(f.pread(7, 0))
                done.set()

            reader = threading.Thread(target=read_it)
            reader.start()
            answered = done.wait(10)  # a bound, not a goal: the bytes are in memory
        finally:
            blocker.rollback()
            syncing.join()
    reader.join()
    assert answered and read == [b"durable"]


def test_a_follower_blocked_behind_a_paused_leaders_write_takes_the_lease_once_its_term_ran_out(
    fs: PgFileSystem,
) -> None:
    import threading
    import time

    import psycopg

    assert fs.acquire("leader", "http://a", 2.0) == 1
    follower = again(fs)
    got: list[int | None] = []

    def take() -> None:  # as a follower does: again and again (an acquire waits at most 0.5 s for the row)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            token = follower.acquire("follower", "http://b", 2.0)
            if token is not None:
                got.append(token)
                return
            time.sleep(0.05)
        got.append(None)

    try:
        with psycopg.connect(fs.conninfo) as paused, psycopg.connect(fs.conninfo, autocommit=True) as watch:
            # the leader paused (SIGSTOP) inside a write: every write of a fenced PgFileSystem holds the
            # lease's row FOR SHARE until it commits
            paused.execute("SELECT token FROM onceflow_lease WHERE id = 1 FOR SHARE")
            taking = threading.Thread(target=take)
            taking.start()  # within the term: it waits for the row
            while watch.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
            ).fetchone() != (1,):
                time.sleep(0.01)
            while watch.execute("SELECT expires < clock_timestamp() FROM onceflow_lease").fetchone() != (True,):
                time.sleep(0.05)  # the leader's term runs out while it is paused
            paused.rollback()  # it resumes, and its write ends
            taking.join()
    finally:
        follower.close()
    assert got == [2]


def test_a_transaction_left_open_by_a_paused_leader_does_not_keep_the_next_one_out(pg: str) -> None:
    """The leader's sessions end a transaction idle longer than ``idle_timeout`` (SIGSTOP in the
    middle of a write): its row lock on the lease goes with it, and a follower takes the lease."""
    import threading

    leader = PgFileSystem(pg, idle_timeout=0.5)
    follower = PgFileSystem(pg)
    try:
        assert leader.acquire("leader", "http://a", 1.0) == 1
        leader.token = 1
        paused = threading.Event()
        with contextlib.suppress(Exception), leader._pool.connection() as conn:
            conn.execute("SELECT token FROM onceflow_lease WHERE id = 1 FOR SHARE")  # a write, paused here
            paused.set()
            got = None
            for _ in range(100):  # the term (1 s) runs out; the idle transaction is ended after 0.5 s
                got = follower.acquire("follower", "http://b", 1.0)
                if got is not None:
                    break
                time.sleep(0.1)
            assert got == 2
        # the paused leader resumes: its writes are refused
        with pytest.raises(LeaseLost):
            leader.mkdir(ROOT / "late")
    finally:
        leader.close()
        follower.close()


def test_a_sync_that_bytes_below_it_overtook_leaves_them_pending_for_the_next(fs: PgFileSystem) -> None:
    """A truncation (recovery cutting a torn tail) while a sync is in the database: what the sync
    wrote is replaced by the next sync, and appends made meanwhile are kept."""
    import threading

    import psycopg

    f = cast(PgFile, fs.open_file(ROOT / "o.log", create=True))
    f.pwrite(b"0123456789", 0)
    f.sync()
    f.pwrite(b"abcdef", 10)
    with psycopg.connect(fs.conninfo) as blocker, psycopg.connect(fs.conninfo, autocommit=True) as watch:
        blocker.execute("SELECT 1 FROM onceflow_files WHERE id = %s FOR UPDATE", (f.id,))
        syncing = threading.Thread(target=f.sync)
        syncing.start()
        while watch.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
        ).fetchone() != (1,):
            time.sleep(0.01)
        assert f.pread(100, 0) == b"0123456789abcdef"  # reads go on while the sync waits
        f.truncate(12)  # below what the sync is writing
        f.pwrite(b"XY", 12)
        blocker.rollback()
        syncing.join()
    assert f.pread(100, 0) == b"0123456789abXY"
    f.sync()
    other = again(fs)
    try:
        assert other.read_bytes(ROOT / "o.log") == b"0123456789abXY"
    finally:
        other.close()


def test_a_server_starting_neither_waits_for_nor_stalls_the_leaders_writes(fs: PgFileSystem) -> None:
    """A follower (re)starting on a store whose schema exists must not take a table lock: the
    schema's ``CREATE ... IF NOT EXISTS`` took one that waited for every write transaction in
    progress, and every write behind it waited too (a leader stopped inside a sync, or one slow
    commit, stalled the store for all)."""
    import psycopg

    f = fs.open_file(ROOT / "w.log", create=True)
    fs.open_file(ROOT / "slow.log", create=True)
    with psycopg.connect(fs.conninfo) as in_progress:  # a sync of another file, not yet committed
        in_progress.execute("UPDATE onceflow_files SET size = 1 WHERE path = '/onceflow/slow.log'")
        in_progress.execute("DELETE FROM onceflow_chunks WHERE file = -1")  # a sync touches both tables
        started: list[PgFileSystem] = []
        starting = threading.Thread(target=lambda: started.append(PgFileSystem(fs.conninfo)))
        starting.start()
        starting.join(30)  # a liveness bound: not a measurement
        try:
            assert started, "a server's start waited for a write transaction in progress"
            f.pwrite(b"more", 0)
            f.sync()  # and the leader's other writes go on meanwhile
        finally:
            in_progress.rollback()
            starting.join()
            for other in started:
                other.close()


class CommitsThenFails:
    """``write_range`` whose COMMIT reaches the database but whose answer is lost (the connection
    broke during COMMIT): the caller sees an error, the database holds the bytes."""

    def __init__(self, fs: PgFileSystem) -> None:
        self.fs = fs
        self.real = fs.write_range
        self.armed = False

    def __call__(self, f: PgFile, start: int, data: bytes, size: int) -> None:
        self.real(f, start, data, size)
        if self.armed and "streams" in f.path.parts and data:
            self.armed = False
            raise OSError(errno.EIO, "PostgreSQL store: sync failed: connection lost during COMMIT")


@pytest.mark.anyio
@pytest.mark.parametrize("then", ["retry", "other append", "a clean stop", "a crash"])
async def test_a_sync_whose_commit_outcome_is_unknown_lands_once_whatever_follows(
    fs: PgFileSystem, then: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The append is refused although its bytes are in the database. Whatever the old leader does
    next (the producer's retry, another producer's append, nothing until a clean stop or a crash), a
    new leader recovering from the database holds each message exactly once: the producer's retry
    through it is a duplicate when the bytes are still there (the old leader died before it synced
    that file again), else it lands afresh."""
    p = {"Content-Type": "application/json", "Producer-Id": "p", "Producer-Epoch": "0"}
    unknown = CommitsThenFails(fs)
    monkeypatch.setattr(fs, "write_range", unknown)
    async with served(fs, crash=then == "a crash") as c:
        assert (await c.put("/v1/stream/s", headers=JSON)).status_code == 201
        assert (await c.post("/v1/stream/s", content=b'[{"m": 0}]', headers={**p, "Producer-Seq": "0"})).is_success
        unknown.armed = True
        refused = await c.post("/v1/stream/s", content=b'[{"m": 1}]', headers={**p, "Producer-Seq": "1"})
        assert refused.status_code >= 500 and not unknown.armed
        assert (await c.get("/v1/stream/s", params={"offset": "-1"})).json() == [{"m": 0}]
        if then == "retry":
            r = await c.post("/v1/stream/s", content=b'[{"m": 1}]', headers={**p, "Producer-Seq": "1"})
            assert r.status_code == 200
        elif then == "other append":
            assert (await c.post("/v1/stream/s", content=b'[{"q": 1}]', headers=JSON)).is_success
    other = again(fs)
    try:
        async with served(other) as c:
            r = await c.post("/v1/stream/s", content=b'[{"m": 1}]', headers={**p, "Producer-Seq": "1"})
            got = (await c.get("/v1/stream/s", params={"offset": "-1"})).json()
    finally:
        other.close()
    if then == "other append":  # the refused bytes were overwritten: the retry lands afresh
        assert (r.status_code, got) == (200, [{"m": 0}, {"q": 1}, {"m": 1}])
    elif then == "a clean stop":  # its last sync of the file took them out again
        assert (r.status_code, got) == (200, [{"m": 0}, {"m": 1}])
    else:
        assert (r.status_code, got) == (204, [{"m": 0}, {"m": 1}])


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("pwrite"), st.integers(0, 48), st.binary(min_size=1, max_size=24)),
        st.tuples(st.just("truncate"), st.integers(0, 48)),
        st.tuples(st.just("sync"), st.sampled_from(["ok", "ok", "ok", "lost answer", "refused"])),
        st.tuples(st.just("pread"), st.integers(0, 40), st.integers(0, 60)),
        st.tuples(st.just("evict")),
    ),
    max_size=14,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_a_file_reads_as_a_bytearray_would_and_a_sync_makes_the_database_hold_it(
    fs: PgFileSystem, ops: list[tuple[object, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any sequence of writes (inside durable bytes too, past the end), truncations, syncs (some
    failing, with the COMMIT's outcome unknown or not), reads and cache evictions: the file reads as
    a plain bytearray given the same writes, and after each sync that succeeds another server reads
    exactly that from the database. A tail cache of 16 bytes, so that every read mixes the cache, the
    database and the pending bytes."""
    import onceflow.storage.pgfs as pgfs

    monkeypatch.setattr(pgfs, "TAIL_CACHE", 16)
    path = ROOT / f"prop-{next(_files)}.log"
    f = cast(PgFile, fs.open_file(path, create=True))
    real = fs.write_range
    model = bytearray()
    for op in ops:
        if op[0] == "pwrite":
            at, data = cast(int, op[1]), cast(bytes, op[2])
            f.pwrite(data, at)
            if at > len(model):
                model += bytes(at - len(model))
            model[at : at + len(data)] = data
        elif op[0] == "truncate":
            size = cast(int, op[1])
            f.truncate(size)
            del model[size:]
            model += bytes(size - len(model))
        elif op[0] == "sync":
            how = op[1]

            def failing(g: PgFile, start: int, data: bytes, size: int, how: object = how) -> None:
                if how == "lost answer":
                    real(g, start, data, size)
                raise OSError(errno.EIO, f"sync failed ({how})")

            if how == "ok":
                f.sync()
                assert fs.read_bytes(path) == bytes(model)  # what another server would recover
            else:
                monkeypatch.setattr(fs, "write_range", failing)
                try:
                    with contextlib.suppress(OSError):
                        f.sync()
                finally:
                    monkeypatch.setattr(fs, "write_range", real)
        elif op[0] == "pread":
            n, at = cast(int, op[1]), cast(int, op[2])
            assert f.pread(n, at) == bytes(model[at : at + n])
        else:
            f.drop_cache()
        assert f.size() == len(model)
        assert f.pread(100, 0) == bytes(model)
    f.sync()
    assert fs.read_bytes(path) == bytes(model)
    f.close()


def test_rename_and_rmtree_leave_a_sibling_whose_name_extends_theirs_alone(fs: PgFileSystem) -> None:
    for d in ("b", "bc", "b_", "b%"):
        fs.mkdir(ROOT / "x" / d)
        fs.replace_file(ROOT / "x" / d / "f", d.encode())
    fs.mkdir(ROOT / "t")
    fs.rename(ROOT / "x" / "b", ROOT / "t" / "b")
    assert sorted(fs.listdir(ROOT / "x")) == ["b%", "b_", "bc"]
    fs.rmtree(ROOT / "t" / "b")
    fs.rmtree(ROOT / "x" / "b_")
    assert sorted(fs.listdir(ROOT / "x")) == ["b%", "bc"]
    assert [fs.read_bytes(ROOT / "x" / d / "f") for d in ("bc", "b%")] == [b"bc", b"b%"]
    assert fs.listdir(ROOT / "t") == []
    assert "onceflow" in fs.listdir(Path("/"))


def test_a_sync_waiting_for_a_takeover_in_progress_is_refused_once_it_commits(fs: PgFileSystem) -> None:
    """The old leader's sync reads the token FOR KEY SHARE while the new leader's takeover (the row
    locked FOR UPDATE, then the token moved) holds the row: it waits, then reads the new token and
    is refused; nothing of it lands."""
    import psycopg

    token = fs.acquire("a", None, 60.0)
    assert token is not None
    fs.token = token
    f = fs.open_file(ROOT / "race.log", create=True)
    f.pwrite(b"late", 0)
    errors: list[BaseException] = []

    def sync() -> None:
        try:
            f.sync()
        except OSError as exc:
            errors.append(exc)

    with psycopg.connect(fs.conninfo) as takeover:
        takeover.execute("SELECT token FROM onceflow_lease WHERE id = 1 FOR UPDATE")  # as acquire() does
        takeover.execute("UPDATE onceflow_lease SET token = token + 1, holder = 'b'")  # not committed yet
        syncing = threading.Thread(target=sync)
        syncing.start()
        with psycopg.connect(fs.conninfo, autocommit=True) as watch:  # the sync waits for the row
            waiting = "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            while watch.execute(waiting).fetchone() is None:
                time.sleep(0.01)
        takeover.commit()
        syncing.join()
    assert len(errors) == 1 and isinstance(errors[0], LeaseLost)
    fs.token = None
    assert fs.read_bytes(ROOT / "race.log") == b""


def test_a_file_closed_while_it_syncs_leaves_nothing_in_the_cache_budget(
    fs: PgFileSystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream deleted while its log syncs closes the segment under the sync (the delete runs on
    the event loop, the sync in a worker thread): its bytes must not be counted in the budget, and
    the closed file not kept, afterwards."""
    f = cast(PgFile, fs.open_file(ROOT / "closing.log", create=True))
    real = fs.write_range

    def closed_meanwhile(g: PgFile, start: int, data: bytes, size: int) -> None:
        real(g, start, data, size)
        g.close()

    monkeypatch.setattr(fs, "write_range", closed_meanwhile)
    f.pwrite(b"x" * 1000, 0)
    f.sync()
    assert fs._cache_total == 0
    assert f not in fs._cached


def test_a_leader_stopped_in_the_middle_of_a_syncs_pipeline_does_not_keep_the_next_one_out(
    pg: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    term = 1.0
    leader = PgFileSystem(pg, idle_timeout=term / 2)
    follower = PgFileSystem(pg)
    try:
        leader.mkdir(ROOT)
        token = leader.acquire("leader", "http://a", term)
        assert token is not None
        leader.token = token
        f = leader.open_file(ROOT / "p.log", create=True)
        f.pwrite(b"x" * 100_000, 0)
        inside, resume = threading.Event(), threading.Event()
        check = leader._lease_check

        def stopped_here(conn: object) -> object:  # the token's FOR SHARE sent and run, the rest not yet
            cur = check(conn)
            inside.set()
            resume.wait()
            return cur

        monkeypatch.setattr(leader, "_lease_check", stopped_here)

        def sync() -> None:
            with contextlib.suppress(OSError):
                f.sync()

        syncing = threading.Thread(target=sync)
        syncing.start()
        assert inside.wait(30)
        taken: list[int] = []

        def take_over() -> None:
            while not taken:
                got = follower.acquire("follower", "http://b", term)
                if got is not None:
                    taken.append(got)
                else:
                    time.sleep(0.1)

        taker = threading.Thread(target=take_over)
        taker.start()
        try:
            taker.join(10 * term)  # a liveness bound, ten terms: not a measurement
            took_over = not taker.is_alive()
        finally:
            resume.set()
            taker.join()
            syncing.join()
        assert took_over, "no server could take the lease over while its holder was stopped inside a sync"
    finally:
        leader.close()
        follower.close()
