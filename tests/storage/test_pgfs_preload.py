"""Recovery reads the store's tree at once (storage/pgfs.py, ``PgFileSystem.preloaded``; issue 30,
item 9: a takeover recovered every stream with a dozen round trips each, over a minute for 10,000
streams). Inside the block every read answers as the database would, what this process writes
keeps the answers true, and the snapshots recovery rewrites go out in one transaction at its end."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("psycopg_pool", reason="the PostgreSQL store needs psycopg_pool (onceflow[postgresql])")

from onceflow.storage.pgfs import PgFileSystem  # noqa: E402

ROOT = Path("/onceflow")
DATA = ROOT / "data"


@pytest.fixture
def fs(pg: str) -> Iterator[PgFileSystem]:
    f = PgFileSystem(pg)
    f.mkdir(DATA / "streams" / "a")
    f.mkdir(DATA / "streams" / "b")
    f.mkdir(DATA / "empty")
    f.replace_file(DATA / "streams" / "a" / "meta.json", b'{"name": "a"}')
    f.replace_file(DATA / "streams" / "a" / "empty", b"")
    big = f.open_file(DATA / "streams" / "b" / "0.seg", create=True)
    big.pwrite(b"x" * 100_000, 0)  # larger than what is read at once: its bytes come from the database
    big.sync()
    holes = f.open_file(DATA / "streams" / "b" / "holes", create=True)
    holes.pwrite(b"ab", 0)
    holes.sync()
    holes.pwrite(b"cd", 10)  # a hole between two chunks
    holes.sync()
    f.replace_file(ROOT / "outside", b"not under the tree")
    yield f
    f.close()


def everything(fs: PgFileSystem) -> dict[str, object]:
    """What each read of the tree answers."""
    seen: dict[str, object] = {}
    paths = [DATA, DATA / "streams", DATA / "streams" / "a", DATA / "streams" / "b", DATA / "empty", DATA / "nope"]
    for d in paths:
        try:
            seen[f"ls {d}"] = sorted(fs.listdir(d))
        except OSError as exc:
            seen[f"ls {d}"] = type(exc).__name__
    files = ["streams/a/meta.json", "streams/a/empty", "streams/b/0.seg", "streams/b/holes", "streams/missing", "empty"]
    for name in files:
        p = DATA / name
        seen[f"exists {p}"] = fs.exists(p)
        try:
            seen[f"read {p}"] = fs.read_bytes(p)
        except OSError as exc:
            seen[f"read {p}"] = type(exc).__name__
        try:
            f = fs.open_file(p, create=False)
            seen[f"open {p}"] = (f.size(), f.pread(7, 0), f.pread(5, 9), f.pread(10, 99_995))
            f.close()
        except OSError as exc:
            seen[f"open {p}"] = type(exc).__name__
    return seen


def test_every_read_inside_answers_as_the_database_does(fs: PgFileSystem) -> None:
    outside = everything(fs)
    with fs.preloaded(DATA):
        assert fs._pre is not None  # read at once
        inside = everything(fs)
        assert fs._pre is not None  # and no read dropped it
    assert inside == outside


def test_writes_inside_keep_the_reads_true_and_replacements_land_at_the_end(fs: PgFileSystem, pg: str) -> None:
    other = PgFileSystem(pg)
    try:
        with fs.preloaded(DATA):
            fs.replace_file(DATA / "streams" / "a" / "snapshot", b"new")  # deferred: reads back at once
            fs.replace_file(DATA / "streams" / "a" / "meta.json", b"v2")
            assert fs.read_bytes(DATA / "streams" / "a" / "snapshot") == b"new"
            assert fs.exists(DATA / "streams" / "a" / "snapshot")
            assert fs.read_bytes(DATA / "streams" / "a" / "meta.json") == b"v2"
            assert not other.exists(DATA / "streams" / "a" / "snapshot")  # not yet in the database
            h = fs.open_file(DATA / "streams" / "b" / "holes", create=False)
            h.truncate(3)  # recovery cutting a torn tail, then syncing it
            h.sync()
            assert fs.read_bytes(DATA / "streams" / "b" / "holes") == b"ab\0"
            assert fs._pre is not None
        assert other.read_bytes(DATA / "streams" / "a" / "snapshot") == b"new"
        assert other.read_bytes(DATA / "streams" / "a" / "meta.json") == b"v2"
        assert other.read_bytes(DATA / "streams" / "b" / "holes") == b"ab\0"
        assert everything(fs) == everything(other)
    finally:
        other.close()


def test_a_change_of_the_tree_inside_writes_the_deferred_first_and_reads_go_to_the_database(
    fs: PgFileSystem, pg: str
) -> None:
    with fs.preloaded(DATA):
        fs.replace_file(DATA / "streams" / "a" / "snapshot", b"first")
        fs.rename(DATA / "streams" / "a" / "snapshot", DATA / "streams" / "a" / "moved")
        assert fs._pre is None  # dropped: reads go to the database again
        assert fs.read_bytes(DATA / "streams" / "a" / "moved") == b"first"
        fs.unlink(DATA / "streams" / "a" / "empty")
        assert not fs.exists(DATA / "streams" / "a" / "empty")
    other = PgFileSystem(pg)
    try:
        assert sorted(other.listdir(DATA / "streams" / "a")) == ["meta.json", "moved"]
    finally:
        other.close()


def test_a_block_that_fails_writes_none_of_its_deferred_replacements(fs: PgFileSystem) -> None:
    """Recovery that fails is run again from the start: a snapshot it meant to rewrite is left as
    it was (recovery checks a snapshot against the log before it trusts it)."""
    with contextlib.suppress(RuntimeError), fs.preloaded(DATA):
        fs.replace_file(DATA / "streams" / "a" / "meta.json", b"never")
        raise RuntimeError("recovery failed")
    assert fs.read_bytes(DATA / "streams" / "a" / "meta.json") == b'{"name": "a"}'


def test_deferred_replacements_that_fail_inside_a_best_effort_removal_fail_the_block(
    fs: PgFileSystem, pg: str, postgres_server: object
) -> None:
    """Found by ``onceflow chaos --store postgresql`` (lose-commit): the coordinator's recovery
    removes a leftover directory (``rmtree``, best effort: errors are logged, not raised), which
    first writes the deferred replacements; their COMMIT was lost and they did not land. The
    removal swallowed the error and recovery went on as if they had: they must fail the block
    instead (recovery is then run again), never vanish silently."""
    import re

    from onceflow.testing.pgproxy import PgFaultProxy
    from onceflow.testing.services import PostgresServer

    assert isinstance(postgres_server, PostgresServer)
    with PgFaultProxy(postgres_server.port) as proxy:
        dbname = re.search(r"dbname=(\w+)", pg)
        assert dbname is not None
        through = PgFileSystem(proxy.conninfo(dbname.group(1), user="postgres"), connect_timeout=5)
        try:
            with pytest.raises(OSError, match="deferred replacements"), through.preloaded(DATA):
                through.replace_file(DATA / "streams" / "a" / "snapshot", b"recovered state")
                proxy.arm(lambda sql: "INSERT INTO onceflow_chunks" in sql, "request")
                through.rmtree(DATA / "empty")  # best effort: it does not raise
                assert proxy.lost == 1
        finally:
            through.close()
    assert not fs.exists(DATA / "streams" / "a" / "snapshot")


def test_a_file_a_deferred_replacement_creates_is_listed(fs: PgFileSystem) -> None:
    """Found by review: the deferred replacement of a new file did not add its name to the listing."""
    with fs.preloaded(DATA):
        fs.replace_file(DATA / "streams" / "a" / "snapshot", b"new")
        assert sorted(fs.listdir(DATA / "streams" / "a")) == ["empty", "meta.json", "snapshot"]
    assert sorted(fs.listdir(DATA / "streams" / "a")) == ["empty", "meta.json", "snapshot"]
