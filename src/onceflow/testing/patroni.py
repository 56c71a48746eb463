"""A throwaway PostgreSQL cluster managed by Patroni over a one-member etcd, on loopback (docs/ha.md,
"Running with Patroni"): the failover manager a user would run, in place of the ``pg_ctl promote``
by hand of :class:`~onceflow.testing.PostgresCluster`.

Debian's packages (``patroni``, ``etcd-server``; ``scripts/setup.sh dev`` installs them): etcd
listens on two free loopback ports, each Patroni on one for its REST API, each PostgreSQL on one
(fixed in its ``patroni.yml``: a proxy in front of a node keeps its address while Patroni restarts
it). As root, etcd and Patroni (and so PostgreSQL, which Patroni starts) run as ``nobody``.
:func:`patroni_missing` says why it cannot run here (None when it can).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path

from .processes import free_port, kill_now
from .services import (
    NodeRoles,
    PostgresNode,
    ServiceUnavailable,
    _make_dir,
    _server_user,
    postgres_bindir,
)

__all__ = ["PATRONI_TIMING", "PatroniCluster", "patroni_missing"]

PATRONI_TIMING = {
    # Patroni's global (DCS) settings that decide how fast it fails over; docs/ha.md explains each
    "ttl": 20,  # seconds the leader key lives without an update: a lost machine (> loop_wait + 2 * retry_timeout)
    "loop_wait": 1,  # seconds between two runs of Patroni's loop: how soon a crashed primary is seen
    "retry_timeout": 5,  # seconds Patroni retries etcd and PostgreSQL before it gives up on them
    "primary_start_timeout": 0,  # a crashed primary is failed over at once, not restarted in place
}


def patroni_missing() -> str | None:
    """Why a :class:`PatroniCluster` cannot run here; None when it can."""
    for program, package in (("patroni", "patroni"), ("etcd", "etcd-server")):
        if shutil.which(program) is None:
            return f"{program} is not installed (Debian's {package} package; scripts/setup.sh dev installs it)"
    try:
        bindir = postgres_bindir()
    except ServiceUnavailable as exc:
        return str(exc)
    if not (bindir / "pg_basebackup").exists() or not (bindir / "pg_rewind").exists():
        return f"no pg_basebackup or pg_rewind in {bindir} (Debian's postgresql package)"
    return None


def _get_json(url: str, timeout: float = 2.0) -> object:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback
        return json.load(r)


class _Process:
    """A child process whose output goes to a log file; killed with SIGKILL, never left behind."""

    def __init__(self, argv: list[str], log: Path, *, user: str | None, env: Mapping[str, str] | None) -> None:
        self.argv, self.log, self.user, self.env = argv, log, user, env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, **(self.env or {})}
        kw: dict[str, object] = {}
        if self.user is not None:
            pw = pwd.getpwnam(self.user)
            kw = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
            env["HOME"] = str(self.log.parent)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(  # type: ignore[call-overload]  # noqa: S603 - our own argv
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.log.parent,
                env=env,
                start_new_session=True,
                **kw,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """``kill -9`` (continued first if stopped)."""
        kill_now(self.proc)
        self.proc = None


class PatroniCluster(NodeRoles):
    """etcd (one member) and two Patroni-managed PostgreSQL nodes, ``synchronous_mode: true``.

    The same surface as :class:`~onceflow.testing.PostgresCluster` where it makes sense (:attr:`nodes`,
    :meth:`conninfo`, :meth:`roles`, :meth:`primary`, :meth:`standby`, :meth:`kill_primary`), so that
    :class:`~onceflow.testing.HaCluster` runs on either. What differs: nothing is promoted by hand.
    :meth:`kill_primary` SIGKILLs the primary's postgres (Patroni on that node lives on), and Patroni,
    told to fail over a crashed primary at once (``primary_start_timeout: 0``), releases the leader
    key; the standby's Patroni takes it and promotes. :meth:`wait_promoted` waits for that, and
    :meth:`wait_synchronous` for the old node to come back (``pg_rewind``) as the new primary's
    synchronous standby. Timing: :data:`PATRONI_TIMING`.

    :meth:`start`:

    1. etcd on two free loopback ports, its data in the temporary directory.
    2. A ``patroni.yml`` per node (members ``node0`` and ``node1``, scope ``onceflow``), both Patronis
       started at once: one wins the race to initialise the cluster (``initdb``), the other clones it
       (``pg_basebackup``).
    3. Wait until one node is primary and the other its ``streaming`` ``sync`` standby (Patroni sets
       ``synchronous_standby_names`` once the standby streams) and Patroni names it ``sync_standby``
       (only then would it promote it).
    """

    SCOPE = "onceflow"

    def __init__(
        self,
        *,
        max_prepared_transactions: int = 64,
        env: Mapping[str, str] | None = None,
        timing: Mapping[str, int] | None = None,
        keep_logs: Path | None = None,
    ) -> None:
        missing = patroni_missing()
        if missing is not None:
            raise ServiceUnavailable(missing)
        self.keep_logs = keep_logs  # where stop() copies etcd's and each Patroni's log (with PostgreSQL's in it)
        self.env = env  # added to the environment of both Patronis, and so of the postgres they start
        self.bindir = postgres_bindir()
        self.max_prepared_transactions = max_prepared_transactions
        self.timing = {**PATRONI_TIMING, **(timing or {})}
        self.root: Path | None = None
        self.nodes: tuple[PostgresNode, ...] = ()
        self.api_ports: dict[str, int] = {}
        self.etcd_port = 0
        self._etcd: _Process | None = None
        self._patronis: dict[str, _Process] = {}

    def config(self, node: PostgresNode) -> dict[str, object]:
        """The ``patroni.yml`` of ``node`` (as a dict; JSON is YAML): what docs/ha.md shows."""
        dcs: dict[str, object] = {
            **self.timing,
            "synchronous_mode": True,  # a commit returns once the standby has flushed it too
            "maximum_lag_on_failover": 1048576,
            "postgresql": {
                "use_pg_rewind": True,  # the crashed primary comes back as a standby
                "use_slots": True,
                "parameters": {
                    "max_prepared_transactions": self.max_prepared_transactions,
                    "max_connections": 100,
                    "wal_log_hints": "on",
                    "synchronous_commit": "on",
                },
            },
        }
        return {
            "scope": self.SCOPE,
            "name": node.name,
            "restapi": {
                "listen": f"127.0.0.1:{self.api_ports[node.name]}",
                "connect_address": f"127.0.0.1:{self.api_ports[node.name]}",
            },
            "etcd3": {"hosts": [f"127.0.0.1:{self.etcd_port}"]},
            "watchdog": {"mode": "off"},  # no /dev/watchdog here (docs/ha.md: use one in production)
            "bootstrap": {
                "dcs": dcs,
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}],
                "pg_hba": [
                    "local all all trust",
                    "host replication replicator 127.0.0.1/32 trust",
                    "host all all 127.0.0.1/32 trust",
                ],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.port}",
                "connect_address": f"127.0.0.1:{node.port}",
                "data_dir": str(node.data),
                "bin_dir": str(self.bindir),
                "pgpass": str(node.root / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres", "password": "postgres"},
                    "replication": {"username": "replicator", "password": "replicator"},
                    "rewind": {"username": "rewinder", "password": "rewinder"},
                },
                "parameters": {"unix_socket_directories": str(node.root)},
            },
        }

    def start(self, timeout: float = 120.0) -> None:
        self.root = _make_dir(Path(tempfile.mkdtemp(prefix="onceflow-patroni-")))
        user = _server_user()
        try:
            # Step 1: etcd
            self.etcd_port, peer_port = free_port(), free_port()
            etcd_dir = _make_dir(self.root / "etcd")
            client, peer = f"http://127.0.0.1:{self.etcd_port}", f"http://127.0.0.1:{peer_port}"
            self._etcd = _Process(
                [
                    "etcd",
                    "--name=etcd0",
                    f"--data-dir={etcd_dir / 'data'}",
                    f"--listen-client-urls={client}",
                    f"--advertise-client-urls={client}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=etcd0={peer}",
                    "--initial-cluster-state=new",
                    f"--initial-cluster-token=onceflow-{self.etcd_port}",
                ],
                etcd_dir / "etcd.log",
                user=user,
                env=None,
            )
            self._etcd.start()
            self._wait(lambda: _get_json(f"{client}/health") == {"health": "true"}, timeout, "etcd to be healthy")
            # Step 2: the Patronis
            self.nodes = tuple(PostgresNode(f"node{i}", self.root / f"node{i}", bindir=self.bindir) for i in range(2))
            for node in self.nodes:
                _make_dir(node.root)
                node.port = free_port()
                self.api_ports[node.name] = free_port()
                conf = node.root / "patroni.yml"
                conf.write_text(json.dumps(self.config(node), indent=2) + "\n")
                conf.chmod(0o644)
                self._patronis[node.name] = _Process(
                    ["patroni", str(conf)], node.root / "patroni.log", user=user, env=self.env
                )
            for patroni in self._patronis.values():
                patroni.start()
            # Step 3: a primary and its synchronous standby
            self.wait_synchronous(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        """Until ``ready()`` (its errors count as not yet); a ``RuntimeError`` after ``timeout`` s, or at
        once if etcd or a Patroni exited."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError, ValueError, KeyError, RuntimeError, subprocess.TimeoutExpired):
                if ready():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Patroni cluster: no {what} within {timeout:.0f} s; logs in {self.root}")
            for name, p in [("etcd", self._etcd), *self._patronis.items()]:
                if p is not None and p.proc is not None and p.proc.poll() is not None:
                    raise RuntimeError(f"Patroni cluster: {name} exited with {p.proc.returncode}; see {p.log}")
            time.sleep(0.1)

    def members(self) -> dict[str, dict[str, object]]:
        """Patroni's view (``GET /cluster`` of the REST API of any node that answers): each member's
        role (``leader``, ``sync_standby``, ``replica``), state and timeline, by name."""
        for port in self.api_ports.values():
            with contextlib.suppress(OSError, ValueError):
                found = _get_json(f"http://127.0.0.1:{port}/cluster")
                return {m["name"]: m for m in found["members"]}  # type: ignore[index]
        return {}

    def wait_synchronous(self, timeout: float = 120.0) -> float:
        """Wait until a node is primary and the other streams to it as its ``sync`` standby (asked of
        the primary's ``pg_stat_replication``), and Patroni names it ``sync_standby``; the seconds that took."""
        began = time.monotonic()

        def synchronous() -> bool:
            primary, standby = self.primary(), self.standby()
            if primary is None or standby is None:
                return False
            rows = primary.sql("SELECT application_name, state, sync_state FROM pg_stat_replication").splitlines()
            # and Patroni knows it (its /sync key names the standby): only then may it promote the standby
            return f"{standby.name}|streaming|sync" in rows and self.members()[standby.name]["role"] == "sync_standby"

        self._wait(synchronous, timeout, "primary with a synchronous standby")
        return time.monotonic() - began

    def kill_primary(self) -> PostgresNode:
        """SIGKILL the primary's postmaster and its children (a crash of PostgreSQL; its Patroni lives
        on and fails over); returns that node."""
        node = self.primary()
        if node is None:
            raise RuntimeError(f"no primary to kill: {self.roles()}")
        node.kill()
        return node

    def wait_promoted(self, old: PostgresNode, timeout: float = 60.0) -> PostgresNode:
        """Wait until a node other than ``old`` takes writes (Patroni promoted it); that node."""
        found: list[PostgresNode] = []

        def promoted() -> bool:  # asked of the nodes themselves, every 0.1 s
            found[:] = [n for n in self.nodes if n is not old and n.sql("SELECT pg_is_in_recovery()") == "f"]
            return bool(found)

        self._wait(promoted, timeout, f"promotion after {old.name}'s crash")
        return found[0]

    def stop(self) -> None:
        """Kill both Patronis, stop both nodes (none of their processes is left), kill etcd, remove the directory."""
        failures: list[RuntimeError] = []
        for patroni in self._patronis.values():
            patroni.kill()
        for node in self.nodes:
            try:
                node.stop()
            except RuntimeError as exc:
                failures.append(exc)
        if self._etcd is not None:
            self._etcd.kill()
        if self.keep_logs is not None and self.root is not None:
            for log in [self.root / "etcd" / "etcd.log", *(node.root / "patroni.log" for node in self.nodes)]:
                with contextlib.suppress(OSError):
                    shutil.copyfile(log, self.keep_logs / f"{log.parent.name}-{log.name}")
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
        self.root = None
        self.nodes = ()
        self._patronis = {}
        if failures:
            raise failures[0]

    def __enter__(self) -> PatroniCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
