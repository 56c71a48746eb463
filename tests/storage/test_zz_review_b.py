"""Scratch review tests (to be deleted): a statement_timeout cancels the wait for the synchronous
standby, and PostgreSQL then reports the COMMIT as successful (with a WARNING)."""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import psycopg
import pytest

from onceflow.storage.pgfs import PgFileSystem

ROOT = Path("/onceflow")


@pytest.fixture
def ghost(pg: str):
    """A synchronous standby that never confirms (as one that is down or behind)."""
    admin = psycopg.connect(pg, autocommit=True)
    admin.execute("ALTER SYSTEM SET synchronous_standby_names = 'ghost'")
    admin.execute("SELECT pg_reload_conf()")
    time.sleep(0.5)
    try:
        yield admin
    finally:
        admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
        admin.execute("SELECT pg_reload_conf()")
        time.sleep(0.5)
        # end every session still waiting for the ghost
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
        )
        admin.close()


def test_a_renewal_is_reported_done_although_the_standby_never_confirmed(pg: str, ghost) -> None:
    fs = PgFileSystem(pg)
    try:
        ghost.execute("ALTER SYSTEM RESET synchronous_standby_names")
        ghost.execute("SELECT pg_reload_conf()")
        time.sleep(0.5)
        token = fs.acquire("leader", "http://a", 1.5)
        ghost.execute("ALTER SYSTEM SET synchronous_standby_names = 'ghost'")
        ghost.execute("SELECT pg_reload_conf()")
        time.sleep(0.5)
        t = time.monotonic()
        ok = fs.renew(token, 1.5)
        took = time.monotonic() - t
        assert not ok, f"renew() answered True after {took:.2f} s: committed locally only, never on the standby"
    finally:
        fs.close()


def test_a_lost_commit_is_read_back_as_committed_without_the_standby(pg: str, ghost) -> None:
    """With a statement_timeout on the role or database (a common setting), the read-back's own
    commit is cut short the same way: 'committed' is answered for a commit no standby holds."""
    dbname = re.search(r"dbname=(\w+)", pg).group(1)
    ghost.execute(f"ALTER DATABASE {dbname} SET statement_timeout = '700ms'")
    ghost.execute("ALTER SYSTEM RESET synchronous_standby_names")
    ghost.execute("SELECT pg_reload_conf()")
    time.sleep(0.5)
    fs = PgFileSystem(pg)
    try:
        fs.mkdir(ROOT)
        ghost.execute("ALTER SYSTEM SET synchronous_standby_names = 'ghost'")
        ghost.execute("SELECT pg_reload_conf()")
        time.sleep(0.5)
        # a write whose COMMIT waits for the standby; its connection is then ended (as a failover or
        # _end_stopped_holder does): it is committed on this primary only
        conn = psycopg.connect(pg, autocommit=False)
        conn.execute("SET statement_timeout = 0")
        ident = 4242
        conn.execute("INSERT INTO onceflow_commits (conn, session, seq) VALUES (%s, 'x', 0)", (ident,))
        conn.execute("SET synchronous_commit = local")
        conn.commit()
        conn.execute("SET synchronous_commit = on")
        conn.execute("UPDATE onceflow_commits SET seq = seq + 1 WHERE conn = %s", (ident,))
        pid = conn.info.backend_pid
        done = threading.Thread(target=lambda: conn.commit() if True else None, daemon=True)
        err: list[object] = []

        def commit() -> None:
            try:
                conn.commit()
            except psycopg.Error as exc:
                err.append(exc)

        done = threading.Thread(target=commit, daemon=True)
        done.start()
        time.sleep(0.5)
        ghost.execute("SELECT pg_terminate_backend(%s)", (pid,))
        done.join(5)
        assert err, "the write's commit should have failed (connection ended)"
        t = time.monotonic()
        fs._settle((ident, 1), "a write", err[0])  # returns: 'committed'
        raise AssertionError(f"_settle answered 'committed' after {time.monotonic() - t:.2f} s; no standby holds it")
    finally:
        ghost.execute(f"ALTER DATABASE {dbname} RESET statement_timeout")
        fs.close()
