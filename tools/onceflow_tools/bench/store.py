"""The PostgreSQL stores a bench runs ``onceflow serve --store`` on, beside the local store, and what
the database spends during a measurement.

- ``postgresql``: one throwaway PostgreSQL (:class:`onceflow.testing.PostgresServer`), ``fsync=on``,
  ``synchronous_commit=on``: a commit (an acknowledged append) has been flushed to its WAL.
- ``postgresql-ha``: a primary and a synchronous standby (:class:`onceflow.testing.PostgresCluster`),
  what HA users run: a commit has been flushed on both. Both nodes run on this machine.

:meth:`PostgresStore.sample` before a measured window and :meth:`PostgresStore.since` after it give
the database's CPU (every process of every node), the write transactions it committed (transaction
ids assigned: a sync of a file is one) and the WAL it wrote.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from onceflow.testing import PostgresCluster, PostgresNode, PostgresServer

__all__ = ["STORE_KINDS", "DbSample", "DbUse", "PostgresStore", "StoreKind"]

StoreKind = Literal["postgresql", "postgresql-ha"]
STORE_KINDS: tuple[StoreKind, ...] = ("postgresql", "postgresql-ha")


@dataclass(frozen=True, slots=True)
class DbSample:
    at: float  # time.perf_counter()
    cpu_seconds: float  # user + system of the nodes' live processes
    next_xid: int  # the next transaction id the primary assigns
    wal_bytes: int  # the primary's WAL position, in bytes


@dataclass(frozen=True, slots=True)
class DbUse:
    """What the database did in a measured window."""

    seconds: float
    cpu_pct: float  # every process of every node; 100 = one core
    transactions: int  # write transactions (each sync of a file is one)
    wal_bytes: int


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # gone meanwhile
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class PostgresStore:
    """A throwaway PostgreSQL of ``kind`` for ``onceflow serve --store``; :meth:`start` it, then
    :attr:`conninfo` is what ``--store`` takes; :meth:`stop` leaves no process or file behind."""

    def __init__(self, kind: StoreKind) -> None:
        self.kind = kind
        # ServiceUnavailable when PostgreSQL's binaries are missing
        self._pg: PostgresServer | PostgresCluster = PostgresServer() if kind == "postgresql" else PostgresCluster()

    def start(self) -> None:
        self._pg.start()

    def stop(self) -> None:
        self._pg.stop()

    @property
    def conninfo(self) -> str:
        return self._pg.conninfo()

    @property
    def nodes(self) -> tuple[PostgresNode, ...]:
        if isinstance(self._pg, PostgresCluster):
            return self._pg.nodes
        assert self._pg.node is not None, "start() first"
        return (self._pg.node,)

    def describe(self) -> str:
        """Its version and the settings that make a commit durable, as the primary reports them."""
        primary = self.nodes[0]
        version, fsync, commit, method, standby = primary.sql(
            "SELECT current_setting('server_version'), current_setting('fsync'), "
            "current_setting('synchronous_commit'), current_setting('wal_sync_method'), "
            "current_setting('synchronous_standby_names')"
        ).split("|")
        where = (
            f"a primary and a synchronous standby ({standby}, streaming, on this machine too)"
            if self.kind == "postgresql-ha"
            else "one instance"
        )
        return (
            f"PostgreSQL {version}, {where}: fsync={fsync}, synchronous_commit={commit}, "
            f"wal_sync_method={method}, the other settings initdb's defaults"
        )

    def sample(self) -> DbSample:
        at = time.perf_counter()
        cpu = sum(_cpu_seconds(pid) for node in self.nodes for pid in node.processes())
        # psql's own backend is read-only (assigns no transaction id) and gone by the next sample
        xid, lsn = (
            self.nodes[0].sql("SELECT pg_snapshot_xmax(pg_current_snapshot()), pg_current_wal_lsn() - '0/0'").split("|")
        )
        return DbSample(at, cpu, int(xid), int(lsn))

    def since(self, before: DbSample) -> DbUse:
        now = self.sample()
        seconds = now.at - before.at
        return DbUse(
            seconds=seconds,
            cpu_pct=100 * (now.cpu_seconds - before.cpu_seconds) / seconds if seconds > 0 else 0.0,
            transactions=now.next_xid - before.next_xid,
            wal_bytes=now.wal_bytes - before.wal_bytes,
        )
