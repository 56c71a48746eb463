"""Throwaway servers and faults for tests, benchmarks and chaos runs (like ``bytewax.testing``).

One public module for what onceflow's tests, ``onceflow demo`` and the dev tools
(``onceflow_tools``: bench, chaos, sim) share. It needs nothing beyond onceflow's own dependencies
(the PostgreSQL and Redis servers are external binaries, found at run time), which is why it ships
with onceflow rather than with the tools: ``onceflow demo`` starts its server and drops its
acknowledgements with it.

- :func:`free_port`: a free loopback TCP port.
- :class:`OnceflowProcess`: ``onceflow serve`` on a free port, restartable on the same data and port
  (the tests' server).
- :class:`ServerProcess` and :func:`onceflow_server`: any server child process that prints a ready
  line with its URL (``onceflow serve --port 0``, the reference server, nats-server), its output
  drained, its CPU time readable; :class:`ServerFailure` when it does not become ready.
- :class:`PostgresServer`, :class:`RedisServer`: throwaway PostgreSQL (``initdb`` + ``pg_ctl``) and
  ``redis-server`` instances on free loopback ports, never the standard ones;
  :class:`ServiceUnavailable` when their binaries are missing (``scripts/setup.sh dev`` installs them).
- :class:`PostgresCluster`: a throwaway PostgreSQL primary with a synchronous standby
  (``pg_basebackup``), a multi-host conninfo that finds the primary, and the faults of a failover
  (kill the primary, promote the standby); :class:`PostgresNode` is one postmaster of either.
- :class:`HaCluster`: the highly available set-up of docs/ha.md on loopback, onceflow servers
  (:class:`HaServer`) over a :class:`PostgresCluster`, with its faults (kill a server, fail the
  database over, pause the primary, cut a server off from the database, step a clock).
- :class:`PatroniCluster`: the database of :class:`HaCluster` managed by Patroni over a one-member
  etcd (Debian's ``patroni`` and ``etcd-server``): a crashed primary is failed over by Patroni, not by
  hand, and comes back as the standby; :func:`patroni_missing` says why it cannot run here.
- :class:`SteppableClock`: a wall clock of processes started under libfaketime that a test steps
  while they run; :func:`clock_step_missing` says why it cannot be used here.
- :class:`FaultProxy`: an HTTP/1.1 proxy that drops, delays and reorders (lost acknowledgements).
"""

from .faketime import SteppableClock, clock_step_missing
from .faultproxy import FaultProxy
from .ha import HaCluster, HaServer
from .patroni import PatroniCluster, patroni_missing
from .processes import OnceflowProcess, ServerFailure, ServerProcess, free_port, kill_now, onceflow_server
from .services import (
    PostgresCluster,
    PostgresNode,
    PostgresRole,
    PostgresServer,
    RedisServer,
    ServiceUnavailable,
    postgres_bindir,
)

__all__ = [
    "FaultProxy",
    "HaCluster",
    "HaServer",
    "OnceflowProcess",
    "PatroniCluster",
    "PostgresCluster",
    "PostgresNode",
    "PostgresRole",
    "PostgresServer",
    "RedisServer",
    "ServerFailure",
    "ServerProcess",
    "ServiceUnavailable",
    "SteppableClock",
    "clock_step_missing",
    "free_port",
    "kill_now",
    "onceflow_server",
    "patroni_missing",
    "postgres_bindir",
]
