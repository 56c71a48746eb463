"""The store's lease under load and under clocks that jump (issue 30, items 4, 6 and 10; fault table
rows 19 and 20): the leader's own writes and a busy pool never hold its renewal up, and a follower
takes the lease by its own clock's count of a term without renewals, never by the database's wall
clock, which may jump."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("psycopg_pool", reason="the PostgreSQL store needs psycopg_pool (onceflow[postgresql])")

import psycopg  # noqa: E402

from onceflow.storage.pgfs import LeaseLost, PgFileSystem  # noqa: E402

ROOT = Path("/onceflow")
LIVENESS = 20.0  # seconds: a bound on a wait that must end, not a measurement
TERM = 2.0  # the leader's term in these tests (a follower waits at least the holder's)


@pytest.fixture
def leader(pg: str) -> Iterator[PgFileSystem]:
    fs = PgFileSystem(pg, pool_size=1)
    token = fs.acquire("leader", "http://a", TERM)
    assert token == 1
    fs.token = token
    fs.mkdir(ROOT)
    yield fs
    fs.close()


def in_thread(fn: object) -> tuple[threading.Thread, list[object]]:
    got: list[object] = []

    def run() -> None:
        try:
            got.append(fn())  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            got.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, got


def test_a_renewal_waits_neither_for_the_leaders_writes_nor_for_its_busy_pool(leader: PgFileSystem) -> None:
    """Item 4: every fenced write held the lease's row ``FOR SHARE`` until it committed, and the
    renewal, an UPDATE of that row, queued behind them (16 MiB syncs held one up 11 s; with a 3 s
    term the leader stepped down under its own load). And the renewal took a connection from the
    pool that the writes use. Here a write is in the middle of its transaction, holding the pool's
    only connection, while the lease is renewed."""
    with leader._tx("a write in progress") as cur:
        cur.execute("SELECT 1")
        renewing, got = in_thread(lambda: leader.renew(1, 30.0))
        renewing.join(LIVENESS)
        assert not renewing.is_alive(), "the renewal waited for the leader's own write"
    assert got == [True]


def test_a_takeover_still_waits_for_the_old_leaders_write_in_flight(leader: PgFileSystem, pg: str) -> None:
    """What the row lock is for: a write that read the old token commits before the new leader's
    token does (the new leader's recovery sees it), or reads the new token and is refused; never
    committed after the takeover, unseen by the new leader."""
    follower = PgFileSystem(pg)
    try:
        f = leader.open_file(ROOT / "w.log", create=True)
        f.pwrite(b"in flight", 0)
        inside, resume = threading.Event(), threading.Event()
        check = leader._lease_check

        def paused_after_the_token(conn: object) -> object:
            cur = check(conn)
            inside.set()
            resume.wait(LIVENESS)
            return cur

        leader._lease_check = paused_after_the_token  # type: ignore[method-assign]
        syncing, synced = in_thread(f.sync)
        assert inside.wait(LIVENESS)
        with psycopg.connect(pg, autocommit=True) as db:
            db.execute("UPDATE onceflow_lease SET expires = clock_timestamp() - interval '1 hour'")
        taking, taken = in_thread(lambda: take(follower, term=4.0))
        with psycopg.connect(pg, autocommit=True) as watch:  # a term later, the takeover waits for the write
            waiting = "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            deadline = time.monotonic() + LIVENESS
            while watch.execute(waiting).fetchone() is None and time.monotonic() < deadline:
                time.sleep(0.01)
        assert taken == []
        resume.set()
        syncing.join(LIVENESS)
        taking.join(LIVENESS)
        assert taken == [2]
        assert synced == [None]  # it held the row: it committed first, before the token moved
        assert PgFileSystem(pg).read_bytes(ROOT / "w.log") == b"in flight"
        with pytest.raises(LeaseLost):  # and after it, nothing more of the old leader's
            leader.mkdir(ROOT / "late")
    finally:
        follower.close()


def take(fs: PgFileSystem, *, term: float) -> int | None:
    """As a follower does: acquire again and again, until it holds the lease."""
    deadline = time.monotonic() + LIVENESS
    while time.monotonic() < deadline:
        token = fs.acquire("follower", "http://b", term)
        if token is not None:
            return token
        time.sleep(0.05)
    return None


def test_a_forward_step_of_the_databases_clock_hands_no_lease_over(leader: PgFileSystem, pg: str) -> None:
    """Item 6: the term's end was judged by the database's clock: stepped forward past it, a
    follower took the lease at once while the leader, by its own clock, still led (and served
    reads that missed the new leader's appends). Now a follower takes it only once it saw no
    renewal for a whole term by its own clock. The step is made as the database sees it: the
    lease's end is in the past while its row has not changed."""
    follower = PgFileSystem(pg)
    try:
        with psycopg.connect(pg, autocommit=True) as db:
            db.execute("UPDATE onceflow_lease SET expires = clock_timestamp() - interval '1 hour'")
        for _ in range(5):
            assert follower.acquire("follower", "http://b", 30.0) is None
        assert leader.renew(1, TERM)
        # a leader that stops renewing (dead) is replaced once a term went by on the follower's clock
        assert take(follower, term=0.5) == 2
    finally:
        follower.close()


def test_a_released_lease_is_taken_at_once(leader: PgFileSystem, pg: str) -> None:
    """A clean stop gives the lease up: the next server need not wait a term for it."""
    follower = PgFileSystem(pg)
    try:
        assert follower.acquire("follower", "http://b", 30.0) is None
        leader.release(1)
        assert follower.acquire("follower", "http://b", 30.0) == 2
        assert not leader.renew(1, 30.0)
    finally:
        follower.close()


def test_a_follower_counts_its_term_from_after_it_read_the_lease(pg: str) -> None:
    """Found by review: the follower read its clock before reading the row. A renewal committed
    while the read waited (for a pool connection, a reconnect, a pause) was dated from before it
    began, and the follower took the lease while the old leader's was valid."""
    from onceflow.server.leader import Lease, _clock

    term = 2.0
    leader, follower = PgFileSystem(pg), PgFileSystem(pg)
    try:
        began = _clock()
        token = leader.acquire("leader", "http://a", term)
        assert token == 1
        lease = Lease(token, term, began)
        real_tx, first = follower._tx, [True]

        @contextlib.contextmanager
        def slow_read(what: str, **kw: bool) -> Iterator[object]:
            if what == "read the lease" and first[0]:  # the first read waits; the leader renews meanwhile
                first[0] = False
                time.sleep(1.0)
                renewal = _clock()
                assert leader.renew(token, term)
                lease.renewed(renewal)
            with real_tx(what, **kw) as cur:
                yield cur

        follower._tx = slow_read  # type: ignore[method-assign]
        assert take(follower, term=term) == 2
        assert not lease.valid(), f"both lead: the old leader's lease is valid {lease.until - _clock():.2f} s more"
    finally:
        leader.close()
        follower.close()


def test_a_follower_with_a_shorter_term_waits_for_the_holders(pg: str) -> None:
    """Found by review: a follower waited its own term only. With another ``--lease-seconds`` than
    the holder's (a rolling upgrade across the change of the default from 10 to 3 s), it took the
    lease while the holder still served. The holder writes its term in the row now."""
    from onceflow.server.leader import Lease, _clock

    leader, follower = PgFileSystem(pg), PgFileSystem(pg)
    try:
        began = _clock()
        token = leader.acquire("old", "http://a", 4.0)
        assert token == 1
        lease = Lease(token, 4.0, began)
        assert take(follower, term=1.0) == 2
        assert not lease.valid(), f"both lead: the old leader's lease is valid {lease.until - _clock():.2f} s more"
    finally:
        leader.close()
        follower.close()


def test_a_holder_that_does_not_say_its_term_is_given_the_old_default(pg: str) -> None:
    """A lease taken by a server from before holders said their term (its name has no ``term=``),
    even over a row whose previous holder said one: a follower waits the old default term (10 s),
    never its own shorter one, nor the previous holder's (found by review: a term column that old
    servers did not write was inherited from the holder before)."""
    leader, follower = PgFileSystem(pg), PgFileSystem(pg)
    try:
        assert leader.acquire("new", "http://a", 1.0) == 1  # says term=1
        with psycopg.connect(pg, autocommit=True) as db:  # an old server takes it over, as it did
            db.execute("UPDATE onceflow_lease SET token = token + 1, holder = 'old/123/abc'")
        assert follower.acquire("new", "http://b", 0.2) is None  # first seen
        time.sleep(1.5)
        assert follower.acquire("new", "http://b", 0.2) is None  # its own term and the previous one's passed
    finally:
        leader.close()
        follower.close()


def test_a_renewal_that_lands_after_a_release_does_not_take_it_back(leader: PgFileSystem, pg: str) -> None:
    """Found by review: a renewal in flight at a clean stop could land after the release, and the
    next server then waited a whole term instead of taking the lease at once."""
    leader.release(1)
    assert not leader.renew(1, TERM)
    follower = PgFileSystem(pg)
    try:
        assert follower.acquire("follower", "http://b", TERM) == 2
    finally:
        follower.close()


def test_a_store_in_a_schema_of_its_own_keeps_it_on_every_connection(pg: str) -> None:
    """Found by review: the lease's and the read-back's own connections set ``options``, which
    replaced the user's (``-c search_path=...``): they worked on other tables than the pool's."""
    with psycopg.connect(pg, autocommit=True) as db:
        db.execute("CREATE SCHEMA streams_here")
    fs = PgFileSystem(f"{pg} options='-c search_path=streams_here'")
    try:
        token = fs.acquire("me", None, 5.0)
        assert token == 1
        assert fs.renew(token, 5.0)
        with psycopg.connect(pg) as db:
            tables = {r[0] for r in db.execute("SELECT schemaname FROM pg_tables WHERE tablename = 'onceflow_lease'")}
        assert tables == {"streams_here"}
    finally:
        fs.close()
