"""onceflow.testing's throwaway PostgreSQL: a primary with a synchronous standby, a failover, and stops that
leave no process behind."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from onceflow.testing import PostgresCluster, PostgresServer, ServiceUnavailable


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _eventually(query: str, conninfo: str, expected: object, timeout: float = 30.0) -> object:
    """``query``'s rows once they are ``expected`` (a standby replays after it has flushed), or the last ones."""
    deadline = time.monotonic() + timeout
    while True:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            rows = conn.execute(query).fetchall()
        if rows == expected or time.monotonic() > deadline:
            return rows
        time.sleep(0.02)


@pytest.fixture
def cluster() -> Iterator[PostgresCluster]:
    try:
        cluster = PostgresCluster(fsync=False)
    except ServiceUnavailable as exc:
        pytest.skip(f"no PostgreSQL to start: {exc}")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_commit_on_the_primary_is_readable_on_the_synchronous_standby(cluster: PostgresCluster) -> None:
    node0, node1 = cluster.nodes
    assert cluster.roles() == {"node0": "primary", "node1": "standby"}
    assert node0.sql("SELECT application_name, state, sync_state FROM pg_stat_replication") == "node1|streaming|sync"

    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        assert conn.info.port == node0.port  # the multi-host conninfo found the primary
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
        conn.execute("CREATE TABLE t (x int)")
        conn.execute("INSERT INTO t VALUES (1)")

    # the commit returned once node1 had flushed it; a read there sees it once replayed
    assert _eventually("SELECT x FROM t", node1.conninfo(), [(1,)]) == [(1,)]
    with (
        psycopg.connect(node1.conninfo(), autocommit=True) as conn,
        pytest.raises(psycopg.errors.ReadOnlySqlTransaction),
    ):
        conn.execute("INSERT INTO t VALUES (2)")

    pids = node0.processes() + node1.processes()
    assert node0.pid in pids and node1.pid in pids
    cluster.stop()
    assert [pid for pid in pids if _alive(pid)] == []


def test_after_the_primary_is_killed_the_promoted_standby_has_every_commit_and_takes_writes(
    cluster: PostgresCluster,
) -> None:
    node0, node1 = cluster.nodes
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute("CREATE TABLE t (x int)")
        for x in range(1, 6):
            conn.execute("INSERT INTO t VALUES (%s)", (x,))
    killed_pids = node0.processes()

    # the primary dies right after its last commit returned, no time given to the standby to replay it
    assert cluster.kill_primary() is node0
    assert [pid for pid in killed_pids if _alive(pid)] == [] and node0.pid is None
    assert cluster.roles() == {"node0": "down", "node1": "standby"}
    assert cluster.primary() is None
    with pytest.raises(psycopg.OperationalError):  # nobody takes writes until the promotion
        psycopg.connect(cluster.conninfo(), autocommit=True).close()

    seconds = cluster.promote()
    assert seconds > 0
    assert cluster.roles() == {"node0": "down", "node1": "primary"}
    assert cluster.primary() is node1 and cluster.standby() is None

    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        assert conn.info.port == node1.port
        assert conn.execute("SELECT x FROM t ORDER BY x").fetchall() == [(x,) for x in range(1, 6)]
        # no standby left and none to wait for: a synchronous commit returns
        assert conn.execute("SHOW synchronous_standby_names").fetchone() == ("",)
        conn.execute("INSERT INTO t VALUES (6)")
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        assert conn.execute("SELECT max(x) FROM t").fetchone() == (6,)

    pids = node1.processes()
    root = cluster.root
    cluster.stop()
    assert [pid for pid in pids if _alive(pid)] == []
    assert root is not None and not root.exists()


def test_a_rewound_old_primary_rejoins_as_the_synchronous_standby_and_the_pair_fails_over_again(
    cluster: PostgresCluster,
) -> None:
    node0, node1 = cluster.nodes
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute("CREATE TABLE t (x int)")
        conn.execute("INSERT INTO t VALUES (1)")
    port0 = node0.port
    cluster.kill_primary()
    cluster.promote()
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute("INSERT INTO t VALUES (2)")  # on one copy: node0 is down

    cluster.rejoin(node0)
    assert node0.port == port0  # what connection strings and proxies name
    assert cluster.roles() == {"node0": "standby", "node1": "primary"}
    assert node1.sql("SELECT application_name, state, sync_state FROM pg_stat_replication") == "node0|streaming|sync"
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        conn.execute("INSERT INTO t VALUES (3)")  # returned once node0 flushed it

    # and back: node1 killed, node0 promoted (its commits do not wait for a standby), node1 rejoins
    cluster.kill_primary()
    cluster.promote()
    assert cluster.roles() == {"node0": "primary", "node1": "down"}
    assert node0.sql("SHOW synchronous_standby_names") == ""
    with psycopg.connect(cluster.conninfo(), autocommit=True) as conn:
        assert conn.execute("SELECT x FROM t ORDER BY x").fetchall() == [(1,), (2,), (3,)]
        conn.execute("INSERT INTO t VALUES (4)")
    cluster.rejoin(node1)
    assert node0.sql("SELECT application_name, state, sync_state FROM pg_stat_replication") == "node1|streaming|sync"
    assert _eventually("SELECT max(x) FROM t", node1.conninfo(), [(4,)]) == [(4,)]


def test_a_server_stops_with_all_its_processes() -> None:
    try:
        server = PostgresServer(fsync=False)
    except ServiceUnavailable as exc:
        pytest.skip(f"no PostgreSQL to start: {exc}")
    with server:
        with psycopg.connect(server.conninfo(), autocommit=True) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert server.node is not None
        pids = server.node.processes()
        root = server.root
        assert server.node.pid in pids
    assert [pid for pid in pids if _alive(pid)] == []
    assert root is not None and not root.exists()
