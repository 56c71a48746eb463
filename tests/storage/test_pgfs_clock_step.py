"""A step of the database's real wall clock (issue 30, item 6; fault table row 20), made with
libfaketime (Debian's ``faketime``, which ``scripts/setup.sh dev`` installs) on a PostgreSQL of
its own: the database's clock jumps 12 s ahead while the leader renews its 2 s lease. Before,
the lease's end was judged by that clock, and the follower took the lease at once while the
leader, by its own clock, still served reads that missed the new leader's appends."""

from __future__ import annotations

import glob
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("psycopg_pool", reason="the PostgreSQL store needs psycopg_pool (onceflow[postgresql])")

import psycopg  # noqa: E402

from onceflow.server.leader import Lease, _clock  # noqa: E402
from onceflow.storage.pgfs import PgFileSystem  # noqa: E402
from onceflow.testing.services import PostgresServer  # noqa: E402

LIBFAKETIME = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))), None)
TERM = 2.0


@pytest.fixture
def stepped(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """A PostgreSQL whose wall clock is this file's offset (seconds), read at every call."""
    if LIBFAKETIME is None:
        pytest.skip("libfaketime is not installed (Debian's faketime package; scripts/setup.sh dev installs it)")
    shared = Path(tempfile.mkdtemp(prefix="onceflow-clock-"))  # readable by the server's own user
    shared.chmod(0o755)
    offset = shared / "offset"
    offset.write_text("+0\n")
    offset.chmod(0o644)
    with monkeypatch.context() as env:  # the server's processes only, not this one
        env.setenv("LD_PRELOAD", LIBFAKETIME)
        env.setenv("FAKETIME_TIMESTAMP_FILE", str(offset))
        env.setenv("FAKETIME_NO_CACHE", "1")
        env.setenv("FAKETIME_DONT_FAKE_MONOTONIC", "1")
        server = PostgresServer()
        server.start()
    try:
        with psycopg.connect(server.conninfo(), autocommit=True) as admin:
            admin.execute("CREATE DATABASE stepped")
        yield server.conninfo("stepped"), offset
    finally:
        server.stop()
        shutil.rmtree(shared, ignore_errors=True)


def db_ahead(conninfo: str) -> float:
    with psycopg.connect(conninfo) as conn:
        row = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
    assert row is not None
    return float(row[0]) - time.time()


def test_a_forward_step_of_the_databases_real_clock_hands_no_lease_over(stepped: tuple[str, Path]) -> None:
    conninfo, offset = stepped
    leader, follower = PgFileSystem(conninfo), PgFileSystem(conninfo)
    stop = threading.Event()
    try:
        began = _clock()
        token = leader.acquire("leader", "http://a", TERM)
        assert token == 1
        lease = Lease(token, TERM, began)

        def renew() -> None:  # as the leader does: every third of its term
            while not stop.wait(TERM / 3):
                b = _clock()
                if leader.renew(token, TERM):
                    lease.renewed(b)

        renewing = threading.Thread(target=renew, daemon=True)
        renewing.start()
        assert follower.acquire("follower", "http://b", TERM) is None
        offset.write_text("+12\n")  # the database's clock jumps 12 s ahead
        assert db_ahead(conninfo) > 10
        deadline = time.monotonic() + 3 * TERM  # three terms of a healthy, renewing leader
        while time.monotonic() < deadline:
            assert follower.acquire("follower", "http://b", TERM) is None, "a renewing leader lost its lease"
            assert lease.valid()
            time.sleep(0.05)
        stop.set()
        renewing.join()
        # the leader stops renewing (dies): the follower takes over once a term went by on its clock,
        # by which time the leader, by its own clock, stopped answering
        got = None
        while got is None and time.monotonic() < deadline + 10 * TERM:
            got = follower.acquire("follower", "http://b", TERM)
            time.sleep(0.05)
        assert got == 2
        assert not lease.valid()
    finally:
        stop.set()
        leader.close()
        follower.close()
