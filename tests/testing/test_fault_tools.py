"""The chaos run's new faults, at their source: a partition between a client and PostgreSQL
(:attr:`PgFaultProxy.blackhole`), and a wall clock stepped under a running process
(:class:`SteppableClock`)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from onceflow.testing import SteppableClock, clock_step_missing
from onceflow.testing.services import PostgresServer


def test_a_partition_answers_nothing_and_refuses_nothing_and_delivers_what_waited_once_healed(
    postgres_server: PostgresServer, pg: str
) -> None:
    psycopg = pytest.importorskip("psycopg")
    from onceflow.testing.pgproxy import PgFaultProxy

    dbname = re.search(r"dbname=(\w+)", pg)
    assert dbname is not None
    with PgFaultProxy(postgres_server.port) as proxy:
        conninfo = proxy.conninfo(dbname.group(1), user="postgres") + " connect_timeout=1"
        with psycopg.connect(conninfo, autocommit=True) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
            proxy.blackhole = True
            answers: list[object] = []
            query = threading.Thread(target=lambda: answers.append(conn.execute("SELECT 2").fetchone()))
            query.start()
            query.join(1.0)
            assert query.is_alive() and not answers  # no answer, no error: the client must time out itself
            began = time.monotonic()
            with pytest.raises(psycopg.OperationalError):  # a new connection: accepted, never answered
                psycopg.connect(conninfo)
            assert time.monotonic() - began >= 0.9  # its connect_timeout ran out; nothing refused it
            proxy.blackhole = False
            query.join(10)
            assert answers == [(2,)]  # healed: what waited is delivered
            with psycopg.connect(conninfo) as again:
                assert again.execute("SELECT 3").fetchone() == (3,)


def test_a_commit_is_lost_after_a_prepared_statement_as_after_a_parsed_one(
    postgres_server: PostgresServer, pg: str
) -> None:
    """Found by the issue-30 campaign (``lose-commit`` lost nothing in 2 of 3 runs): psycopg prepares
    a statement it ran 5 times on a connection (``prepare_threshold``) and then sends only its name
    (Bind, no Parse), so the proxy never saw the SQL of a long-lived connection's sync and never
    lost its COMMIT."""
    psycopg = pytest.importorskip("psycopg")
    from onceflow.testing.pgproxy import PgFaultProxy

    dbname = re.search(r"dbname=(\w+)", pg)
    assert dbname is not None
    with PgFaultProxy(postgres_server.port) as proxy:
        with psycopg.connect(proxy.conninfo(dbname.group(1), user="postgres")) as conn:
            conn.execute("CREATE TEMPORARY TABLE lose_me (x int)")
            for x in range(7):  # prepared after the fifth
                conn.execute("INSERT INTO lose_me VALUES (%s)", (x,))
                conn.commit()
            proxy.arm(lambda sql: "INSERT INTO lose_me" in sql, "answer")
            conn.execute("INSERT INTO lose_me VALUES (%s)", (7,))
            with pytest.raises(psycopg.OperationalError):
                conn.commit()
        assert proxy.lost == 1 and proxy.armed == 0


@pytest.mark.skipif(clock_step_missing() is not None, reason=str(clock_step_missing()))
def test_a_stepped_clock_moves_the_wall_clock_of_a_running_process_and_not_its_monotonic_clock(
    tmp_path: Path,
) -> None:
    clock = SteppableClock(tmp_path / "offset")
    script = (
        "import sys, time\n"
        "for line in sys.stdin:\n"
        "    m = time.monotonic(); time.sleep(0.05)\n"  # Python 3.11 sleeps on the monotonic clock
        "    print(time.time(), time.monotonic() - m, flush=True)\n"
    )
    proc = subprocess.Popen(  # noqa: S603
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**clock.env(), "PATH": "/usr/bin:/bin"},
    )
    assert proc.stdin is not None and proc.stdout is not None

    def ahead() -> tuple[float, float]:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        wall, slept = (float(x) for x in proc.stdout.readline().split())
        return wall - time.time(), slept

    try:
        assert abs(ahead()[0]) < 1
        assert clock.step(-20) == -20
        time.sleep(2.2)  # the file is read again within two seconds
        behind, slept = ahead()
        assert -21 < behind < -19 and 0.04 < slept < 1
        assert clock.reset() == 20 and clock.offset == 0
        time.sleep(2.2)
        assert abs(ahead()[0]) < 1
    finally:
        proc.stdin.close()
        proc.wait(10)
        proc.stdout.close()
