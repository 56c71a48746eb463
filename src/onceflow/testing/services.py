"""Throwaway PostgreSQL and Redis servers for tests, benches and chaos runs (public through :mod:`onceflow.testing`).

Each lives in its own temporary directory and listens on free loopback ports (never the standard
5432 / 6379, so an installed server is never touched); ``stop()`` ends it and removes the
directory. PostgreSQL: ``initdb`` + ``pg_ctl`` from ``pg_config --bindir`` (or
``/usr/lib/postgresql/*/bin``), its Unix socket in the temporary directory; ``initdb`` refuses to
run as root, so as root PostgreSQL runs as the unprivileged user ``nobody``. :class:`PostgresServer`
is one instance, :class:`PostgresCluster` a primary with a synchronous standby and the faults of a
failover; both are made of :class:`PostgresNode`, one postmaster. Redis: ``redis-server`` without
persistence unless asked (``appendonly``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from ..errors import OnceflowError
from .processes import free_port

__all__ = [
    "PostgresCluster",
    "PostgresNode",
    "PostgresRole",
    "PostgresServer",
    "RedisServer",
    "ServiceUnavailable",
    "postgres_bindir",
]

PostgresRole = Literal["primary", "standby", "down"]
"""What a :class:`PostgresNode` is now: ``primary`` (takes writes), ``standby`` (in recovery), ``down``."""


class ServiceUnavailable(OnceflowError, RuntimeError):
    """The server's binaries are not installed (``scripts/setup.sh dev`` installs them)."""


def postgres_bindir() -> Path:
    """Where ``initdb`` and ``pg_ctl`` are."""
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True).stdout.strip()
        if out and (Path(out) / "initdb").exists():
            return Path(out)
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb:
        return Path(os.path.realpath(initdb)).parent
    raise ServiceUnavailable(
        "PostgreSQL's initdb was not found (pg_config --bindir, /usr/lib/postgresql/*/bin, PATH); "
        "scripts/setup.sh dev installs Debian's postgresql package"
    )


def _server_user() -> str | None:
    """Who runs PostgreSQL's programs: ``nobody`` when we are root (``initdb`` and ``postgres`` refuse root)."""
    return "nobody" if os.geteuid() == 0 else None


def _make_dir(path: Path) -> Path:
    """``path`` created (its parent must exist) and, as root, handed to the user PostgreSQL runs as."""
    path.mkdir(exist_ok=True)
    user = _server_user()
    if user is not None:
        pw = pwd.getpwnam(user)
        os.chown(path, pw.pw_uid, pw.pw_gid)
    return path


def _stat(pid: int) -> tuple[str, int] | None:
    """A process's state letter and parent pid (``/proc/<pid>/stat``); ``None`` once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, ppid = stat[stat.rindex(")") + 2 :].split(maxsplit=2)[:2]
    return state, int(ppid)


def _alive(pid: int) -> bool:
    """Running or exiting, not yet a zombie (a zombie only waits to be reaped)."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in "ZX"


def _node_processes(data: Path, postmaster: int | None) -> list[int]:
    """The live processes working in ``data`` (a postmaster and its children, orphaned or not) and, while
    ``postmaster`` is one of them, its children that are exiting (a process lets go of its working
    directory before it is a zombie)."""
    target = os.path.realpath(data)
    in_data, children = [], []
    with contextlib.suppress(OSError), os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            pid = int(entry.name)
            with contextlib.suppress(OSError):  # gone meanwhile, exiting, or not ours to read
                if os.readlink(f"/proc/{pid}/cwd") == target:
                    in_data.append(pid)
                    continue
            stat = _stat(pid)
            if stat is not None and stat[0] not in "ZX" and stat[1] == postmaster:
                children.append(pid)
    return in_data + children if postmaster in in_data else in_data


def _base_settings(*, fsync: bool, max_prepared_transactions: int) -> dict[str, str]:
    return {
        "fsync": "on" if fsync else "off",
        "max_prepared_transactions": str(max_prepared_transactions),
        "max_connections": "100",
    }


