"""onceflow.testing's throwaway PostgreSQL: stops that leave no process behind."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from onceflow.testing import PostgresServer, ServiceUnavailable


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


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
