"""The highly available set-up of docs/ha.md on loopback: onceflow servers over a PostgreSQL primary
and its synchronous standby, with the faults a failover test needs (kill -9 of a server, of the
primary, promotion of the standby). For ``onceflow chaos --store postgresql``, ``onceflow demo --ha``
and the tests."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Literal

from .faketime import SteppableClock
from .patroni import PatroniCluster
from .pgproxy import PgFaultProxy
from .processes import free_port, kill_now
from .services import PostgresCluster, PostgresNode

__all__ = ["HaCluster", "HaServer"]


def _chunk_write(sql: str) -> bool:
    return "INSERT INTO onceflow_chunks" in sql


class HaServer:
    """One ``onceflow serve --store`` process on a fixed port, its output in a log file; restartable."""

    def __init__(
        self, name: str, store: str, log: Path, extra: tuple[str, ...], env: dict[str, str] | None = None
    ) -> None:
        self.name, self.store, self.log, self.extra = name, store, log, extra
        self.env = env  # added to the environment it runs in (a steppable clock's)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "onceflow.cli", "serve", "--store", self.store, "--port", str(self.port)]
        with open(self.log, "ab") as log:
            log.write(f"\n=== {self.name} start {self.starts + 1} at {time.strftime('%H:%M:%S')}\n".encode())
            env = None if self.env is None else {**os.environ, **self.env}
            self.proc = subprocess.Popen([*cmd, *self.extra], stdout=log, stderr=subprocess.STDOUT, env=env)  # noqa: S603
        self.starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def leads(self, timeout: float = 2.0) -> bool:
        """Whether it leads (``GET /v1/leader``: each server's own view, never passed on); False when
        it does not answer within ``timeout`` s."""
        if not self.alive():
            return False
        try:
            with urllib.request.urlopen(f"{self.url}/v1/leader", timeout=timeout) as r:  # noqa: S310 - loopback
                return bool(json.load(r)["leads"])
        except (OSError, ValueError, KeyError):
            return False

    def kill(self) -> None:
        """``kill -9`` (continued first if stopped)."""
        kill_now(self.proc)
        self.proc = None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (a clean stop hands the lease over), then ``kill -9`` if it lingers."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        self.kill()


class HaCluster:
    """``servers`` onceflow servers sharing a :class:`PostgresCluster` (primary + synchronous standby).

    :attr:`url` names every server (``http://127.0.0.1:P1,127.0.0.1:P2``): clients given it fail over
    (docs/client.md). ``lease_seconds`` is short by default so that a killed leader is replaced
    quickly. Faults: :meth:`kill` a server, :meth:`restart` it, :meth:`fail_over_database` (kill -9
    of the primary, then promotion of the standby; the old primary stays down),
    :meth:`pause_database` and :meth:`resume_database` (SIGSTOP and SIGCONT of the primary),
    :meth:`lose_standby` and :meth:`restore_standby` (the synchronous standby killed or stopped, then
    back), :meth:`rejoin_database` (the old primary rewound as the new standby), and with
    ``commit_faults`` (each server reaches each database node through a proxy of its own that reads
    the protocol) :meth:`lose_commit` (the answer to a sync's COMMIT lost, an unknown outcome for
    the server) and :meth:`partition` / :meth:`heal` (one server cut off from the database: nothing
    answered, nothing refused). With ``clock_faults`` every server and the database run on a
    :class:`~onceflow.testing.faketime.SteppableClock` of their own (:attr:`clocks`, by server name
    and ``"database"`` for both nodes): :meth:`step_clock` steps one's wall clock.

    ``failover_manager="patroni"``: the database is a :class:`~onceflow.testing.patroni.PatroniCluster`
    (etcd and two Patroni-managed nodes, synchronous mode) instead: :meth:`fail_over_database` kills
    the primary's postgres and waits for Patroni to promote the standby (nothing by hand), and Patroni
    brings the old node back as the new standby, so the database can fail over again. With
    ``clock_faults`` the database's clock is that of both Patronis too (one machine's clock)."""

    def __init__(
        self,
        *,
        servers: int = 2,
        lease_seconds: float = 3.0,
        work: Path | None = None,
        extra: tuple[str, ...] = (),
        commit_faults: bool = False,
        clock_faults: bool = False,
        failover_manager: Literal["none", "patroni"] = "none",
    ) -> None:
        self.n = servers
        self.failover_manager = failover_manager
        self.lease_seconds = lease_seconds
        self.extra = extra
        self.commit_faults = commit_faults  # each server reaches each node through a PgFaultProxy of its own
        self.db_proxies: list[PgFaultProxy] = []  # all of them
        self.proxies_of: dict[str, list[PgFaultProxy]] = {}  # a server's name -> its proxies, one per node
        self.partitioned: set[str] = set()  # the servers cut off from the database now
        self._paused: PostgresNode | None = None  # the database node pause_database() stopped
        self._lost: tuple[PostgresNode, str] | None = None  # the standby lose_standby() took away, and how
        self._own_work = work is None
        self.work = Path(tempfile.mkdtemp(prefix="onceflow-ha-")) if work is None else work
        self.clocks: dict[str, SteppableClock] = {}
        self._clock_dir: Path | None = None
        if clock_faults:  # readable by PostgreSQL's own user (nobody, when we are root)
            self._clock_dir = Path(tempfile.mkdtemp(prefix="onceflow-clocks-"))
            self._clock_dir.chmod(0o755)
            for name in [f"server-{i}" for i in range(servers)] + ["database"]:
                self.clocks[name] = SteppableClock(self._clock_dir / name)
        db_clock = self.clocks.get("database")
        db_env = None if db_clock is None else db_clock.env()
        self.pg: PostgresCluster | PatroniCluster = (
            PatroniCluster(env=db_env, keep_logs=None if self._own_work else self.work)
            if failover_manager == "patroni"
            else PostgresCluster(env=db_env)
        )
        self.servers: list[HaServer] = []

    @property
    def url(self) -> str:
        return "http://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def start(self, timeout: float = 120.0) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.pg.start()
        extra = ("--lease-seconds", str(self.lease_seconds), *self.extra)
        self.servers = []
        for i in range(self.n):
            name, store = f"server-{i}", self.pg.conninfo()
            if self.commit_faults:
                proxies = self.proxies_of[name] = [PgFaultProxy(node.port).start() for node in self.pg.nodes]
                self.db_proxies += proxies
                hosts = ",".join(f"127.0.0.1:{p.port}" for p in proxies)
                store = (
                    f"postgresql://postgres@{hosts}/postgres?target_session_attrs=read-write&connect_timeout=2"
                    "&sslmode=disable&gssencmode=disable"
                )
            clock = self.clocks.get(name)
            env = None if clock is None else clock.env()
            self.servers.append(HaServer(name, store, self.work / f"{name}.log", extra, env))
        for s in self.servers:
            s.start()
        self.leader(timeout)

    def leader(self, timeout: float = 60.0) -> HaServer:
        """The server that leads, waiting up to ``timeout`` s for one to."""
        deadline = time.monotonic() + timeout
        while True:
            for s in self.servers:
                if s.leads():
                    return s
            if time.monotonic() > deadline:
                raise RuntimeError(f"no onceflow server leads within {timeout:g} s; see {self.work}/server-*.log")
            time.sleep(0.05)

    def kill(self, server: HaServer) -> None:
        server.kill()

    def restart(self, server: HaServer) -> None:
        server.kill()
        server.start()

    def lose_commit(self, how: Literal["answer", "request"] = "answer") -> int:
        """The next COMMIT of a sync (a transaction that writes a chunk of a file) loses its answer
        (``"answer"``: committed, the server hears nothing) or is never sent (``"request"``: rolled
        back, the same error). Needs ``commit_faults``; returns how many COMMITs were lost so far."""
        if not self.db_proxies:
            raise RuntimeError("HaCluster(commit_faults=True) loses COMMIT answers; this one was made without")
        for proxy in self.db_proxies:  # the primary's proxy sees the next one (writes go to the primary)
            proxy.disarm()
            proxy.arm(_chunk_write, how)
        return sum(p.lost for p in self.db_proxies)

    def keep_commits(self) -> None:
        """Lose no more COMMITs: what :meth:`lose_commit` armed and did not happen is called off."""
        for proxy in self.db_proxies:
            proxy.disarm()

    @property
    def commits_lost(self) -> int:
        return sum(p.lost for p in self.db_proxies)

    def partition(self, server: HaServer) -> None:
        """Cut ``server`` off from every database node: its open connections go silent and new ones are
        never answered (:attr:`PgFaultProxy.blackhole`), so it learns only by its timeouts. Needs
        ``commit_faults``. :meth:`heal` ends it."""
        proxies = self.proxies_of.get(server.name)
        if not proxies:
            raise RuntimeError("HaCluster(commit_faults=True) partitions servers; this one was made without")
        for proxy in proxies:
            proxy.blackhole = True
        self.partitioned.add(server.name)

    def heal(self, server: HaServer | None = None) -> None:
        """End the partition of ``server`` (every server's if None): what waited is delivered."""
        for name, proxies in self.proxies_of.items():
            if server is None or name == server.name:
                for proxy in proxies:
                    proxy.blackhole = False
                self.partitioned.discard(name)

    def step_clock(self, name: str, seconds: int) -> int:
        """Step the wall clock of server ``name`` (or of the database, ``"database"``: both nodes) by
        ``seconds``; its new offset from the real clock. Needs ``clock_faults``."""
        clock = self.clocks.get(name)
        if clock is None:
            raise RuntimeError(f"no steppable clock {name!r}: HaCluster(clock_faults=True) makes them")
        return clock.step(seconds)

    def pause_database(self) -> str:
        """SIGSTOP of every process of the PostgreSQL primary (a frozen VM); its name."""
        node = self.pg.primary()
        if node is None:
            raise RuntimeError(f"no primary to pause: {self.pg.roles()}")
        node.signal(signal.SIGSTOP)
        self._paused = node
        return node.name

    def resume_database(self) -> None:
        """SIGCONT of what :meth:`pause_database` stopped."""
        node, self._paused = self._paused, None
        if node is not None:
            node.signal(signal.SIGCONT)

    def fail_over_database(self) -> float:
        """``kill -9`` of the PostgreSQL primary, then promotion of the standby (by ``pg_ctl promote``, or
        with Patroni by Patroni: then waited for); the seconds the promotion took (with Patroni: from
        the kill)."""
        if isinstance(self.pg, PatroniCluster):
            began = time.perf_counter()
            self.pg.wait_promoted(self.pg.kill_primary())
            return time.perf_counter() - began
        self.pg.kill_primary()
        return self.pg.promote()

    def lose_standby(self, how: Literal["kill", "stop"] = "kill") -> str:
        """The synchronous standby lost: ``kill -9`` of every process of it (``"kill"``) or SIGSTOP
        (``"stop"``, a frozen VM). The primary's commits then wait for it (``synchronous_commit``):
        none returns until :meth:`restore_standby`. Its name. Not with Patroni (a ``RuntimeError``):
        Patroni restarts the standby itself and, in non-strict ``synchronous_mode``, lets the primary
        commit alone meanwhile."""
        node = self._by_hand("lose_standby").standby()
        if node is None:
            raise RuntimeError(f"no standby to lose: {self.pg.roles()}")
        if how == "kill":
            node.kill()
        else:
            node.signal(signal.SIGSTOP)
        self._lost = (node, how)
        return node.name

    def restore_standby(self, timeout: float = 60.0) -> None:
        """The standby :meth:`lose_standby` took away back: restarted on its port, or SIGCONT; returns
        once the primary sees it streaming and synchronous again (the commits that waited return)."""
        lost, self._lost = self._lost, None
        if lost is None:
            return
        node, how = lost
        pg = self._by_hand("restore_standby")
        if how == "kill":
            pg.restart(node)
        else:
            node.signal(signal.SIGCONT)
        primary = pg.primary()
        if primary is not None:
            pg._wait_synchronous(primary, node, timeout)

    def rejoin_database(self) -> str:
        """The old primary, down since :meth:`fail_over_database` (or a kill and a promotion), rewound
        with ``pg_rewind`` and started as the new primary's synchronous standby
        (:meth:`PostgresCluster.rejoin`): the database can fail over again. Its name. Not with Patroni
        (a ``RuntimeError``): Patroni rewinds the old primary itself."""
        pg = self._by_hand("rejoin_database")
        down = [node for node in pg.nodes if node.role() == "down"]
        if len(down) != 1:
            raise RuntimeError(f"no old primary to rejoin: {pg.roles()}")
        pg.rejoin(down[0])
        return down[0].name

    def _by_hand(self, what: str) -> PostgresCluster:
        """The database as a :class:`PostgresCluster`, whose nodes the harness manages itself; with
        Patroni, which manages them, ``what`` is a ``RuntimeError``."""
        if isinstance(self.pg, PatroniCluster):
            raise RuntimeError(f"{what}: Patroni manages the standby and the old primary itself")
        return self.pg

    def status(self) -> dict[str, object]:
        return {
            "servers": {s.name: {"url": s.url, "alive": s.alive(), "starts": s.starts} for s in self.servers},
            "database": self.pg.roles(),
        }

    def stop(self) -> None:
        self.resume_database()
        if self._lost is not None and self._lost[1] == "stop":
            self._lost[0].signal(signal.SIGCONT)
        for s in self.servers:
            s.kill()
        for proxy in self.db_proxies:
            proxy.stop()
        self.pg.stop()
        if self._clock_dir is not None:
            shutil.rmtree(self._clock_dir, ignore_errors=True)
        if self._own_work:
            shutil.rmtree(self.work, ignore_errors=True)

    def __enter__(self) -> HaCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"HaCluster({json.dumps(self.status())})"