class PostgresNode:
    """One postmaster of a throwaway PostgreSQL: its data directory, log and Unix socket under ``root``.

    :meth:`initdb` or :meth:`basebackup` makes the data directory; :meth:`start` runs ``pg_ctl start``
    on a free loopback port (another one if that port is taken meanwhile), each setting as ``-c
    name=value`` on the command line, not in the data directory's files, so that a base backup does
    not copy it. As root, PostgreSQL's programs run as ``nobody``. :meth:`sql` runs a query with
    ``psql`` (no Python driver needed). ``conninfo(dbname)`` connects as the superuser ``postgres``
    (trust authentication, loopback only).

    Its processes are those working in its data directory: the postmaster and every child it forked,
    orphaned or not (each child of a postmaster runs in a session of its own, so no process group
    holds them all). :meth:`kill` and :meth:`stop` return once none is left.
    """

    def __init__(self, name: str, root: Path, *, bindir: Path | None = None) -> None:
        self.name = name
        self.root = root
        self.bindir = bindir if bindir is not None else postgres_bindir()
        self.port = 0
        self._user = _server_user()

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log(self) -> Path:
        return self.root / "postgres.log"

    def _run(self, argv: list[str], timeout: float = 120.0, env: Mapping[str, str] | None = None) -> None:
        """One of PostgreSQL's programs, as the server's user; ``RuntimeError`` with its output if it fails.
        ``env``: variables added to this process's environment for it (and what it starts)."""
        kw: dict[str, object] = {} if env is None else {"env": {**os.environ, **env}}
        if self._user is not None:
            pw = pwd.getpwnam(self._user)
            kw |= {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=self.root, check=False, **kw)  # type: ignore[call-overload]
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:2])} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""

    def initdb(self) -> None:
        """A new data directory: ``initdb`` with the superuser ``postgres``, trust authentication, UTF8, C locale."""
        _make_dir(self.root)
        self._run(
            [
                str(self.bindir / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ]
        )

    def basebackup(self, source: PostgresNode, *, user: str, slot: str | None = None) -> None:
        """The data directory as a streaming standby of ``source``: ``pg_basebackup -R`` as ``user``.

        ``-R`` writes ``standby.signal`` and a ``primary_conninfo`` whose ``application_name`` is this
        node's name (what the source's ``synchronous_standby_names`` and ``pg_stat_replication`` call
        it); ``slot``, when given, is a physical replication slot created on the source for it.
        """
        _make_dir(self.root)
        argv = [
            str(self.bindir / "pg_basebackup"),
            "-D",
            str(self.data),
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
            "--no-sync",
            "-d",
            f"host=127.0.0.1 port={source.port} user={user} application_name={self.name}",
        ]
        if slot is not None:
            argv += ["-C", "-S", slot]
        self._run(argv)

    def start(
        self,
        settings: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        *,
        same_port: bool = False,
    ) -> None:
        """``pg_ctl start -w`` on a free loopback port; returns once it accepts connections (a standby: read-only).
        ``env``: variables added to the environment the postmaster runs in (e.g. a faked clock's).
        ``same_port``: a restart, on the port it had (what proxies and connection strings name)."""
        opts = " ".join(f"-c {shlex.quote(f'{k}={v}')}" for k, v in (settings or {}).items())
        last: Exception | None = None
        for attempt in range(3):  # a free port can be taken between the probe and the bind
            if not (same_port and self.port):
                self.port = free_port()
            elif attempt:
                time.sleep(0.5)  # its old port, still held by a dying process: again
            try:
                self._run(
                    [
                        str(self.bindir / "pg_ctl"),
                        "-D",
                        str(self.data),
                        "-l",
                        str(self.log),
                        "-w",
                        "-t",
                        "60",
                        "-o",
                        f"-p {self.port} -h 127.0.0.1 -k {shlex.quote(str(self.root))} {opts}",
                        "start",
                    ],
                    env=env,
                )
                return
            except RuntimeError as exc:
                last = exc
        raise RuntimeError(f"PostgreSQL {self.name} did not start: {last}\n{self._log_tail()}")

    def conninfo(self, dbname: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname} connect_timeout=10"

    def sql(self, query: str, dbname: str = "postgres") -> str:
        """``query`` through ``psql`` as ``postgres``; its rows, one a line, columns separated by ``|``."""
        proc = subprocess.run(
            [str(self.bindir / "psql"), "-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1"]
            + ["-d", self.conninfo(dbname), "-c", query],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"psql on {self.name} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc.stdout.strip()

    def _pidfile_pid(self) -> int | None:
        try:
            return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def processes(self) -> list[int]:
        """The pids of this node's live processes: its postmaster and the postmaster's children."""
        return _node_processes(self.data, self._pidfile_pid())

    @property
    def pid(self) -> int | None:
        """The postmaster's pid while it runs (from ``postmaster.pid``, which a killed node leaves behind)."""
        pid = self._pidfile_pid()
        return pid if pid is not None and pid in _node_processes(self.data, None) else None

    def role(self) -> PostgresRole:
        """``primary`` (not in recovery), ``standby`` (in recovery) or ``down`` (not running or not answering)."""
        if self.pid is None:
            return "down"
        try:
            in_recovery = self.sql("SELECT pg_is_in_recovery()")
        except (RuntimeError, subprocess.TimeoutExpired):
            return "down"
        return "standby" if in_recovery == "t" else "primary"

    def promote(self, timeout: float = 60.0) -> None:
        """``pg_ctl promote -w``, then wait until the node says it is out of recovery (takes writes)."""
        self._run([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-w", "-t", str(int(timeout)), "promote"])
        deadline = time.monotonic() + timeout
        while (role := self.role()) != "primary":
            if time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL {self.name} is still {role} {timeout:.0f} s after pg_ctl promote")
            time.sleep(0.02)

    def rewind(self, source: PostgresNode) -> None:
        """Make this node (down: killed, or stopped) a standby of ``source``, which was promoted in its
        place: ``pg_rewind`` takes back what it wrote after the timelines forked (WAL the standby never
        flushed, so never acknowledged), copies what ``source`` wrote since, and ``-R`` writes
        ``standby.signal`` and a ``primary_conninfo`` to ``source`` whose ``application_name`` is
        this node's name. A node killed without a clean shutdown is first recovered by pg_rewind
        itself (single-user mode). Needs ``wal_log_hints`` (:class:`PostgresCluster` sets it) and a
        checkpoint on ``source`` since its promotion (for its new timeline to be in its control file)."""
        self._run(
            [
                str(self.bindir / "pg_rewind"),
                "--target-pgdata",
                str(self.data),
                "--source-server",
                f"host=127.0.0.1 port={source.port} user=postgres dbname=postgres application_name={self.name}",
                "--write-recovery-conf",
                "--no-sync",
            ]
        )

    def signal(self, sig: int) -> list[int]:
        """``sig`` to every process of the node (the postmaster and its children): SIGSTOP freezes it
        as a paused VM would, SIGCONT thaws it. The pids signalled."""
        pids = self.processes()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def kill(self) -> None:
        """SIGKILL the postmaster, then what is left of its children: a crash, not a shutdown.

        No shutdown checkpoint, ``postmaster.pid`` stays; nothing restarts it. Returns once none of the
        node's processes is left.
        """
        processes = self.processes()
        pid = self.pid
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._kill_leftovers(processes)

    def stop(self) -> None:
        """``pg_ctl stop -m immediate`` if it runs, SIGKILL for any process left; a killed node's shared memory
        segment is removed, and so is ``postmaster.pid``. The directory stays (its owner removes it)."""
        processes = self.processes()
        if self.pid is not None:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self._run([str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"], 60)
        self._kill_leftovers(processes)
        self._remove_orphaned_shared_memory()
        # none of its processes is left, but a killed postmaster may linger as a zombie nobody reaps (a
        # container's init): its pid in postmaster.pid would make the next start refuse to run
        (self.data / "postmaster.pid").unlink(missing_ok=True)

    def _kill_leftovers(self, known: list[int], timeout: float = 10.0) -> None:
        """SIGKILL whatever is left of ``known`` and of the node's processes; return once none is alive."""
        pending = set(known)
        deadline = time.monotonic() + timeout
        while pending := {pid for pid in pending.union(self.processes()) if _alive(pid)}:
            if time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL {self.name}: processes {sorted(pending)} survive SIGKILL")
            for pid in pending:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)

    def _remove_orphaned_shared_memory(self) -> None:
        # A postmaster removes its System V segment when it shuts down; a killed one leaves it (56 bytes,
        # but one per kill, up to the system's limit on segments). postmaster.pid's 7th line is
        # "key shmid"; the segment goes only if that postmaster created it and nothing is attached.
        with contextlib.suppress(OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            lines = (self.data / "postmaster.pid").read_text().splitlines()
            pid, shmid = int(lines[0]), int(lines[6].split()[1])
            for row in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]:
                _key, found, _perms, _size, cpid, _lpid, nattch, *_ = row.split()
                if int(found) == shmid and int(cpid) == pid and int(nattch) == 0:
                    subprocess.run(["ipcrm", "-m", str(shmid)], capture_output=True, timeout=10, check=False)


class PostgresServer:
    """``initdb`` into a temporary directory, then ``pg_ctl start`` on a free loopback port.

    ``conninfo(dbname)`` connects as the superuser ``postgres`` (trust authentication, loopback
    only). ``fsync=False`` trades crash safety of the database itself for speed (tests kill
    clients, not this server). ``max_prepared_transactions`` > 0 enables two-phase commit.
    """

    def __init__(self, *, fsync: bool = True, max_prepared_transactions: int = 64) -> None:
        self.bindir = postgres_bindir()
        self.fsync = fsync
        self.max_prepared_transactions = max_prepared_transactions
        self.root: Path | None = None
        self.node: PostgresNode | None = None

    @property
    def port(self) -> int:
        return self.node.port if self.node is not None else 0

    @property
    def data(self) -> Path:
        assert self.node is not None, "start() first"
        return self.node.data

    def start(self) -> None:
        self.root = _make_dir(Path(tempfile.mkdtemp(prefix="onceflow-pg-")))
        self.node = PostgresNode("postgres", self.root, bindir=self.bindir)
        try:
            self.node.initdb()
            self.node.start(_base_settings(fsync=self.fsync, max_prepared_transactions=self.max_prepared_transactions))
        except BaseException:
            self.stop()
            raise

    def conninfo(self, dbname: str = "postgres") -> str:
        assert self.node is not None, "start() first"
        return self.node.conninfo(dbname)

    def stop(self) -> None:
        try:
            if self.node is not None:
                self.node.stop()
        finally:
            if self.root is not None:
                shutil.rmtree(self.root, ignore_errors=True)
            self.root = None
            self.node = None

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class NodeRoles:
    """What a cluster of PostgreSQL nodes (:attr:`nodes`) tells about them, asked of the nodes now:
    the URL that reaches the primary, each node's role, the primary, a standby. Shared by
    :class:`PostgresCluster` and the Patroni-managed cluster (testing/patroni.py)."""

    nodes: tuple[PostgresNode, ...]

    def conninfo(self, dbname: str = "postgres") -> str:
        """A libpq URL naming every node, ``target_session_attrs=read-write``: it reaches the primary."""
        assert self.nodes, "start() first"
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in self.nodes)
        return f"postgresql://postgres@{hosts}/{dbname}?target_session_attrs=read-write&connect_timeout=2"

    def roles(self) -> dict[str, PostgresRole]:
        """Each node's role now, by name (asked of the nodes, not remembered)."""
        return {node.name: node.role() for node in self.nodes}

    def primary(self) -> PostgresNode | None:
        """The node that takes writes now; ``None`` if none does. Two that do are a ``RuntimeError``."""
        found = [node for node in self.nodes if node.role() == "primary"]
        if len(found) > 1:
            raise RuntimeError(f"two primaries: {', '.join(node.name for node in found)}")
        return found[0] if found else None

    def standby(self) -> PostgresNode | None:
        """A running node in recovery; ``None`` if there is none (after a promotion)."""
        return next((node for node in self.nodes if node.role() == "standby"), None)


class PostgresCluster(NodeRoles):
    """A throwaway PostgreSQL primary and its synchronous standby on loopback, for failover tests and demos.

    ``nodes[0]`` (``node0``) starts as the primary, ``nodes[1]`` (``node1``) as its standby, each on a
    free loopback port, both in one temporary directory. :meth:`start`:

    1. ``initdb`` node0 and start it with ``wal_level=replica``, ``max_wal_senders``,
       ``hot_standby=on``, ``synchronous_commit=on`` and ``synchronous_standby_names=node1``; create
       the role ``replicator`` (``REPLICATION``; ``initdb -A trust`` already trusts replication
       connections from 127.0.0.1).
    2. ``pg_basebackup -R`` node1 from node0 (``primary_conninfo`` with ``application_name=node1``, a
       physical replication slot ``node1`` on node0) and start it as a hot standby.
    3. Wait until node0's ``pg_stat_replication`` shows node1 ``streaming`` and ``sync``: from then on
       a commit on node0 returns only once node1 has flushed its WAL (not yet replayed it: a read on
       node1 right after the commit may not see it; ``synchronous_commit=remote_apply`` waits for that).

    ``synchronous_standby_names`` is on node0's command line only, not in the files the base backup
    copies, so a promoted node1, which has no standby, does not wait for one: its commits return.

    :meth:`conninfo` names both nodes with ``target_session_attrs=read-write``: libpq (psycopg)
    connects to whichever takes writes. Faults: :meth:`kill_primary` (its processes SIGKILLed; it
    stays down) and :meth:`promote` (the standby, timed). :meth:`primary`, :meth:`standby` and
    :meth:`roles` ask the nodes what they are now. Nothing fails over by itself; :meth:`rejoin`
    brings a killed old primary back as the new primary's synchronous standby (``pg_rewind``), after
    which the pair can fail over again, and :meth:`restart` starts a killed standby again. Promoting
    while the primary still runs makes two primaries, which :meth:`primary` refuses to choose between.
    """

    REPLICATION_USER = "replicator"

    def __init__(
        self, *, fsync: bool = True, max_prepared_transactions: int = 64, env: Mapping[str, str] | None = None
    ) -> None:
        self.env = env  # added to the environment both postmasters run in (e.g. a faked clock's)
        self.bindir = postgres_bindir()
        for program in ("pg_basebackup", "psql"):
            if not (self.bindir / program).exists():
                raise ServiceUnavailable(
                    f"PostgreSQL's {program} is not in {self.bindir} (Debian's postgresql package)"
                )
        self.fsync = fsync
        self.max_prepared_transactions = max_prepared_transactions
        self.root: Path | None = None
        self.nodes: tuple[PostgresNode, ...] = ()
        self.settings: dict[str, str] = {}

    def start(self, timeout: float = 60.0) -> None:
        self.root = _make_dir(Path(tempfile.mkdtemp(prefix="onceflow-pgha-")))
        primary = PostgresNode("node0", self.root / "node0", bindir=self.bindir)
        standby = PostgresNode("node1", self.root / "node1", bindir=self.bindir)
        self.nodes = (primary, standby)
        settings = {
            **_base_settings(fsync=self.fsync, max_prepared_transactions=self.max_prepared_transactions),
            "wal_level": "replica",
            "max_wal_senders": "10",
            "hot_standby": "on",
            "synchronous_commit": "on",
            "wal_log_hints": "on",  # what pg_rewind needs of a cluster without data checksums (rejoin)
        }
        self.settings = settings  # a standby's, and a promoted node's (no synchronous_standby_names)
        try:
            # Step 1: the primary; its own commits do not wait while it has no standby yet
            primary.initdb()
            # in the files too (the base backup copies them): pg_rewind's crash recovery of a killed
            # node runs without the command line's settings, and its checkpoint records this one
            with open(primary.data / "postgresql.conf", "a") as conf:
                conf.write("\nwal_log_hints = on\n")
            primary.start({**settings, "synchronous_standby_names": standby.name}, env=self.env)
            primary.sql(f"SET synchronous_commit = local; CREATE ROLE {self.REPLICATION_USER} WITH REPLICATION LOGIN")
            # Step 2: the standby
            standby.basebackup(primary, user=self.REPLICATION_USER, slot=standby.name)
            standby.start(settings, env=self.env)
            # Step 3: streaming, and synchronous
            self._wait_synchronous(primary, standby, timeout)
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _wait_synchronous(primary: PostgresNode, standby: PostgresNode, timeout: float) -> None:
        query = "SELECT application_name, state, sync_state FROM pg_stat_replication"
        deadline = time.monotonic() + timeout
        while f"{standby.name}|streaming|sync" not in (seen := primary.sql(query)).splitlines():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{standby.name} is no synchronous standby of {primary.name} after {timeout:.0f} s "
                    f"(pg_stat_replication: {seen!r}); its log:\n{standby._log_tail()}"
                )
            time.sleep(0.05)

    def kill_primary(self) -> PostgresNode:
        """SIGKILL the primary's postmaster and its children (:meth:`PostgresNode.kill`); returns that node.

        It stays down; the standby keeps trying to reach it, in recovery, until :meth:`promote`.
        """
        node = self.primary()
        if node is None:
            raise RuntimeError(f"no primary to kill: {self.roles()}")
        node.kill()
        return node

    def promote(self, timeout: float = 60.0) -> float:
        """``pg_ctl promote`` the standby and wait until it takes writes; returns the seconds that took."""
        node = self.standby()
        if node is None:
            raise RuntimeError(f"no standby to promote: {self.roles()}")
        began = time.perf_counter()
        node.promote(timeout)
        return time.perf_counter() - began

    def restart(self, node: PostgresNode) -> None:
        """Start ``node`` again after a kill, on its port, with the settings of a standby (a standby
        resumes streaming from where it was)."""
        node.stop()  # what a kill left: its shared memory segment
        node.start(self.settings, env=self.env, same_port=True)

    def rejoin(self, node: PostgresNode, timeout: float = 60.0) -> None:
        """The old primary ``node`` (down after :meth:`kill_primary` and :meth:`promote`) back as the
        synchronous standby of the node promoted in its place, so that the pair can fail over again.

        1. A checkpoint on the new primary (its new timeline in its control file, for pg_rewind), and
           a physical replication slot there named after ``node``.
        2. ``pg_rewind`` of ``node`` from it (:meth:`PostgresNode.rewind`), which drops what ``node``
           wrote that its standby never flushed: no commit of it was acknowledged.
        3. ``node`` started on its port as a hot standby (no ``synchronous_standby_names`` of its own,
           so that when it is promoted in turn, its commits return).
        4. ``synchronous_standby_names`` set to ``node`` on the new primary (``ALTER SYSTEM``, a
           reload); from the moment :meth:`_wait_synchronous` sees it ``sync``, commits wait for it
           again. Until then, since the promotion, a commit was acknowledged with one copy.

        The new primary's ``postgresql.auto.conf`` is copied by the rewind before step 4 writes it, so
        no node ever names itself as its own standby."""
        primary = self.primary()
        if primary is None or primary is node:
            raise RuntimeError(f"no other primary to rejoin {node.name} to: {self.roles()}")
        # Step 1
        primary.sql("CHECKPOINT")
        slot = f"'{node.name}'"  # our own node's name, never input
        primary.sql(
            f"SELECT pg_create_physical_replication_slot({slot}) WHERE NOT EXISTS "  # noqa: S608
            f"(SELECT 1 FROM pg_replication_slots WHERE slot_name = {slot})"
        )
        # Step 2
        node.stop()  # nothing of it runs (pg_rewind refuses a running target); its shared memory goes
        node.rewind(primary)
        with open(node.data / "postgresql.auto.conf", "a") as conf:  # the copied one names the source's slot
            conf.write(f"primary_slot_name = '{node.name}'\n")
        # Step 3
        node.start(self.settings, env=self.env, same_port=True)
        # Step 4
        primary.sql(f"ALTER SYSTEM SET synchronous_standby_names = '{node.name}'")
        primary.sql("SELECT pg_reload_conf()")
        self._wait_synchronous(primary, node, timeout)

    def stop(self) -> None:
        """Stop every node (:meth:`PostgresNode.stop`: none of their processes is left) and remove the directory."""
        failures: list[RuntimeError] = []
        for node in self.nodes:  # each one, whatever the others do
            try:
                node.stop()
            except RuntimeError as exc:
                failures.append(exc)
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
        self.root = None
        self.nodes = ()
        if failures:
            raise failures[0]

    def __enter__(self) -> PostgresCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisServer:
    """``redis-server`` on a free loopback port, in the foreground as a child process."""

    def __init__(self, *, appendonly: bool = False, appendfsync: str = "everysec") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServiceUnavailable(
                "redis-server was not found on PATH; scripts/setup.sh dev installs Debian's redis-server package"
            )
        self.binary = binary
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.port = 0
        self.root: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="onceflow-redis-"))
        last = ""
        for _ in range(3):
            self.port = free_port()
            argv = [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.root),
                "--save",
                "",
                "--appendonly",
                "yes" if self.appendonly else "no",
                "--appendfsync",
                self.appendfsync,
                "--daemonize",
                "no",
                "--logfile",
                str(self.root / "redis.log"),
            ]
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_ready():
                return
            self._kill()
            last = (
                (self.root / "redis.log").read_text(errors="replace")[-2000:]
                if (self.root / "redis.log").exists()
                else ""
            )
        raise RuntimeError(f"redis-server did not start:\n{last}")

    def _wait_ready(self, timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return True
            time.sleep(0.05)
        return False

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        """Kill -9 and start again on the same directory (what survives depends on ``appendonly``)."""
        self._kill()
        self.start()

    def stop(self) -> None:
        self._kill()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
