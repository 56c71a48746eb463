"""Scratch review tests (to be deleted)."""
from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import psycopg
import pytest

from onceflow.server.leader import Lease, _clock
from onceflow.storage.pgfs import PgFileSystem

ROOT = Path("/onceflow")
DATA = ROOT / "data"


def test_follower_counts_its_term_from_before_its_read(pg: str) -> None:
    """The follower stamps `now` before the SELECT; a renewal that commits while the read waits
    (pool busy, reconnect, slow network) is counted from before it began."""
    term = 2.0
    leader = PgFileSystem(pg)
    follower = PgFileSystem(pg)
    try:
        began = _clock()
        token = leader.acquire("leader", "http://a", term)
        assert token == 1
        leader.token = token
        lease = Lease(token, term, began)
        real_tx = follower._tx
        state = {"n": 0}

        @contextlib.contextmanager
        def slow_tx(what, **kw):  # the first read of the lease waits 1 s (e.g. for a pool connection)
            if what == "read the lease" and state["n"] == 0:
                state["n"] += 1
                time.sleep(1.0)
                b = _clock()
                assert leader.renew(token, term)  # the leader's renewal lands meanwhile
                lease.renewed(b)
            with real_tx(what, **kw) as cur:
                yield cur

        follower._tx = slow_tx  # type: ignore[method-assign]
        got = None
        deadline = time.monotonic() + 10
        while got is None and time.monotonic() < deadline:
            got = follower.acquire("follower", "http://b", term)
            if got is None:
                time.sleep(0.05)
        assert got == 2
        # the follower now holds the lease (and will serve once recovered) ...
        assert not lease.valid(), (
            f"both lead: the old leader's lease is valid for {lease.until - _clock():.2f} s more"
        )
    finally:
        leader.close()
        follower.close()


@pytest.fixture
def fs(pg: str):
    f = PgFileSystem(pg)
    f.mkdir(DATA / "streams" / "a")
    f.replace_file(DATA / "streams" / "a" / "meta.json", b"v1")
    yield f
    f.close()


def test_preload_listdir_after_a_deferred_new_file(fs: PgFileSystem) -> None:
    with fs.preloaded(DATA):
        fs.replace_file(DATA / "streams" / "a" / "snapshot", b"new")
        inside = sorted(fs.listdir(DATA / "streams" / "a"))
    assert sorted(fs.listdir(DATA / "streams" / "a")) == ["meta.json", "snapshot"]
    assert inside == ["meta.json", "snapshot"]


def test_a_failed_flush_of_the_deferred_loses_them_for_good(fs: PgFileSystem) -> None:
    """As Coordinator._compact_or_go_on does: a tree change inside the block fails (its flush of the
    deferred replacements failed once), the caller goes on; the block ends without error."""
    real_tx = fs._tx
    state = {"fail": True}

    @contextlib.contextmanager
    def flaky(what, **kw):
        if what.startswith("replace ") and " files under " in what and state["fail"]:
            state["fail"] = False
            raise OSError(5, "PostgreSQL store: a transient failure")
        with real_tx(what, **kw) as cur:
            yield cur

    fs._tx = flaky  # type: ignore[method-assign]
    with fs.preloaded(DATA):
        fs.replace_file(DATA / "streams" / "a" / "meta.json", b"v2")  # deferred (a snapshot rewrite)
        try:
            fs.rmtree(DATA / "coordinator.new")  # _compact: fails, caught by _compact_or_go_on
        except Exception:  # noqa: BLE001
            pass
        seen_inside = fs.read_bytes(DATA / "streams" / "a" / "meta.json")
        fs.rmtree(DATA / "coordinator.new")  # _finish_compaction goes on
    assert (seen_inside, fs.read_bytes(DATA / "streams" / "a" / "meta.json")) == (b"v2", b"v2")
