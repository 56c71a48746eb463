"""``onceflow chaos``: a mixed workload against a real server while faults are injected, then a history check.

What runs (every client is its own process and records its history, :mod:`onceflow_tools.chaos.worker`):

- idempotent producers writing ``in/0`` and ``in/1``: one directly, two through a
  :class:`~onceflow.testing.FaultProxy` that drops or delays the answers to appends;
- transactional producers writing ``tx/0`` and ``tx/1`` (commits and deliberate aborts);
- a transactional copier (``onceflow copy --live``) copying ``in/*`` to ``out/0`` and ``out/1``;
- a consumer-group member reading ``in/0`` and committing its offsets;
- a read_committed reader of every stream;
- a sink: a :class:`~onceflow.sinks.SinkRunner` feeding ``in/0`` and ``tx/0`` into a
  :class:`~onceflow.sinks.RedisAtomicSink` on a throwaway ``redis-server`` (``--sink``, on when
  ``redis-server`` is installed);
- the Spark demo pipeline (:mod:`onceflow.spark.pipeline`) on ``spark/events``, fed by one more
  idempotent producer through the proxy, in a process group of its own so that a kill takes the
  JVM with it (``--spark``, on when PySpark and Java are there).

Faults, on a schedule drawn from ``--seed`` (each kind once in a shuffled order, even if that takes
longer than ``--duration``, then at random until the duration is up):

==============  =====================================================================================
kill-server     ``kill -9`` of the server, restarted at once
stop-server     SIGSTOP of the server for up to 2 s, then SIGCONT
kill-client     ``kill -9`` of a random client, restarted (a transactional one fences its predecessor);
                the sink and the Spark driver are each killed once as soon as they have committed
                something, then drawn at random like the others
stop-client     SIGSTOP / SIGCONT of a random client (the Spark driver's whole process group)
drop-acks       the proxy drops 40 % of the answers to appends for 2-3 s (the write was done)
delay-acks      the proxy delays answers by up to 1.5 s for 2-3 s
garble-tail     ``kill -9``, then random bytes appended to every stream's tail segment (never
                acknowledged, as no server wrote them); recovery must drop them
disk-full       the server restarted under a small ``RLIMIT_FSIZE`` (SIGXFSZ ignored), so writes that
                grow a file fail with EFBIG as on a full disk, for 2-3 s; then restarted normally
read-only       the data directories made read-only for 1-2 s while a probe creates a stream (when the
                runner is root the server is started without CAP_DAC_OVERRIDE, so this bites)
==============  =====================================================================================

With ``--store postgresql`` the same clients and checks run against two ``onceflow serve --store``
servers sharing a PostgreSQL primary and its synchronous standby (:class:`~onceflow.testing.HaCluster`,
docs/ha.md): every client, and every request of the harness itself, is given both servers
(``http://127.0.0.1:P1,127.0.0.1:P2``) and fails over between them; the proxied clients are given
a fault proxy in front of each server (``http://127.0.0.1:PROXY1,127.0.0.1:PROXY2``), so whichever
server leads, their answers go through a proxy. The faults are then:

==================  =================================================================================
kill-server         ``kill -9`` of a random onceflow server (the leader the first time), restarted at
                    once (it comes back as a follower); after a leader's kill a probe append through
                    both servers is retried until acknowledged, and the seconds that took are reported
stop-server         SIGSTOP of the leader, the first time for longer than the lease's term (a follower
                    takes the lease; on SIGCONT the fenced leader exits with status 3, which the
                    harness expects here: it restarts it and counts an expected lease loss), later for
                    0.5 s up to the term + 2 s
fail-over-database  ``kill -9`` of the PostgreSQL primary and promotion of the standby; then a probe
                    append, retried until acknowledged, measures the seconds from the promotion to
                    the first acknowledged append (goal: at most 5 s), reported in the summary. The
                    old primary is down until rejoin-old-primary, the next fault; without that kind
                    in the run it stays down, and the failover happens once per run
rejoin-old-primary  right after each database failover: the old primary rewound with ``pg_rewind``
                    from the new one and started as its synchronous standby (the new primary's
                    ``synchronous_standby_names`` names it); the pair can then fail over again, and
                    the history check sees that nothing acknowledged was lost across the failovers
lose-standby        the synchronous standby killed (``kill -9``, then restarted) or stopped (SIGSTOP,
                    SIGCONT) for 1 s up to the term + 3 s: commits wait for it. A writer sends one
                    append at a time meanwhile: one sent 0.2 s after the loss and acknowledged
                    before the standby was back was acknowledged with one copy, and fails the run.
                    What the servers answered and who led are logged; with rejoin-old-primary, the
                    first time and one time in two after it, the primary is killed and the standby
                    promoted as soon as it is synchronous again
catch-up-load       40 readers read ``load/big`` (several MiB, older than the 1 MiB tail cache, so
                    read from PostgreSQL) from offset -1 again and again for 3-5 s while 3 MiB
                    values are appended to it; the leader must keep its lease (never say it does
                    not lead, nor the other server that it does, nor exit), every read must return
                    the bytes written there, and the stream must end with every acknowledged
                    append; the reads' and a small writer's latency are logged
kill-client         as above
stop-client         as above
drop-acks           as above (through both proxies)
delay-acks          as above (through both proxies)
lose-commit         the servers reach PostgreSQL through a proxy that reads its protocol: the next
                    COMMIT of a sync loses its answer (the database committed; the server must read
                    back what happened, never answer "not stored") or is never sent (rolled back)
partition           one server cut off from the database by its proxies (nothing answered, nothing
                    refused): the leader the first time, a follower the second, then the leader
                    three times in four; a leader for the term
                    + 1.5-4 s and until the other server leads (it must stop leading within the term,
                    by its own clock, and exit with status 3; the other server must lead within
                    twice the term + 4 s; never both), else a follower for 1 s up to the term + 2 s;
                    then healed
clock-step          the wall clock of the leader, a follower or the database (both nodes) stepped
                    3-25 s forward or back under libfaketime, held two or three terms, then stepped
                    back (the monotonic clocks do not move; the seals allow 30 s between servers)
sigstop-primary     SIGSTOP of every process of the PostgreSQL primary for 1 s up to the term + 2 s,
                    then SIGCONT (writes stall; a leader that cannot renew steps down)
==================  =================================================================================

``--faults`` picks some of the kinds (each still injected at least once). Every fault is logged
(``fault_log`` in the summary: kind, seconds into the run, wall time, what it hit) and, with
``--store postgresql``, a probe append of its own sent at the moment of injection and resent
until acknowledged measures the fault's *unavailability*: the seconds from the injection to the
next acknowledged append (``unavailability`` per kind, printed at the end). A leader partitioned
that keeps leading past the term, two servers leading at once, no takeover while the leader is
cut off, or no append acknowledged within 60 s of a fault fail the run.

garble-tail, disk-full and read-only act on a local data directory: there is none in this mode, so
they are left out (the summary says so). A server that exits with any status but 3 is an
unexpected exit, as in the local mode.

``--failover-manager patroni`` runs the database as a Patroni cluster instead
(:class:`~onceflow.testing.PatroniCluster`: a one-member etcd and two Patroni-managed nodes in
``synchronous_mode``, the servers given both nodes in a multi-host URL with
``target_session_attrs=read-write``; docs/ha.md, "Running with Patroni"). fail-over-database then
waits until the standby is Patroni's synchronous standby, ``kill -9``s the primary's postgres (its
Patroni lives on) and waits for Patroni to promote the standby (``primary_start_timeout: 0``: a
crashed primary is failed over, not restarted in place); nothing is promoted by hand. The summary
gives, per failover, the seconds from the kill to the promotion, from the promotion to the first
acknowledged append (a probe sent once the promotion is seen), and until Patroni had the old node
back as the synchronous standby (``pg_rewind``); the fault's ``unavailable_s`` is the seconds from
the kill to the first acknowledged append. As the old node comes back, the fault may strike again
(it is no longer once per run). Two faults are left out (the summary says so, and naming them in
``--faults`` is a usage error): rejoin-old-primary, since Patroni rewinds and brings the old primary
back itself (a ``pg_rewind`` by the harness would race it), and lose-standby, since Patroni restarts
a killed standby's postgres itself and, in ``synchronous_mode`` without ``synchronous_mode_strict``,
takes a standby it no longer sees out of ``synchronous_standby_names``, so the primary then commits
with one copy by design (docs/ha.md): the fault's one-copy check would fail every run on Patroni's
documented choice. Every other fault works as above (catch-up-load too); clock-step of the database
steps the clock of both Patronis too (one machine's clock).

At the end every client is stopped, every transactional id is initialised once more (which aborts
whatever was left open), the copier, the sink and the Spark pipeline are given time to catch up,
every stream and the sink's Redis list are read back (read_committed) into the history, and the
history is checked (:mod:`onceflow_tools.chaos.history`).
The summary (also ``summary.json`` in ``--out``) counts operations, faults injected by kind and
anomalies; the exit status is 1 if there is any anomaly.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import resource
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx

from onceflow._progress import Display, progress_display
from onceflow.client.lowlevel import http_client, request_url
from onceflow.demo import check_pipeline, sink_batch, spark_missing
from onceflow.testing import (
    FaultProxy,
    HaCluster,
    HaServer,
    PatroniCluster,
    ServiceUnavailable,
    clock_step_missing,
    free_port,
    kill_now,
)

from .history import Anomaly, HistoryWriter, check, load_history
from .worker import parse_records

__all__ = ["FAILOVER_MANAGERS", "FAULT_KINDS", "HA_FAULT_KINDS", "LOCAL_ONLY_FAULTS", "add_chaos_parser", "run_chaos"]

FAULT_KINDS = (
    "kill-server",
    "stop-server",
    "kill-client",
    "stop-client",
    "drop-acks",
    "delay-acks",
    "garble-tail",
    "disk-full",
    "read-only",
)
# --store postgresql: no local data directory, so no garble-tail, disk-full or read-only; the failover
# of the database instead (once per run without rejoin-old-primary: the old primary stays down, and
# there is no standby left after it), the loss of the standby and a load of catch-up reads
HA_FAULT_KINDS = (
    "kill-server",
    "stop-server",
    "kill-client",
    "stop-client",
    "drop-acks",
    "delay-acks",
    "lose-commit",
    "partition",
    "clock-step",
    "sigstop-primary",
    "fail-over-database",
    "rejoin-old-primary",
    "lose-standby",
    "catch-up-load",
)
LOCAL_ONLY_FAULTS = tuple(k for k in FAULT_KINDS if k not in HA_FAULT_KINDS)
FAILOVER_MANAGERS = ("none", "patroni")
REJOIN = "rejoin-old-primary"  # scheduled right after each fail-over-database, never drawn by itself
# --failover-manager patroni: the faults of the harness that would act on what Patroni manages -> why
PATRONI_LEFT_OUT = {
    REJOIN: "Patroni rewinds the old primary and brings it back itself",
    "lose-standby": "Patroni restarts a lost standby itself, and in synchronous_mode (not strict) "
    "lets the primary commit alone once it sees the standby gone",
}
FAILOVER_GOAL = 5.0  # seconds from a promotion to the first acknowledged append (docs/ha.md)
CLOCK_SEEN = 2.1  # seconds until every process on a SteppableClock runs on its new offset
CLOCK_STEP_MAX = 25  # seconds; the servers' seals allow 30 s of disagreement between their clocks (docs/ha.md)
# --store postgresql: the faults that look for their victim first and call Chaos._injected when they strike
SELF_TIMED = (
    "kill-server",
    "stop-server",
    "fail-over-database",
    "partition",
    "clock-step",
    "sigstop-primary",
    "lose-standby",
    "catch-up-load",
)
ONE_COPY_MARGIN = 0.2  # s after the standby's loss from which an append sent cannot have reached it
LOAD_STREAM = "load/big"  # catch-up-load: octet-stream, read back by the fault itself (not the history)
LOAD_READERS = 40
LOAD_APPEND = 3 << 20  # bytes of one large append of catch-up-load
LOAD_READ_LIMIT = 6 << 20  # a reader starts again from -1 after this many bytes (the stream only grows)
LOAD_APPENDS_MAX = 4  # large appends per catch-up-load
LOAD_LEADER_TIMEOUT = 5.0  # s: under the load GET /v1/leader may wait its turn on the leader's event loop
UNAVAILABLE_LIMIT = 60.0  # seconds a fault's probe append is resent before it counts as never acknowledged
PROBE_STREAM = "probe/ha"  # --store postgresql: the probe appends that time a failover
INPUTS = ["in/0", "in/1"]
TXN_STREAMS = ["tx/0", "tx/1"]
OUTPUTS = ["out/0", "out/1"]
GROUP_STREAMS = ["in/0"]
ALL_STREAMS = [*INPUTS, *TXN_STREAMS, *OUTPUTS]
SINK_INPUTS = ["in/0", "tx/0"]  # one plain, one with aborted transactions (read_committed must skip them)
SINK_JOB = "chaos-sink"
SINK_TARGET = "redis:sink-0"  # the name of the sink's Redis list in the history
SPARK_PREFIX = "spark/"
SPARK_SINK_PREFIX = "chaos-spark-"
SPARK_EVENTS, SPARK_ENRICHED, SPARK_COUNTS = (f"{SPARK_PREFIX}{s}" for s in ("events", "enriched", "counts"))
SPARK_STREAMS = [SPARK_EVENTS, SPARK_ENRICHED, SPARK_COUNTS]
_T = TypeVar("_T")
_PR_CAPBSET_DROP = 24
_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 1, 2


def _say(msg: str, display: Display | None = None) -> None:
    line = f"[chaos {time.strftime('%H:%M:%S')}] {msg}"
    if display is not None and display.active:
        display.log(line)  # above the progress bar
    else:
        print(line, flush=True)


def _drop_dac_capabilities() -> None:
    """Drop the capabilities that let root write into read-only directories (runs in the child before exec).

    After ``exec`` a root process gets the bounding set as its permitted set, so the server then obeys
    file permissions like any user (while still owning its files).
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


class Server:
    """``onceflow serve`` on a fixed port and data directory; killable, stoppable, restartable."""

    def __init__(self, data: Path, log: Path, txn_timeout: float) -> None:
        self.data, self.log, self.txn_timeout = data, log, txn_timeout
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.unprivileged = os.geteuid() == 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, fsize_limit: int | None = None) -> None:
        unprivileged = self.unprivileged

        def pre() -> None:
            if fsize_limit is not None:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death, like ENOSPC
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, fsize_limit))
            if unprivileged:  # root ignores permissions unless it gives up CAP_DAC_OVERRIDE/_READ_SEARCH
                _drop_dac_capabilities()

        cmd = [
            sys.executable,
            "-m",
            "onceflow.cli",
            "serve",
            "--data",
            str(self.data),
            "--port",
            str(self.port),
            "--long-poll-timeout",
            "1",
            "--txn-timeout",
            str(self.txn_timeout),
            "--log-level",
            "error",
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pre)  # noqa: S603
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} at start; see {self.log}")
            try:
                if httpx.get(f"{self.url}/v1/streams", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the server did not answer within 60 s; see {self.log}")

    def kill(self) -> None:
        """``kill -9`` (continued first if stopped)."""
        kill_now(self.proc)
        self.proc = None

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            self.proc.send_signal(sig)


def _process_groups(leader: int) -> set[int]:
    """The process groups of ``leader`` and of all its descendants (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for st in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int(st.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(st.parent.name))
    groups, todo = {leader}, [leader]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            with contextlib.suppress(ProcessLookupError):
                groups.add(os.getpgid(child))
    groups.discard(os.getpgrp())  # never the harness's own
    return groups


class Client:
    """A worker process (or ``onceflow copy``) that is restarted after it is killed.

    With ``group`` it runs in a process group of its own and every signal goes to the whole group
    and to the groups of its descendants (the Spark driver: its JVM, and the Python workers, which
    PySpark's daemon puts in a group of their own, die and pause with it)."""

    def __init__(self, name: str, cmd: list[str], log: Path, *, group: bool = False) -> None:
        self.name, self.cmd, self.log, self.group = name, cmd, log, group
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.kills = 0  # by the harness (kill-client)
        self.exits = 0  # found dead without having been killed

    def start(self) -> None:
        with open(self.log, "ab") as log:
            log.write(f"\n=== {self.name} start {self.starts + 1} at {time.strftime('%H:%M:%S')}\n".encode())
            self.proc = subprocess.Popen(  # noqa: S603
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=self.group,
            )
        self.starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is None:
            return
        if not self.group:
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(sig)
            return
        # the group outlives its leader: signalled even when the leader exited
        for pgid in _process_groups(self.proc.pid) if self.proc.poll() is None else {self.proc.pid}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()
        self.proc = None

    stop_wait = 10.0  # seconds a terminated client is given before it is killed

    def _ask_to_stop(self) -> None:
        assert self.proc is not None
        self.proc.terminate()

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self._ask_to_stop()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(self.stop_wait)
        self.kill()


class SparkClient(Client):
    """The Spark demo pipeline's driver: stopped cleanly through its stop file, else killed with its group."""

    def __init__(self, name: str, cmd: list[str], log: Path, stop_file: Path) -> None:
        super().__init__(name, [*cmd, "--stop-file", str(stop_file)], log, group=True)
        self.stop_file = stop_file

    stop_wait = 60.0

    def start(self) -> None:
        self.stop_file.unlink(missing_ok=True)
        super().start()

    def _ask_to_stop(self) -> None:
        self.stop_file.touch()


def _walk_dirs(root: Path) -> Iterator[Path]:
    yield root
    for dirpath, dirnames, _ in os.walk(root):
        for d in dirnames:
            yield Path(dirpath) / d


def _tail_segments(data: Path) -> list[Path]:
    tails = []
    streams = data / "streams"
    if streams.is_dir():
        for d in streams.iterdir():
            segs = sorted(d.glob("*.seg"))
            if segs:
                tails.append(segs[-1])
    return tails


def _read_all(c: httpx.Client, url: str, stream: str) -> tuple[list[list[Any]], str]:
    """Every committed record of ``stream`` as ``[[offset, value], ...]`` and the end token (each
    read retried for up to a minute: with --store postgresql a leader may be changing)."""
    records: list[list[Any]] = []
    offset = "-1"
    while True:
        params = {"offset": offset, "format": "records", "isolation": "read_committed"}
        r = _retry(f"read {stream}", lambda params=params: c.get(f"{url}/v1/stream/{stream}", params=params))  # type: ignore[misc]
        records += parse_records(r.content)
        nxt = r.headers["stream-next-offset"]
        if r.headers.get("stream-up-to-date") == "true" or nxt == offset:
            return records, nxt
        offset = nxt


def _sink_batch(url: str, sink: str) -> int:
    """The last batch the Spark sink ``sink`` committed (-1: none yet, or no usable answer)."""
    try:
        return sink_batch(url, sink)
    except ValueError:  # not JSON
        return -1


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def _acked_after(took: float | None, what: str) -> str:
    return (
        "no append acknowledged within 120 s"
        if took is None
        else f"first append acknowledged {took:.2f} s after {what}"
    )


def _leads_answer(srv: HaServer, timeout: float) -> bool | None:
    """What ``srv`` says to ``GET /v1/leader`` within ``timeout`` s: whether it leads; None if it
    did not answer (or is not running)."""
    if not srv.alive():
        return None
    try:
        r = httpx.get(f"{srv.url}/v1/leader", timeout=timeout)
        return bool(r.json()["leads"])
    except (httpx.HTTPError, ValueError, KeyError):
        return None


@functools.lru_cache(maxsize=8)
def _load_value(i: int) -> bytes:
    """catch-up-load's append number ``i``: :data:`LOAD_APPEND` bytes, ``i`` written over and over."""
    return f"{i:015d}\n".encode() * (LOAD_APPEND // 16)


def _is_load_prefix(at: int, data: bytes) -> bool:
    """Whether ``data``, read at byte ``at`` of :data:`LOAD_STREAM`, is what the appends wrote there."""
    pos = 0
    while pos < len(data):
        i, within = divmod(at + pos, LOAD_APPEND)
        n = min(len(data) - pos, LOAD_APPEND - within)
        if data[pos : pos + n] != _load_value(i)[within : within + n]:
            return False
        pos += n
    return True


def _retry(
    what: str, fn: Callable[[], httpx.Response], ok: tuple[int, ...] = (200,), deadline: float = 60
) -> httpx.Response:
    give_up = time.monotonic() + deadline
    while True:
        try:
            r = fn()
            if r.status_code in ok:
                return r
            err = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.TransportError as exc:
            err = repr(exc)
        if time.monotonic() > give_up:
            raise RuntimeError(f"{what} failed: {err}")
        time.sleep(0.2)


class Chaos:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.rng = random.Random(args.seed)  # noqa: S311 - a fault schedule, not security
        self.root = root
        self.data = root / "data"  # the local store's (--store postgresql: none, the streams are in the database)
        self.hist = root / "history"
        self.logs = root / "logs"
        for d in (self.hist, self.logs) if args.store == "postgresql" else (self.data, self.hist, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        # one local-disk server, or (--store postgresql) two servers over a PostgreSQL primary and standby
        self.server: Server | None = None
        self.ha: HaCluster | None = None
        # the faults of this run: --faults, or every kind of the mode
        self.kinds: tuple[str, ...] = tuple(
            args.faults or (HA_FAULT_KINDS if args.store == "postgresql" else FAULT_KINDS)
        )
        self.faults_skipped: dict[str, str] = {}  # a fault kind that cannot be injected here -> why
        if args.failover_manager == "patroni":  # Patroni manages the standby and the old primary itself
            for kind, reason in PATRONI_LEFT_OUT.items():
                if kind in self.kinds:
                    self.faults_skipped[kind] = reason
            self.kinds = tuple(k for k in self.kinds if k not in PATRONI_LEFT_OUT)
        if REJOIN in self.kinds and "fail-over-database" not in self.kinds:  # it rejoins what a failover left
            self.kinds = (*self.kinds, "fail-over-database")
        if "clock-step" in self.kinds and (why := clock_step_missing()) is not None:
            _say(f"no clock-step: {why}")
            self.faults_skipped["clock-step"] = why
            self.kinds = tuple(k for k in self.kinds if k != "clock-step")
        if args.store == "postgresql":
            extra = ("--long-poll-timeout", "1", "--txn-timeout", str(args.txn_timeout), "--log-level", "warning")
            self.ha = HaCluster(
                lease_seconds=args.lease_seconds,
                work=self.logs,
                extra=extra,
                commit_faults=True,
                clock_faults="clock-step" in self.kinds,
                failover_manager=args.failover_manager,
            )
        else:
            self.server = Server(self.data, self.logs / "server.log", txn_timeout=args.txn_timeout)
        self.proxies: list[FaultProxy] = []  # one per server
        self.clients: list[Client] = []
        self.faults: Counter[str] = Counter()
        self.effects: Counter[str] = Counter()  # evidence that a fault bit (refused writes, dropped bytes)
        self.history = HistoryWriter(self.hist / "runner.jsonl", "runner")
        self.created = 0
        self.streams = list(ALL_STREAMS)
        self.skipped: dict[str, str] = {}  # a client that did not run -> why
        self.redis: Any = None  # the sink's throwaway RedisServer
        self.redis_client: Any = None
        self.must_kill: list[str] = []  # clients killed once as soon as they have done something
        # --store postgresql: what the HA faults did and how long appends stopped
        self.leader_killed = False  # kill-server has hit the leader (the first one aims at it)
        self.stopped_past_term = False  # stop-server has paused the leader beyond the lease's term
        self.probes = 0  # probe appends made
        self._probe_lock = threading.Lock()
        self.probe_producer, self.probe_seq = "chaos-probe", 0
        self.after_leader_kill: list[float] = []  # seconds from a leader's kill -9 to the first ack
        self.failovers: list[dict[str, Any]] = []  # each database failover's figures
        self.rejoin_pending = False  # a database failover left the old primary down (rejoin-old-primary next)
        self.started = time.monotonic()  # when the faults began (run() sets it)
        # every fault injected: its kind, when (seconds into the run and wall clock), what it hit, and
        # (--store postgresql) the seconds from the injection to the next acknowledged append
        self.fault_log: list[dict[str, Any]] = []
        self.detail: dict[str, Any] = {}  # what the fault being injected says about itself
        self.partitions = 0  # partition faults so far (the first cuts the leader off, the second a follower)
        self.injected: tuple[float, float] | None = None  # the fault being injected: monotonic and wall time
        self.probe_wait: Callable[[], float | None] | None = None  # its unavailability probe's result

    @property
    def url(self) -> str:
        """The URL every client of the harness is given: the server, or both servers (failover)."""
        if self.ha is not None:
            return self.ha.url
        assert self.server is not None
        return self.server.url

    @property
    def base(self) -> str:
        """What the harness's own requests are addressed to (the failover transport routes them)."""
        return request_url(self.url)

    def http(self, timeout: float) -> httpx.Client:
        """A client of the server(s), failing over between them in --store postgresql (every request
        of the harness goes through one)."""
        return http_client(self.url, timeout=timeout)

    def local(self) -> Server:
        """The local store's server (the local-only faults)."""
        assert self.server is not None, "a local-store fault in --store postgresql"
        return self.server

    # ------------------------------------------------------------------ set-up

    def worker(self, kind: str, name: str, url: str, streams: list[str], *extra: str) -> Client:
        cmd = [
            sys.executable,
            "-m",
            "onceflow_tools.chaos.worker",
            kind,
            "--url",
            url,
            "--client",
            name,
            "--history",
            str(self.hist / f"{name}.jsonl"),
            "--seed",
            str(self.args.seed),
            "--txn-timeout",
            str(self.args.txn_timeout),
            *extra,
        ]
        for s in streams:
            cmd += ["--stream", s]
        return Client(name, cmd, self.logs / f"{name}.log")

    def _want_sink(self) -> bool:
        if self.args.sink is False:
            self.skipped["sink-0"] = "--no-sink"
            return False
        from onceflow.testing import RedisServer

        try:
            import redis  # noqa: F401

            self.redis = RedisServer()
        except (ImportError, ServiceUnavailable) as exc:
            why = "the redis package is not installed" if isinstance(exc, ImportError) else str(exc)
            _say(f"no sink client: {why}")
            self.skipped["sink-0"] = why
            return False
        self.redis.start()
        return True

    def _want_spark(self) -> bool:
        missing = spark_missing()
        if self.args.spark is False:
            self.skipped["spark-0"] = "--no-spark"
        elif missing is not None:
            _say(f"no Spark client: it needs {missing}")
            self.skipped["spark-0"] = f"needs {missing}"
        return "spark-0" not in self.skipped

    def set_up(self) -> None:
        sink, spark = self._want_sink(), self._want_spark()
        if spark:
            self.streams += SPARK_STREAMS
        if self.ha is not None:
            self.streams.append(PROBE_STREAM)
            self.ha.start()
            ports = [srv.port for srv in self.ha.servers]
        else:
            self.local().start()
            ports = [self.local().port]
        for i, port in enumerate(ports):
            self.proxies.append(FaultProxy(port, drop_probability=0.05, seed=self.args.seed + i))
            self.proxies[-1].start()
        with self.http(10) as c:
            for s in self.streams:
                _retry(
                    f"create {s}",
                    lambda s=s: c.put(
                        f"{self.base}/v1/stream/{s}",  # type: ignore[misc]
                        headers={"content-type": "application/json"},
                    ),
                    (200, 201),
                )
        self.history.record("copy", inputs=INPUTS, outputs=OUTPUTS)
        # the proxied clients: through a proxy in front of each server, whichever leads
        url, purl = self.url, "http://" + ",".join(p.url.removeprefix("http://") for p in self.proxies)
        self.clients = [
            self.worker("producer", "p0", url, INPUTS),
            self.worker("producer", "p1", purl, INPUTS),
            self.worker("producer", "p2", purl, INPUTS[:1]),
            self.worker("txn", "t0", url, TXN_STREAMS),
            self.worker("txn", "t1", purl, TXN_STREAMS),  # lost answers to appends, commits and inits
            self.worker("group", "g0", url, GROUP_STREAMS),
            self.worker("reader", "r0", url, self.streams),
        ]
        copy = [
            sys.executable,
            "-m",
            "onceflow.cli",
            "copy",
            "--url",
            url,
            "--transactional-id",
            "copier-0",
            "--group",
            "chaos-copy",
            "--live",
            "--quiet",
            "--txn-size",
            "200",
            "--max-read-bytes",
            "8KiB",
            "--txn-timeout",
            str(self.args.txn_timeout),
        ]
        for s in INPUTS:
            copy += ["--input", s]
        for s in OUTPUTS:
            copy += ["--output", s]
        self.clients.append(Client("copier-0", copy, self.logs / "copier-0.log"))
        if sink:
            self.history.record("copy", inputs=SINK_INPUTS, outputs=[SINK_TARGET])
            self.clients.append(
                self.worker("sink", "sink-0", url, SINK_INPUTS, "--redis", self.redis.url, "--job", SINK_JOB)
            )
            self.must_kill.append("sink-0")
        if spark:
            self.history.record("pipeline", events=SPARK_EVENTS, enriched=SPARK_ENRICHED, counts=SPARK_COUNTS)
            self.clients.append(self.worker("producer", "e0", purl, [SPARK_EVENTS], "--events"))
            pipeline = [
                sys.executable,
                "-m",
                "onceflow.spark.pipeline",
                "--url",
                url,
                "--checkpoint",
                str(self.root / "spark-checkpoint"),
                "--prefix",
                SPARK_PREFIX,
                "--sink-prefix",
                SPARK_SINK_PREFIX,
                "--max-records-per-trigger",
                "200",
                "--cores",
                "1",
            ]
            self.clients.append(SparkClient("spark-0", pipeline, self.logs / "spark-0.log", self.root / "spark-stop"))
            self.must_kill.append("spark-0")
        for cl in self.clients:
            cl.start()

    # ------------------------------------------------------------------ faults

    def supervise(self) -> None:
        """Restart a server that exited by itself (counted: a bug) and clients that died (a copier
        exits when it is fenced, e.g. after the server aborted its transaction on timeout).

        With --store postgresql a server that exits with status 3 lost the store's lease (a leader
        paused past its term, or cut off from the database for most of it): expected there, as a
        supervisor would, it is restarted (as a follower) and counted as a lease loss."""
        self.supervise_servers()
        for cl in self.clients:
            if not cl.alive():
                cl.exits += 1
                cl.kill()  # what is left of its process group
                cl.start()

    def supervise_servers(self) -> None:
        if self.ha is None:
            server = self.local()
            proc = server.proc
            if proc is not None and proc.poll() is not None:
                _say(f"the server exited by itself with status {proc.returncode}; restarting it (see {server.log})")
                self.effects["unexpected server exits"] += 1
                server.proc = None
                server.start()
            return
        from onceflow.server.leader import LEASE_LOST_EXIT  # here: it needs psycopg, the local mode does not

        for srv in self.ha.servers:
            if srv.proc is None or srv.proc.poll() is None:
                continue
            code = srv.proc.returncode
            if code == LEASE_LOST_EXIT:
                _say(f"{srv.name} lost the store's lease and exited (status {code}, expected); restarting it")
                self.effects["lease losses (exit 3, restarted)"] += 1
            else:
                _say(f"{srv.name} exited by itself with status {code}; restarting it (see {srv.log})")
                self.effects["unexpected server exits"] += 1
            srv.kill()  # reaps it
            srv.start()

    def _redis(self) -> Any:
        import redis

        if self.redis_client is None:
            self.redis_client = redis.Redis.from_url(self.redis.url, socket_timeout=10)
        return self.redis_client

    def client(self, name: str) -> Client | None:
        return next((c for c in self.clients if c.name == name), None)

    def _ready_victim(self) -> Client | None:
        """A client still to be killed once that has committed something (so the kill interrupts work)."""
        for name in self.must_kill:
            cl = self.client(name)
            if cl is None or not cl.alive():
                continue
            if name == "sink-0":
                done = self._redis().hget(f"onceflow:{{{SINK_JOB}}}:checkpoint", "checkpoint") is not None
            else:
                done = _sink_batch(self.url, f"{SPARK_SINK_PREFIX}enrich") >= 0
            if done:
                return cl
        return None

    def fault(self, kind: str, victim: Client | None = None) -> None:
        rng = self.rng
        self.faults[kind] += 1
        of_the_database = {
            "fail-over-database": self._fail_over_database,
            "partition": self._partition,
            "clock-step": self._clock_step,
            "sigstop-primary": self._sigstop_primary,
            "lose-standby": self._lose_standby,
            REJOIN: self._rejoin_old_primary,
            "catch-up-load": self._catch_up_load,
        }
        if kind in of_the_database:
            of_the_database[kind]()
        elif kind == "kill-server" and self.ha is not None:
            self._kill_ha_server()
        elif kind == "stop-server" and self.ha is not None:
            self._stop_ha_server()
        elif kind == "lose-commit":
            assert self.ha is not None
            how: Literal["answer", "request"] = "answer" if rng.random() < 0.5 else "request"
            before = self.ha.commits_lost
            self.ha.lose_commit(how)
            time.sleep(rng.uniform(2.0, 3.0))
            self.ha.keep_commits()  # so that each loss is counted under its own kind
            lost = self.ha.commits_lost - before
            self.effects[f"COMMIT {'answers' if how == 'answer' else 'requests'} lost"] += lost
            _say(f"  ... lose-commit ({how}): {lost} lost")
        elif kind == "kill-server":
            self.local().kill()
            time.sleep(rng.uniform(0.0, 0.5))
            self.local().start()
        elif kind == "stop-server":
            self.local().signal(signal.SIGSTOP)
            time.sleep(rng.uniform(0.5, 2.0))
            self.local().signal(signal.SIGCONT)
        elif kind in ("kill-client", "stop-client"):
            victim = victim or rng.choice(self.clients)
            if kind == "kill-client":
                if victim.name in self.must_kill:
                    self.must_kill.remove(victim.name)
                victim.kill()
                victim.kills += 1
                time.sleep(rng.uniform(0.0, 0.5))
                victim.start()
            elif victim.proc is not None:
                victim.signal(signal.SIGSTOP)
                time.sleep(rng.uniform(0.5, 2.0))
                victim.signal(signal.SIGCONT)
            self.detail["target"] = victim.name
            _say(f"  ... {kind} {victim.name}")
        elif kind == "drop-acks":
            dropped = sum(p.responses_dropped for p in self.proxies)
            for p in self.proxies:
                p.drop_probability = 0.4
            time.sleep(rng.uniform(2.0, 3.0))
            for p in self.proxies:
                p.drop_probability = 0.05
            self.effects["acks dropped"] += sum(p.responses_dropped for p in self.proxies) - dropped
        elif kind == "delay-acks":
            delayed = sum(p.responses_delayed for p in self.proxies)
            for p in self.proxies:
                p.delay_jitter = 1.5
            time.sleep(rng.uniform(2.0, 3.0))
            for p in self.proxies:
                p.delay_jitter = 0.0
            self.effects["acks delayed"] += sum(p.responses_delayed for p in self.proxies) - delayed
        elif kind == "garble-tail":
            self.local().kill()
            garbage: list[tuple[Path, int, bytes]] = []
            for seg in _tail_segments(self.data):
                junk = rng.randbytes(rng.randint(1, 300))
                if self.args.sabotage == "truncate-acked":  # a broken experiment: loses acknowledged data
                    os.truncate(seg, max(0, seg.stat().st_size - 400))
                with open(seg, "ab") as f:
                    garbage.append((seg, f.tell(), junk))
                    f.write(junk)
            self.local().start()
            for seg, at, junk in garbage:  # recovery must have cut the junk off (new batches may follow)
                with open(seg, "rb") as f:
                    f.seek(at)
                    kept = f.read(len(junk)) == junk
                self.effects["garbled tails kept after recovery" if kept else "garbled tails dropped by recovery"] += 1
        elif kind == "disk-full":
            server = self.local()
            server.kill()
            biggest = max((p.stat().st_size for p in self.data.rglob("*") if p.is_file()), default=0)
            limit = biggest + rng.randint(2_000, 20_000)
            try:
                server.start(fsize_limit=limit)
            except RuntimeError as exc:  # could not even recover within the limit: a finding, not a crash of the run
                _say(f"the server did not start under the file size limit: {exc}")
                self.effects["failed starts while disk full"] += 1
                server.kill()
            time.sleep(rng.uniform(2.0, 3.0))
            self.effects["refusals while disk full"] += self._probe_create("full", limit)
            server.kill()
            server.start()
        elif kind == "read-only":
            dirs = list(_walk_dirs(self.data))
            modes = {d: stat.S_IMODE(d.stat().st_mode) for d in dirs}
            for d in dirs:
                os.chmod(d, modes[d] & ~0o222)
            try:
                time.sleep(rng.uniform(1.0, 2.0))
                self.effects["refusals while read-only"] += self._probe_create("ro", 1000)
            finally:
                for d in dirs:
                    os.chmod(d, modes[d])
        else:
            raise ValueError(f"unknown fault {kind!r}")

    # ------------------------------------------------------------------ faults of --store postgresql

    def _leader(self) -> HaServer | None:
        """The onceflow server that leads now (waiting up to 30 s for one); None if none does."""
        assert self.ha is not None
        try:
            return self.ha.leader(timeout=30.0)
        except RuntimeError:
            _say("  ... no onceflow server leads within 30 s")
            self.effects["no leader within 30 s"] += 1
            return None

    def _kill_ha_server(self) -> None:
        """``kill -9`` of a server (the leader the first time), restarted at once; after a leader's
        kill, the seconds until an append is acknowledged again (a probe)."""
        assert self.ha is not None
        rng = self.rng
        leader = self._leader()
        victim = leader if leader is not None and not self.leader_killed else rng.choice(self.ha.servers)
        killed_at = time.monotonic()
        self._injected("kill-server")
        self.detail.update(target=victim.name, role="leader" if victim is leader else "follower")
        victim.kill()
        time.sleep(rng.uniform(0.0, 0.5))
        victim.start()  # a follower now
        if victim is not leader:
            _say(f"  ... kill-server {victim.name} (a follower)")
            return
        self.leader_killed = True
        self.effects["leaders killed"] += 1
        took = self._probe_append("leader-kill", since=killed_at)
        if took is None:
            self.effects["no append acknowledged after a leader's kill"] += 1
        else:
            self.after_leader_kill.append(took)
        _say(f"  ... kill-server {victim.name} (the leader); " + _acked_after(took, "the kill"))

    def _stop_ha_server(self) -> None:
        """SIGSTOP of the leader, the first time past the lease's term (then it is fenced, and exits
        with status 3 on SIGCONT: :meth:`supervise_servers` restarts it), later for 0.5 s up to the
        term + 2 s; then SIGCONT."""
        assert self.ha is not None
        rng = self.rng
        term = self.args.lease_seconds
        leader = self._leader()
        victim = leader if leader is not None else rng.choice(self.ha.servers)
        if leader is not None and not self.stopped_past_term:
            self._wait_for_followers(leader)  # someone to take the lease over meanwhile
            pause = term + rng.uniform(1.5, 2.5)
        else:
            pause = rng.uniform(0.5, term + 2.0)
        self._injected("stop-server")
        self.detail.update(
            target=victim.name, role="leader" if victim is leader else "unknown", seconds=round(pause, 2)
        )
        victim.signal(signal.SIGSTOP)
        time.sleep(pause)
        victim.signal(signal.SIGCONT)
        past = victim is leader and pause > term
        if past:
            self.stopped_past_term = True
            self.effects["leaders stopped past the lease's term"] += 1
            # fenced by its successor, it finds the lease taken at its next renewal (a third of the
            # term) and exits with status 3; wait for that, so that the run sees it
            give_up = time.monotonic() + term + 5.0
            while victim.alive() and time.monotonic() < give_up:
                time.sleep(0.1)
            if victim.alive():
                self.effects["leaders stopped past the term still running"] += 1
            self.supervise_servers()
        role = "the leader" if victim is leader else "no leader known"
        _say(f"  ... stop-server {victim.name} ({role}) for {pause:.1f} s" + (" (past the term)" if past else ""))

    def _wait_for_followers(self, leader: HaServer, limit: float = 30.0) -> None:
        """Wait until every other server answers (a restarted one listens within a second or two)."""
        assert self.ha is not None
        give_up = time.monotonic() + limit
        for srv in self.ha.servers:
            while srv is not leader and time.monotonic() < give_up:
                self.supervise_servers()
                try:
                    httpx.head(f"{srv.url}/v1/stream/{PROBE_STREAM}", timeout=2.0)
                    break
                except httpx.TransportError:
                    time.sleep(0.1)

    def _fail_over_database(self, kind: str = "fail-over-database") -> None:
        """The PostgreSQL primary killed, the standby promoted; then how long appends stopped after the
        promotion. Without a failover manager the standby is promoted by ``pg_ctl promote`` and the old
        primary stays down until :meth:`_rejoin_old_primary` (the next fault, when the run has it: then
        this one can come again); with Patroni (:meth:`_fail_over_with_patroni`) Patroni promotes, and
        brings the old node back."""
        assert self.ha is not None
        if isinstance(self.ha.pg, PatroniCluster):
            self._fail_over_with_patroni(self.ha.pg, kind)
            return
        if self.ha.pg.standby() is None:
            self.effects["no standby to fail over to"] += 1
            _say("  ... fail-over-database: no standby to promote")
            return
        # Step 1: kill -9 of the primary (it stays down) and promotion of the standby
        killed_at = time.monotonic()
        old = self.ha.pg.kill_primary()  # (finding the primary first takes a few psql round trips)
        self.rejoin_pending = REJOIN in self.kinds
        if kind == "fail-over-database":
            self._injected(kind)  # from its death: a probe sent before it would get through
        promotion = self.ha.pg.promote()
        promoted_at = time.monotonic()
        # Step 2: the first acknowledged append after the promotion, through both servers
        took = self._probe_append("database-failover", since=promoted_at)
        figures = {
            "after": kind,
            "killed": old.name,
            "promotion_s": round(promotion, 3),
            "primary_killed_to_promoted_s": round(promoted_at - killed_at, 3),
            "first_ack_after_promotion_s": None if took is None else round(took, 3),
            "goal_s": FAILOVER_GOAL,
            "goal_met": took is not None and took <= FAILOVER_GOAL,
        }
        self.failovers.append(figures)
        self.detail.setdefault("failover", figures)
        self.effects["database failovers"] += 1
        if took is None:
            self.effects["no append acknowledged after the promotion"] += 1
        _say(f"  ... fail-over-database: standby promoted in {promotion:.2f} s; " + _acked_after(took, "promotion"))

    def _fail_over_with_patroni(self, pg: PatroniCluster, kind: str = "fail-over-database") -> None:
        """``kill -9`` of the primary's postgres; Patroni promotes the standby and brings the old node
        back (``pg_rewind``) as the new primary's synchronous standby.

        1. Wait (up to 60 s) until a synchronous standby is there (the node a previous failover
           killed may still be coming back); without one Patroni would not fail over: skipped.
        2. ``kill -9`` of the primary's postmaster and children; Patroni on that node sees it within
           ``loop_wait``, releases the leader key, and the standby's Patroni promotes.
        3. Wait for the promotion, then a probe append through both servers, resent until
           acknowledged.
        4. Wait (up to 60 s) until Patroni has the old node back as the synchronous standby.

        Every wait goes on restarting the servers and clients that exit meanwhile
        (:meth:`_supervised`): a leader that cannot renew its lease while the database fails over
        exits with status 3, and a supervisor would restart it at once.
        """
        # Step 1: a synchronous standby to fail over to
        try:
            self._supervised(lambda: pg.wait_synchronous(60.0))
        except RuntimeError as exc:
            _say(f"  ... fail-over-database: not injected, {exc}")
            self.effects["no synchronous standby to fail over to"] += 1
            return
        # Step 2: the crash (timed from when it is over: finding the primary takes a few psql round trips)
        old = pg.kill_primary()
        killed_at = time.monotonic()
        if kind == "fail-over-database":
            self._injected(kind)
        # Step 3: Patroni's promotion, and the first acknowledged append
        try:
            new, promoted_at = self._supervised(
                lambda: (pg.wait_promoted(old, timeout=UNAVAILABLE_LIMIT), time.monotonic())
            )
        except RuntimeError as exc:
            _say(f"  ... fail-over-database: {exc}")
            self.effects["no promotion by Patroni within 60 s"] += 1
            return
        took = self._probe_append("database-failover", since=promoted_at)  # supervised itself
        # Step 4: the old node back as the synchronous standby
        try:
            back_at = self._supervised(lambda: (pg.wait_synchronous(60.0), time.monotonic())[1])
            rejoined: float | None = back_at - promoted_at
        except RuntimeError:
            rejoined = None
            self.effects["old primary not back as the synchronous standby within 60 s"] += 1
        self.detail.update(target=old.name, promoted=new.name)
        figures = {
            "after": kind,
            "manager": "patroni",
            "killed": old.name,
            "promoted": new.name,
            "primary_killed_to_promoted_s": round(promoted_at - killed_at, 3),
            "first_ack_after_promotion_s": _rounded(took),
            "old_primary_back_as_sync_standby_s": _rounded(rejoined),
            "goal_s": FAILOVER_GOAL,
            "goal_met": took is not None and took <= FAILOVER_GOAL,
        }
        self.failovers.append(figures)
        self.effects["database failovers"] += 1
        if took is None:
            self.effects["no append acknowledged after the promotion"] += 1
        _say(
            f"  ... fail-over-database: {old.name}'s postgres killed, Patroni promoted {new.name} after "
            f"{promoted_at - killed_at:.2f} s; "
            + _acked_after(took, "promotion")
            + (
                f"; {old.name} back as the synchronous standby {rejoined:.1f} s after the promotion"
                if rejoined is not None
                else f"; {old.name} NOT back within 60 s"
            )
        )

    def _supervised(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` in a thread while this one goes on restarting the servers and clients that exit
        (:meth:`supervise`, every 0.2 s), as a supervisor would; its result, or its exception raised here."""
        result: list[_T] = []
        error: list[BaseException] = []

        def run() -> None:
            try:
                result.append(fn())
            except BaseException as exc:  # noqa: BLE001 - raised again below, in this thread
                error.append(exc)

        thread = threading.Thread(target=run, name="supervised", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            self.supervise()
        if error:
            raise error[0]
        return result[0]

    def _rejoin_old_primary(self, nested: bool = False) -> None:
        """Right after a database failover: the old primary rewound with ``pg_rewind`` from the new one
        and started as its synchronous standby (:meth:`HaCluster.rejoin_database`), so that the
        database can fail over again in the same run; the seconds that took, and the check that the
        new primary reports it ``sync``."""
        assert self.ha is not None
        self.rejoin_pending = False
        began = time.monotonic()
        try:
            node = self.ha.rejoin_database()
        except RuntimeError as exc:
            _say(f"  ... rejoin-old-primary failed: {str(exc)[-1500:]}")
            self.effects["old primaries that could not rejoin"] += 1
            return
        took = time.monotonic() - began
        self.effects["old primaries rewound and rejoined"] += 1
        figures = {"target": node, "seconds": round(took, 2)}
        if nested:  # after lose-standby's failover: its own entry says what it hit and for how long
            self.detail["rejoin"] = figures
        else:
            self.detail.update(figures)
        _say(f"  ... rejoin-old-primary: {node} rewound and synchronous again after {took:.2f} s")

    def _partition(self) -> None:
        """One server cut off from the database (the leader the first time, a follower the second, then
        the leader three times in four):
        nothing it sends reaches a node and nothing comes back, so it learns only by its timeouts.
        A cut-off leader, for the lease's term + 1.5-4 s and at least until the other server leads (at
        most twice the term + 4 s): its lease must run out by its own clock (it stops leading within
        0.8 of a term, then exits with status 3) and the other server take over meanwhile; a
        follower for 1 s up to the term + 2 s. Then healed: what waited is delivered."""
        assert self.ha is not None
        rng = self.rng
        term = self.args.lease_seconds
        leader = self._leader()
        others = [srv for srv in self.ha.servers if srv is not leader]
        # the leader the first time, a follower the second, then the leader three times in four
        self.partitions += 1
        hit_leader = leader is not None and (self.partitions != 2 and (self.partitions == 1 or rng.random() < 0.75))
        if hit_leader:
            assert leader is not None
            self._wait_for_followers(leader)  # someone to take the lease over meanwhile
            victim, hold = leader, term + rng.uniform(1.5, 4.0)
        else:
            victim, hold = rng.choice(others or self.ha.servers), rng.uniform(1.0, term + 2.0)
        self.detail.update(target=victim.name, role="leader" if hit_leader else "follower")
        self._injected("partition")
        self.ha.partition(victim)
        cut = time.monotonic()
        # the cut-off leader's answers to GET /v1/leader: the last that said it leads, by when it was
        # asked (it decided after that), and the first that said it does not, by when it came
        claimed: float | None = None
        stopped: float | None = None
        taken: float | None = None  # when another server's answer that it leads came
        # a cut-off leader stays cut off until the other server leads (or twice the term and 4 s more):
        # when its transaction holds the lease's row, the takeover waits a quarter of the term for the
        # lock and then ends its sessions (docs/ha.md), so it may take the term + 2 s or so
        give_up = cut + max(hold, 2 * term + 4.0)
        try:
            while (now := time.monotonic()) < cut + hold or (hit_leader and taken is None and now < give_up):
                other_leads = any(srv.leads() for srv in self.ha.servers if srv is not victim)
                answered = time.monotonic() - cut
                if hit_leader and other_leads and taken is None:
                    taken = answered
                asked = time.monotonic() - cut  # after the other's answer came: if both lead, at once
                victim_leads = hit_leader and victim.leads()
                if victim_leads:
                    claimed = asked
                    if other_leads:
                        self.effects["two servers leading at once"] += 1
                elif hit_leader and stopped is None:
                    stopped = time.monotonic() - cut
                time.sleep(0.05)
        finally:
            self.ha.heal(victim)
        hold = time.monotonic() - cut
        self.detail["seconds"] = round(hold, 2)
        if hit_leader:
            self.detail.update(
                last_said_it_leads_s=_rounded(claimed),
                stopped_leading_s=_rounded(stopped),
                other_leads_s=_rounded(taken),
            )
            self.effects["leaders cut off from the database"] += 1
            if stopped is None or (claimed is not None and claimed > term):  # valid 0.8 term after a renewal began
                self.effects["cut-off leaders still leading after the term"] += 1
            if taken is None:
                self.effects["no takeover while the leader was cut off"] += 1
            _say(
                f"  ... partition {victim.name} (the leader) for {hold:.1f} s: it stopped leading after "
                + (f"{stopped:.2f} s" if stopped is not None else "NEVER")
                + ", the other server led after "
                + (f"{taken:.2f} s" if taken is not None else "NEVER")
            )
        else:
            self.effects["followers cut off from the database"] += 1
            _say(f"  ... partition {victim.name} (a follower) for {hold:.1f} s")

    def _clock_step(self) -> None:
        """A step of one wall clock: of the leader, of a follower or of the database (both nodes, one
        machine's clock), forward or back by 3 s up to :data:`CLOCK_STEP_MAX`; held for two or three
        lease terms (counted as injected once every process of the target runs on it,
        :data:`CLOCK_SEEN` after the step), then stepped back (so that the servers' clocks never disagree by more than the
        seals allow). The monotonic clocks, which the lease is measured by, do not move."""
        assert self.ha is not None
        rng = self.rng
        term = self.args.lease_seconds
        leader = self._leader()
        targets = ["database", *(srv.name for srv in self.ha.servers)]
        if leader is not None:  # the leader's clock as often as the database's
            targets.append(leader.name)
        target = rng.choice(targets)
        step = rng.choice((-1, 1)) * rng.randint(3, CLOCK_STEP_MAX)
        hold = max(rng.uniform(2.0, 3.0) * term, CLOCK_SEEN + 1.0)
        role = (
            "database"
            if target == "database"
            else ("leader" if leader is not None and target == leader.name else "follower")
        )
        self.detail.update(target=target, role=role, step_s=step, seconds=round(hold, 2))
        self.ha.step_clock(target, step)
        try:
            # libfaketime reads the offset again every second: after two, every process of the
            # target runs on the stepped clock, and the fault counts (and its probe starts) from then
            time.sleep(CLOCK_SEEN)
            self._injected("clock-step")
            time.sleep(hold - CLOCK_SEEN)
        finally:
            self.ha.clocks[target].reset()
        self.effects[f"clock steps ({'forward' if step > 0 else 'back'})"] += 1
        _say(f"  ... clock-step of {target} ({role}) by {step:+d} s for {hold:.1f} s, then back")

    def _sigstop_primary(self) -> None:
        """SIGSTOP of every process of the PostgreSQL primary for 1 s up to the lease's term + 2 s, then
        SIGCONT: writes stall; a leader that cannot renew for 0.8 of a term steps down (exit 3)."""
        assert self.ha is not None
        pause = self.rng.uniform(1.0, self.args.lease_seconds + 2.0)
        try:
            node = self.ha.pause_database()
        except RuntimeError as exc:
            _say(f"  ... sigstop-primary: {exc}")
            self.effects["no primary to pause"] += 1
            return
        self._injected("sigstop-primary")
        self.detail.update(target=node, seconds=round(pause, 2))
        try:
            time.sleep(pause)
        finally:
            self.ha.resume_database()
        self.effects["primaries paused"] += 1
        _say(f"  ... sigstop-primary {node} for {pause:.1f} s")

    def _leaders_now(self, timeout: float = 2.0) -> list[str]:
        assert self.ha is not None
        return [srv.name for srv in self.ha.servers if srv.leads(timeout)]

    def _lose_standby(self) -> None:
        """The synchronous standby killed (``kill -9``, then restarted) or stopped (SIGSTOP, then
        SIGCONT) for 1 s up to the lease's term + 3 s; then, when the run rejoins old primaries, the
        first time and one time in two after it, the primary killed and the standby promoted as soon as it is synchronous again
        (a failover right after its return loses nothing acknowledged: the history check).

        Meanwhile a writer sends one fresh append at a time (its own producer, one try, a 2 s timeout)
        and the servers are asked who leads. An append sent :data:`ONE_COPY_MARGIN` after the loss and
        acknowledged before the standby was back was acknowledged with one copy: counted, and a
        failed run. What the leader answered meanwhile (timeouts, 503s and their codes) and whether
        it kept its lease are in the fault's log entry."""
        assert self.ha is not None
        rng = self.rng
        term = self.args.lease_seconds
        how: Literal["kill", "stop"] = "kill" if rng.random() < 0.5 else "stop"
        hold = rng.uniform(1.0, term + 3.0)
        # the first time, then one time in two, the primary dies as soon as the standby is back
        then_fail_over = REJOIN in self.kinds and (not self.effects["standbys lost"] or rng.random() < 0.5)
        before = self._leaders_now()
        try:
            node = self.ha.lose_standby(how)
        except RuntimeError as exc:
            _say(f"  ... lose-standby: {exc}")
            self.effects["no standby to lose"] += 1
            return
        lost_at = time.monotonic()
        self._injected("lose-standby")
        stop = threading.Event()
        # sent, answered (monotonic seconds), what: ok, HTTP <status> <code>, timeout, or the client's
        # transport error (NoServerError: every server answered 503 not_leader or could not be reached)
        answers: list[tuple[float, float, str]] = []
        writer = threading.Thread(target=self._one_try_appends, args=(stop, answers), name="one-copy", daemon=True)
        writer.start()
        seen: set[str] = set(before)
        no_leader = 0.0
        try:
            while time.monotonic() < lost_at + hold:
                t = time.monotonic()
                leaders = self._leaders_now()
                seen.update(leaders)
                if not leaders:
                    no_leader += time.monotonic() - t + 0.1
                time.sleep(0.1)
        finally:
            back_from = time.monotonic()
            try:
                self.ha.restore_standby()
            except RuntimeError as exc:
                _say(f"  ... lose-standby: {node} did not come back: {str(exc)[-1500:]}")
                self.effects["standbys that did not come back"] += 1
        back = time.monotonic()
        time.sleep(2.5)  # the appends that waited get their answers (the writer's timeout is 2 s)
        stop.set()
        writer.join(10)
        one_copy = [a for a in answers if a[2] == "ok" and a[0] >= lost_at + ONE_COPY_MARGIN and a[1] < back_from]
        during = Counter(what for sent, _, what in answers if sent < back_from)
        after = [answered - back for sent, answered, what in answers if what == "ok" and sent >= back_from]
        self.effects["standbys lost"] += 1
        if one_copy:
            self.effects["appends acknowledged with one copy (standby lost)"] += len(one_copy)
        after_leaders = self._leaders_now()
        self.detail.update(
            target=node,
            how=how,
            seconds=round(hold, 2),
            restore_s=round(back - back_from, 2),
            answers_while_lost=dict(during),
            one_copy_acks=len(one_copy),
            leaders_before=before,
            leaders_seen=sorted(seen),
            leaders_after=after_leaders,
            no_leader_s=round(no_leader, 1),
            first_ok_after_return_s=_rounded(min(after)) if after else None,
        )
        if before and after_leaders and before != after_leaders:
            self.effects["leaders changed while the standby was lost"] += 1
        _say(
            f"  ... lose-standby {node} ({how}) for {hold:.1f} s: answers meanwhile {dict(during)}, "
            f"{len(one_copy)} acknowledged with one copy; leaders {before} -> {after_leaders}"
        )
        if then_fail_over:
            self.detail["then"] = "fail-over-database"
            self.faults["fail-over-database"] += 1
            self._fail_over_database("lose-standby")
            if self.rejoin_pending:
                self.faults[REJOIN] += 1
                self._rejoin_old_primary(nested=True)

    def _one_try_appends(
        self, stop: threading.Event, answers: list[tuple[float, float, str]], timeout: float = 2.0
    ) -> None:
        """:meth:`_lose_standby`'s writer: until ``stop``, one append at a time to :data:`PROBE_STREAM`
        from a producer of its own, tried once (``timeout``), recorded in the history (an unanswered
        one is indeterminate) and in ``answers`` as (sent, answered, ``ok`` / ``HTTP <status> <code>``
        / ``timeout`` / the transport error's class)."""
        with self.http(timeout) as c:
            while not stop.is_set():
                n = self._next_probe()
                value = {"c": "probe", "n": n, "why": "one-copy check"}
                op_id = self.history.next_id()
                producer = f"chaos-probe.s{n}"
                self.history.record("append", id=op_id, stream=PROBE_STREAM, values=[value], producer=producer, seq=0)
                headers = {
                    "content-type": "application/json",
                    "producer-id": producer,
                    "producer-epoch": "0",
                    "producer-seq": "0",
                }
                sent = time.monotonic()
                try:
                    r = c.post(
                        f"{self.base}/v1/stream/{PROBE_STREAM}", content=json.dumps([value]).encode(), headers=headers
                    )
                except httpx.TimeoutException:
                    answers.append((sent, time.monotonic(), "timeout"))
                    continue
                except httpx.TransportError as exc:
                    answers.append((sent, time.monotonic(), type(exc).__name__))
                    time.sleep(0.1)
                    continue
                if r.status_code == 200:
                    offset = int(r.headers["stream-next-offset"].split("_", 1)[0]) - 1
                    self.history.record("ack", id=op_id, outcome="ok", offset=offset)
                    answers.append((sent, time.monotonic(), "ok"))
                else:
                    code = ""
                    with contextlib.suppress(ValueError, AttributeError):
                        code = str(r.json().get("code", ""))
                    answers.append((sent, time.monotonic(), f"HTTP {r.status_code} {code}".strip()))
                time.sleep(0.1)

    def _catch_up_load(self) -> None:
        """Heavy catch-up reads and large writes on the leader for 3-5 s: :data:`LOAD_READERS` readers
        reading :data:`LOAD_STREAM` from offset -1 (it holds more than the servers' 1 MiB tail cache,
        so they read from PostgreSQL), again and again, while a writer appends
        :data:`LOAD_APPEND`-byte values one after the other (at most :data:`LOAD_APPENDS_MAX`).

        Checked: the lease holds (the same server leads throughout and none exits: a change counts as
        a leader lost under load and fails the run); every read returns a prefix of the stream the
        writer built (the values are a pattern of their index); at the end the stream holds every
        acknowledged append, in order, and nothing else but perhaps the one whose answer was lost.
        Recorded: reads, bytes, their latency, the appends' latency, and (the unavailability probe)
        how long other clients' appends waited."""
        from onceflow.storage.pgfs import TAIL_CACHE  # here: it needs psycopg, the local mode does not

        assert self.ha is not None
        rng = self.rng
        seconds = rng.uniform(3.0, 5.0)
        leader = self._leader()
        if leader is None:
            return
        base = self.base
        stats: dict[str, Any] = {"reads": 0, "bytes_read": 0, "read_errors": Counter(), "wrong_reads": 0}
        latencies: list[float] = []
        lock = threading.Lock()
        stop = threading.Event()
        with self.http(30.0) as c:
            r = _retry("head " + LOAD_STREAM, lambda: c.head(f"{base}/v1/stream/{LOAD_STREAM}"), (200, 404))
            if r.status_code == 404:
                _retry(
                    "create " + LOAD_STREAM,
                    lambda: c.put(
                        f"{base}/v1/stream/{LOAD_STREAM}", headers={"content-type": "application/octet-stream"}
                    ),
                    (200, 201),
                )
                first = 0
            else:  # the index of the next append: the stream's record count (one record per append)
                first = int(r.headers["stream-next-offset"].split("_", 1)[0])
        appends: list[tuple[int, float, str]] = []  # index, seconds, outcome

        def write() -> None:
            with self.http(60.0) as w:
                i = first
                while not stop.is_set() and i < first + LOAD_APPENDS_MAX:
                    t0 = time.monotonic()
                    try:
                        r = w.post(
                            f"{base}/v1/stream/{LOAD_STREAM}",
                            content=_load_value(i),
                            headers={"content-type": "application/octet-stream"},
                        )
                        outcome = "ok" if r.status_code in (200, 204) else f"HTTP {r.status_code}"
                    except httpx.TransportError as exc:
                        outcome = type(exc).__name__
                    appends.append((i, time.monotonic() - t0, outcome))
                    if outcome != "ok":
                        return  # its outcome may be unknown: nothing after it, so the end check stays exact
                    i += 1

        def read() -> None:
            with self.http(30.0) as rc:
                while not stop.is_set():
                    offset, got = "-1", 0
                    while not stop.is_set() and got < LOAD_READ_LIMIT:
                        t0 = time.monotonic()
                        try:
                            r = rc.get(f"{base}/v1/stream/{LOAD_STREAM}", params={"offset": offset})
                        except httpx.TransportError as exc:
                            with lock:
                                stats["read_errors"][type(exc).__name__] += 1
                            break
                        took = time.monotonic() - t0
                        with lock:
                            latencies.append(took)
                            stats["reads"] += 1
                        if r.status_code != 200:
                            with lock:
                                stats["read_errors"][f"HTTP {r.status_code}"] += 1
                            time.sleep(0.2)
                            break
                        if not _is_load_prefix(got, r.content):
                            with lock:
                                stats["wrong_reads"] += 1
                        got += len(r.content)
                        with lock:
                            stats["bytes_read"] += len(r.content)
                        nxt = r.headers["stream-next-offset"]
                        if r.headers.get("stream-up-to-date") == "true" or nxt == offset:
                            break
                        offset = nxt

        writer = threading.Thread(target=write, name="load-writer", daemon=True)
        writer.start()
        # the readers start once the stream is older than the tail cache (the first time: one append)
        give_up = time.monotonic() + 60
        while (
            LOAD_APPEND * (first + sum(1 for a in appends if a[2] == "ok")) <= TAIL_CACHE and time.monotonic() < give_up
        ):
            if appends and appends[-1][2] != "ok":
                break
            time.sleep(0.05)
        starts = {srv.name: srv.starts for srv in self.ha.servers}
        self._injected("catch-up-load")
        began = time.monotonic()
        readers = [threading.Thread(target=read, name=f"load-reader-{i}", daemon=True) for i in range(LOAD_READERS)]
        for t in readers:
            t.start()
        # another client meanwhile: small appends one at a time, each waited for (up to 60 s)
        small: list[tuple[float, float, str]] = []
        sampler = threading.Thread(
            target=self._one_try_appends, args=(stop, small, 60.0), name="load-small", daemon=True
        )
        sampler.start()
        # the lease holds: the leader never says it does not lead (a GET /v1/leader it leaves
        # unanswered for LOAD_LEADER_TIMEOUT is a slow answer, not a step-down: it is timed), no
        # other server says it leads, and none exits
        others = [srv for srv in self.ha.servers if srv is not leader]
        said_not = 0  # answers of the leader that it does not lead
        unanswered = 0
        other_led = 0
        asked: list[float] = []  # seconds the leader took to answer GET /v1/leader meanwhile
        while time.monotonic() < began + seconds:
            t0 = time.monotonic()
            answer = _leads_answer(leader, LOAD_LEADER_TIMEOUT)
            asked.append(time.monotonic() - t0)
            said_not += answer is False
            unanswered += answer is None
            other_led += any(srv.leads() for srv in others)
            time.sleep(0.2)
        stop.set()
        for t in [writer, sampler, *readers]:
            t.join(max(0.1, began + seconds + 70 - time.monotonic()))
        took_all = time.monotonic() - began
        exits = {srv.name: srv.starts - starts[srv.name] for srv in self.ha.servers if not srv.alive()}
        # the end: every acknowledged append there, in order, and perhaps the unanswered one after them
        acked = sum(1 for a in appends if a[2] == "ok")
        with self.http(30.0) as c:
            r = _retry("head " + LOAD_STREAM, lambda: c.head(f"{base}/v1/stream/{LOAD_STREAM}"))
            end = int(r.headers["stream-next-offset"].split("_", 1)[0])
        maybe = any(a[2] != "ok" for a in appends)
        if not (first + acked <= end <= first + acked + (1 if maybe else 0)):
            self.effects["large appends lost or doubled under load"] += 1
        if stats["wrong_reads"]:
            self.effects["wrong bytes read under load"] += stats["wrong_reads"]
        still = _leads_answer(leader, 30.0)
        changed = bool(said_not or other_led or exits) or still is not True
        if changed:
            self.effects["leaders lost the lease under load"] += 1
        latencies.sort()
        self.detail.update(
            target=leader.name,
            seconds=round(seconds, 2),
            took_s=round(took_all, 2),
            readers=LOAD_READERS,
            reads=stats["reads"],
            mib_read=round(stats["bytes_read"] / (1 << 20), 1),
            read_p50_s=_rounded(latencies[len(latencies) // 2]) if latencies else None,
            read_max_s=_rounded(latencies[-1]) if latencies else None,
            read_errors=dict(stats["read_errors"]),
            wrong_reads=stats["wrong_reads"],
            appends_mib=[LOAD_APPEND >> 20] * len(appends),
            append_s=[round(a[1], 2) for a in appends],
            append_outcomes=[a[2] for a in appends],
            stream_mib=round(end * LOAD_APPEND / (1 << 20)),
            leader_said_it_does_not_lead=said_not,
            other_server_said_it_leads=other_led,
            leader_unanswered_polls=unanswered,
            leader_exits=exits,
            leads_after=still,
            leader_answer_max_s=_rounded(max(asked)) if asked else None,
            small_appends=dict(Counter(what for _, _, what in small)),
            small_append_max_s=_rounded(max(b - a for a, b, _ in small)) if small else None,
        )
        _say(
            f"  ... catch-up-load on {leader.name}: {stats['reads']} reads ({self.detail['mib_read']} MiB, "
            f"p50 {self.detail['read_p50_s']} s, max {self.detail['read_max_s']} s, errors {dict(stats['read_errors'])}), "
            f"{acked}/{len(appends)} appends of {LOAD_APPEND >> 20} MiB ({', '.join(f'{a[1]:.1f}' for a in appends)} s); "
            f"small appends meanwhile {self.detail['small_appends']} (max {self.detail['small_append_max_s']} s); "
            f"GET /v1/leader answered by the leader within {self.detail['leader_answer_max_s']} s "
            f"({unanswered} unanswered in {LOAD_LEADER_TIMEOUT:g} s)" + (" LEASE CHANGED" if changed else "")
        )

    def _next_probe(self) -> int:
        """The number of a new probe append (its value's ``n``; probes are sent from several threads)."""
        with self._probe_lock:
            self.probes += 1
            return self.probes

    def _probe_append(self, why: str, since: float, limit: float = 120.0) -> float | None:
        """Append one value to :data:`PROBE_STREAM` through both servers, resent with the same
        ``Producer-Seq`` until acknowledged: the seconds from ``since`` to the acknowledgement, None
        if none came within ``limit``. Recorded in the runner's history as a producer's append is,
        so the history check covers it."""
        n = self._next_probe()
        # sent from a thread of its own (:meth:`_supervised`): meanwhile servers and clients that die
        # are restarted, as a supervisor would (a leader that stepped down just before a database
        # failover, say). Not to be called inside _supervised: one thread supervises at a time
        took = self._supervised(lambda: self._send_probe(n, why, self.probe_producer, self.probe_seq, since, limit))
        if took is not None:
            self.probe_seq += 1
        else:  # left indeterminate: the next probe comes from a new producer, whose Producer-Seq 0 is its own
            self.probe_producer, self.probe_seq = f"chaos-probe.{n}", 0
        return took

    def _send_probe(self, n: int, why: str, producer: str, seq: int, since: float, limit: float) -> float | None:
        """:meth:`_probe_append`'s request, resent until answered (thread-safe: the history is)."""
        value = {"c": "probe", "n": n, "why": why}
        op_id = self.history.next_id()
        self.history.record("append", id=op_id, stream=PROBE_STREAM, values=[value], producer=producer, seq=seq)
        headers = {
            "content-type": "application/json",
            "producer-id": producer,
            "producer-epoch": "0",
            "producer-seq": str(seq),
        }
        body = json.dumps([value]).encode()
        give_up = time.monotonic() + limit
        with self.http(2.0) as c:
            while time.monotonic() < give_up:
                try:
                    r = c.post(f"{self.base}/v1/stream/{PROBE_STREAM}", content=body, headers=headers)
                except httpx.TransportError:
                    time.sleep(0.05)
                    continue
                if r.status_code in (200, 204):
                    took = time.monotonic() - since
                    if r.status_code == 200:
                        offset = int(r.headers["stream-next-offset"].split("_", 1)[0]) - 1
                        self.history.record("ack", id=op_id, outcome="ok", offset=offset)
                    else:  # a resend of one that was stored
                        self.history.record("ack", id=op_id, outcome="ok", duplicate=True)
                    return took
                if r.status_code < 500 and r.status_code != 429:
                    self.history.record("note", id=op_id, status=r.status_code, text=r.text[:200])
                    break
                time.sleep(0.05)
        return None

    def _unavailability_probe(self, kind: str) -> Callable[[], float | None]:
        """Start, at the moment a fault is injected, a probe append of a producer of its own (so that
        it runs beside the faults' own probes); returns a function that waits for it and gives the
        seconds from the injection to its acknowledgement (None: none within
        :data:`UNAVAILABLE_LIMIT`). ``--store postgresql`` only: the local store's run has no probe
        stream."""
        if self.ha is None:
            return lambda: None
        n, since = self._next_probe(), time.monotonic()
        result: list[float | None] = [None]

        def probe() -> None:
            result[0] = self._send_probe(n, f"after {kind}", f"chaos-probe.u{n}", 0, since, UNAVAILABLE_LIMIT)

        thread = threading.Thread(target=probe, name=f"probe-{n}", daemon=True)
        thread.start()

        def wait() -> float | None:
            # servers and clients that died meanwhile are restarted as a supervisor would: the
            # unavailability is the cluster's, not that of a harness that stopped restarting them
            give_up = time.monotonic() + UNAVAILABLE_LIMIT + 10
            while thread.is_alive() and time.monotonic() < give_up:
                thread.join(0.2)
                self.supervise()
            return result[0]

        return wait

    def _warm_up_spark(self, limit: float = 120.0) -> None:
        """Wait until the Spark pipeline committed its first batch, so that it is at work during the faults."""
        t0 = time.monotonic()
        while time.monotonic() < t0 + limit:
            if _sink_batch(self.url, f"{SPARK_SINK_PREFIX}enrich") >= 0:
                _say(f"spark-0 committed its first batch after {time.monotonic() - t0:.0f} s; the faults begin")
                return
            self.supervise()
            time.sleep(1.0)
        _say(f"warning: spark-0 committed nothing within {limit:.0f} s; the faults begin anyway")

    def _settle_spark(self, c: httpx.Client) -> None:
        """Wait (up to the transaction timeout and a bit) until no transaction a killed Spark task left
        open holds back the last stable offset of the pipeline's outputs."""
        give_up = time.monotonic() + self.args.txn_timeout + 10
        while time.monotonic() < give_up:
            heads = [_retry(f"head {s}", lambda s=s: c.head(f"{self.base}/v1/stream/{s}")) for s in SPARK_STREAMS]  # type: ignore[misc]
            if all(
                h.headers.get("stream-last-stable-offset") in (None, h.headers["stream-next-offset"]) for h in heads
            ):
                return
            time.sleep(0.5)

    def _probe_create(self, tag: str, size: int) -> int:
        """Try to create a stream and append ``size`` bytes to it; 1 if the server refused (as it must)."""
        self.created += 1
        name = f"probe/{tag}{self.created}"
        try:
            with httpx.Client(timeout=5) as c:
                r = c.put(f"{self.local().url}/v1/stream/{name}", headers={"content-type": "application/json"})
                if r.status_code >= 400:
                    return 1
                body = json.dumps({"probe": name, "pad": "x" * size}).encode()
                r = c.post(
                    f"{self.local().url}/v1/stream/{name}", content=body, headers={"content-type": "application/json"}
                )
                return 1 if r.status_code >= 500 else 0
        except httpx.TransportError:
            return 1

    # ------------------------------------------------------------------ the run

    def run(self) -> int:
        self.set_up()
        started = time.monotonic()  # --duration is seconds of faults: the set-up (Patroni's: ~20 s) is not counted
        if self.ha is not None:
            where = (
                f"servers {self.url} over PostgreSQL (a primary and its synchronous standby"
                + (", managed by Patroni over etcd" if self.args.failover_manager == "patroni" else "")
                + f"; logs in {self.logs}), "
                f"lease {self.args.lease_seconds:g} s, proxies {', '.join(p.url for p in self.proxies)}, "
                f"no {', '.join(LOCAL_ONLY_FAULTS)} (no local data directory)"
            )
        else:
            where = f"server {self.url} (data {self.data}), proxy {self.proxies[0].url}"
        _say(
            f"{where}, {len(self.clients)} clients ({', '.join(c.name for c in self.clients)}), {self.args.duration:.0f} s, "
            f"seed {self.args.seed}" + "".join(f"; no {k}: {v}" for k, v in self.skipped.items())
        )
        if self.client("spark-0"):
            self._warm_up_spark()
            started = time.monotonic()  # the faults' duration starts now
        self.started = started
        schedule = [k for k in self.kinds if k != REJOIN]  # that one comes right after each failover
        self.rng.shuffle(schedule)
        # drawn after the first round; a failover only if the old primary comes back (rejoin-old-primary,
        # or Patroni brings it back itself), else no standby is left
        again = tuple(
            k
            for k in schedule
            if k != "fail-over-database" or REJOIN in self.kinds or self.args.failover_manager == "patroni"
        )
        end = started + self.args.duration
        # a bar of the duration on stderr when both stdout and stderr are a terminal (the fault lines go
        # above it); in logs, only the lines, as before
        with progress_display(enabled=sys.stdout.isatty()) as display:
            bar = display.task("chaos", self.args.duration, unit="s", rate=False, text="{faults} faults", faults=0)
            faults = 0
            # every kind once, even if that outlasts the duration, and an old primary left down rejoins
            while schedule or self.rejoin_pending or time.monotonic() < end:
                time.sleep(self.rng.uniform(0.3, 1.2))
                victim = self._ready_victim()
                if self.rejoin_pending:  # a failover left the old primary down: it rejoins first
                    kind, victim = REJOIN, None
                elif victim is not None:  # the sink and the Spark driver are killed once while at work
                    kind = "kill-client"
                else:
                    kind = schedule.pop(0) if schedule else self.rng.choice(again)
                _say(f"fault: {kind}", display)
                self._fault_logged(kind, victim)
                self.supervise()
                faults += 1
                bar.update(min(self.args.duration, time.monotonic() - started), faults=faults)
        return self.finish()

    def _injected(self, kind: str) -> None:
        """The fault is being injected now: its time, and (--store postgresql) a probe append that
        measures how long appends stop (:meth:`_unavailability_probe`). Called by the faults that
        first look for their victim (the leader, the primary) at the moment they strike, and by
        :meth:`_fault_logged` for the others."""
        self.injected = (time.monotonic(), time.time())
        self.probe_wait = self._unavailability_probe(kind)

    def _fault_logged(self, kind: str, victim: Client | None) -> None:
        """:meth:`fault`, and its entry in :attr:`fault_log`: when it was injected, what it hit, and
        the seconds from then to the next acknowledged append."""
        self.detail, self.injected, self.probe_wait = {}, None, None
        if self.ha is None or kind not in SELF_TIMED:
            self._injected(kind)
        self.fault(kind, victim)
        at, wall = self.injected or (time.monotonic(), time.time())
        took = self.probe_wait() if self.probe_wait is not None else None
        entry: dict[str, Any] = {"kind": kind, "at_s": round(at - self.started, 3), "t": round(wall, 3), **self.detail}
        if self.ha is not None:
            entry["unavailable_s"] = _rounded(took)
            if self.injected is None:
                entry["injected"] = False
            elif took is None:
                self.effects["no append acknowledged within 60 s of a fault"] += 1
                _say(f"  ... no append acknowledged within {UNAVAILABLE_LIMIT:.0f} s of the {kind}")
        self.fault_log.append(entry)

    def _unavailability(self) -> dict[str, dict[str, Any]]:
        """Per fault kind: how many, and the seconds from injection to the next acknowledged append
        (min, median, max; ``no_ack``: how many saw none within :data:`UNAVAILABLE_LIMIT`)."""
        out: dict[str, dict[str, Any]] = {}
        for kind in self.kinds:
            entries = [e for e in self.fault_log if e["kind"] == kind]
            took = sorted(e["unavailable_s"] for e in entries if e.get("unavailable_s") is not None)
            out[kind] = {
                "count": len(entries),
                "min_s": took[0] if took else None,
                "median_s": took[len(took) // 2] if took else None,
                "max_s": took[-1] if took else None,
                "no_ack": sum(1 for e in entries if e.get("unavailable_s") is None and e.get("injected", True)),
            }
        return out

    def _behind(self, c: httpx.Client, name: str) -> bool:
        """Whether the copier, the sink or the Spark pipeline has not yet processed all of its input."""
        url = self.base

        def count(streams: list[str]) -> int:
            return sum(len(_read_all(c, url, s)[0]) for s in streams)

        if name == "copier-0":
            return count(OUTPUTS) < count(INPUTS)
        if name == "sink-0":
            return int(self._redis().llen(f"onceflow:{{{SINK_JOB}}}:out")) < count(SINK_INPUTS)
        events, enriched, counts = ([v for _, v in _read_all(c, url, s)[0]] for s in SPARK_STREAMS)
        r = check_pipeline(events, enriched, counts)
        return bool(r.missing or r.wrong_counts)

    def finish(self) -> int:
        catching_up = [cl for cl in self.clients if cl.name in ("copier-0", "sink-0", "spark-0")]
        _say(
            f"stopping the clients, aborting open transactions, letting {', '.join(cl.name for cl in catching_up)} catch up"
        )
        for cl in self.clients:
            if cl not in catching_up:
                cl.terminate()
        url = self.base
        with self.http(10) as c:
            for tid in ("t0", "t1"):
                _retry(f"init {tid}", lambda tid=tid: c.post(f"{url}/v1/txn/{tid}/init", json={}))  # type: ignore[misc]
            # Spark restarts slowly (15-30 s on 2 cores): it gets longer
            started = time.monotonic()
            wait = max(30.0, self.args.duration) + (120.0 if self.client("spark-0") else 0.0)
            behind = list(catching_up)
            while behind and time.monotonic() < started + wait:
                for cl in list(behind):
                    if not self._behind(c, cl.name):
                        _say(f"  {cl.name} caught up after {time.monotonic() - started:.0f} s")
                        cl.terminate()
                        behind.remove(cl)
                    elif not cl.alive():
                        cl.exits += 1
                        cl.kill()
                        cl.start()
                self.supervise_servers()
                time.sleep(1.0)
            for cl in behind:
                cl.terminate()
                _say(f"warning: {cl.name} did not catch up in time; its check will report what is missing")
            if behind:
                self.effects["clients behind at the end"] = len(behind)
            # the copier's own open transaction (if any) is aborted by a last init of its id
            _retry("init copier-0", lambda: c.post(f"{url}/v1/txn/copier-0/init", json={}))
            if self.client("spark-0"):
                self._settle_spark(c)
            final: dict[str, list[Any]] = {}
            for s in self.streams:
                records, nxt = _read_all(c, url, s)
                final[s] = [v for _, v in records]
                self.history.record(
                    "read", stream=s, isolation="read_committed", start="-1", next=nxt, records=records, final=True
                )
        target: list[Any] = []
        if self.client("sink-0"):
            target = [json.loads(x) for x in self._redis().lrange(f"onceflow:{{{SINK_JOB}}}:out", 0, -1)]
            self.history.record("target", name=SINK_TARGET, values=target)
        spark_batches = (
            {q: _sink_batch(self.url, f"{SPARK_SINK_PREFIX}{q}") for q in ("enrich", "counts")}
            if self.client("spark-0")
            else {}
        )
        self.history.close()
        self.stop_servers()
        skipped: list[str] = []
        ops = load_history([self.hist], skipped)
        result = check(ops)
        result.notes.extend(skipped)
        if self.effects["garbled tails kept after recovery"]:
            result.notes.append("recovery kept garbage after a tail segment: see fault effects")
        print()
        result.report(sys.stdout)
        starts = {c.name: c.starts for c in self.clients}
        # a server that exited by itself, kept garbage after recovery, or (--store postgresql) never
        # acknowledged an append again after a failover fails the run too
        unhealthy = (
            "garbled tails kept after recovery",
            "unexpected server exits",
            "no append acknowledged after the promotion",
            "old primary not back as the synchronous standby within 60 s",
            "no promotion by Patroni within 60 s",
            "no append acknowledged after a leader's kill",
            "no append acknowledged within 60 s of a fault",
            "two servers leading at once",
            "cut-off leaders still leading after the term",
            "no takeover while the leader was cut off",
            "appends acknowledged with one copy (standby lost)",
            "standbys that did not come back",
            "old primaries that could not rejoin",
            "leaders lost the lease under load",
            "wrong bytes read under load",
            "large appends lost or doubled under load",
        )
        healthy = not any(self.effects[k] for k in unhealthy)
        extra = self._evidence(ops, result.anomalies, final, target, spark_batches)
        summary = {
            "seed": self.args.seed,
            "duration_s": self.args.duration,
            "store": self.args.store,
            "operations": dict(result.ops),
            "values_checked": result.values_checked,
            "faults": {k: self.faults[k] for k in self.kinds},
            "faults_skipped": self.faults_skipped,
            "fault_log": self.fault_log,
            "fault_effects": dict(self.effects),
            "client_starts": starts,
            "clients": {"ran": [c.name for c in self.clients], "skipped": self.skipped},
            **extra,
            **self._ha_figures(),
            "anomalies": result.by_kind(),
            "ok": result.ok and healthy,
        }
        (self.root / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print("faults injected: " + ", ".join(f"{k} {v}" for k, v in summary["faults"].items()))
        print("fault effects: " + ", ".join(f"{k} {v}" for k, v in sorted(self.effects.items())))
        print(
            "clients: "
            + ", ".join(f"{c.name}" + (f" x{c.starts}" if c.starts > 1 else "") for c in self.clients)
            + "".join(f"; not run: {k} ({v})" for k, v in self.skipped.items())
        )
        for name, ev in extra.items():
            print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in ev.items()))
        if self.ha is not None:
            self._print_ha_figures(summary)
        verdict = "OK" if result.ok and healthy else "FAILED"
        print(f"chaos: {verdict} (history, logs and summary.json in {self.root})")
        return 0 if verdict == "OK" else 1

    def _evidence(
        self,
        ops: list[dict[str, Any]],
        anomalies: list[Anomaly],
        final: dict[str, list[Any]],
        target: list[Any],
        spark_batches: dict[str, int],
    ) -> dict[str, dict[str, Any]]:
        """What the sink and the Spark client did and how their checks came out (for the summary)."""
        out: dict[str, dict[str, Any]] = {}
        sink = self.client("sink-0")
        if sink is not None:
            mine = [o for o in ops if str(o["client"]).startswith("sink-0.")]
            out["sink"] = {
                "starts": sink.starts,
                "killed": sink.kills,
                "exited": sink.exits,
                "runner restarts after errors": sum(o["op"] == "note" for o in mine),
                "checkpoints committed": sum(o["op"] == "sink-committed" for o in mine),
                "restores": sum(o["op"] == "sink-restored" for o in mine),
                "input values": len({json.dumps(v, sort_keys=True) for s in SINK_INPUTS for v in final.get(s, [])}),
                "values in redis": len(target),
                "anomalies": sum(1 for a in anomalies if a.stream is not None and SINK_TARGET in a.stream),
            }
        spark = self.client("spark-0")
        if spark is not None:
            r = check_pipeline(*(final.get(s, []) for s in SPARK_STREAMS))
            out["spark"] = {
                "starts": spark.starts,
                "killed": spark.kills,
                "exited": spark.exits,
                "last batch enrich": spark_batches.get("enrich", -1),
                "last batch counts": spark_batches.get("counts", -1),
                "events": r.events,
                "enriched": r.enriched,
                "users": r.users,
                "anomalies": sum(1 for a in anomalies if a.stream in SPARK_STREAMS),
            }
        return out

    def _ha_figures(self) -> dict[str, Any]:
        """--store postgresql: the servers' starts, the failovers and how long appends stopped."""
        if self.ha is None:
            return {}
        return {
            "unavailability": self._unavailability(),
            "faults_not_applicable": {
                k: "acts on a local data directory; the streams are in PostgreSQL" for k in LOCAL_ONLY_FAULTS
            },
            "servers": {
                "lease_seconds": self.args.lease_seconds,
                "starts": {srv.name: srv.starts for srv in self.ha.servers},
            },
            "failover_manager": self.args.failover_manager,
            "database_failover": self.failovers[0] if self.failovers else {},  # the first (as before)
            "database_failovers": self.failovers,
            "leader_kills": {
                "count": self.effects["leaders killed"],
                "first_ack_after_kill_s": [round(t, 3) for t in self.after_leader_kill],
            },
        }

    def _print_ha_figures(self, summary: dict[str, Any]) -> None:
        print("not applicable here: " + ", ".join(LOCAL_ONLY_FAULTS) + " (no local data directory)")
        print("servers: " + ", ".join(f"{k} x{v}" for k, v in summary["servers"]["starts"].items()))
        if not self.failovers:
            print("database failover: none (the run ended before it)")
        for fo in self.failovers:
            after = fo["first_ack_after_promotion_s"]
            acked = (
                "no append acknowledged after it"
                if after is None
                else f"first append acknowledged {after:.2f} s after the promotion "
                f"(goal <= {FAILOVER_GOAL:g} s: {'met' if fo['goal_met'] else 'MISSED'})"
            )
            if fo.get("manager") == "patroni":
                back = fo["old_primary_back_as_sync_standby_s"]
                print(
                    f"database failover (Patroni): {fo['killed']}'s postgres killed, {fo['promoted']} promoted "
                    f"{fo['primary_killed_to_promoted_s']:.2f} s later; {acked}"
                    + (
                        "; old primary not back"
                        if back is None
                        else f"; old primary back as sync standby after {back:.1f} s"
                    )
                )
            else:
                print(
                    f"database failover ({fo['after']}): primary {fo['killed']} killed, standby promoted in "
                    f"{fo['promotion_s']:.2f} s; {acked}"
                )
        kills = summary["leader_kills"]["first_ack_after_kill_s"]
        if kills:
            print("leader kills: first append acknowledged " + ", ".join(f"{t:.2f}" for t in kills) + " s after")
        print("unavailability per fault (seconds from injection to the next acknowledged append):")
        for kind, u in summary["unavailability"].items():
            if not u["count"]:
                print(f"  {kind:<20} not injected")
                continue
            no_ack = f", {u['no_ack']} never acknowledged" if u["no_ack"] else ""
            figures = (
                f"min {u['min_s']:.2f}, median {u['median_s']:.2f}, max {u['max_s']:.2f}"
                if u["min_s"] is not None
                else "no figure"
            )
            print(f"  {kind:<20} x{u['count']:<3} {figures}{no_ack}")
        for kind, why in self.faults_skipped.items():
            print(f"  {kind:<20} left out: {why}")

    def stop_servers(self) -> None:
        for p in self.proxies:
            p.stop()
        if self.ha is not None:
            for srv in self.ha.servers:
                srv.kill()
        elif self.server is not None:
            self.server.kill()

    def cleanup(self) -> None:
        for cl in self.clients:
            cl.kill()
        self.stop_servers()
        if self.ha is not None:
            try:
                self.ha.stop()  # and the database (its files are in a temporary directory of their own)
            except RuntimeError as exc:  # a PostgreSQL process that survived: said, not raised over the verdict
                _say(f"warning: stopping PostgreSQL: {exc}")
        if self.redis is not None:
            self.redis.stop()
        with contextlib.suppress(OSError):
            self.history.close()
        for d in _walk_dirs(self.data) if self.data.exists() else []:  # in case a read-only phase was cut short
            with contextlib.suppress(OSError):
                os.chmod(d, stat.S_IMODE(d.stat().st_mode) | stat.S_IWUSR)


def run_chaos(args: argparse.Namespace) -> int:
    if args.duration <= 0:
        print("error: --duration must be positive", file=sys.stderr)
        return 2
    if args.store == "postgresql" and args.sabotage is not None:
        print("error: --sabotage acts on a local data directory: leave out --store postgresql", file=sys.stderr)
        return 2
    if args.failover_manager != "none" and args.store != "postgresql":
        print("error: --failover-manager manages the database of --store postgresql: add it", file=sys.stderr)
        return 2
    if args.lease_seconds < 1.0:
        print("error: --lease-seconds must be at least 1", file=sys.stderr)
        return 2
    if args.failover_manager == "patroni" and (named := [k for k in args.faults or () if k in PATRONI_LEFT_OUT]):
        why = "; ".join(f"{k}: {PATRONI_LEFT_OUT[k]}" for k in named)
        print(f"error: --faults {','.join(named)} with --failover-manager patroni: {why}", file=sys.stderr)
        return 2
    if args.faults is not None:
        kinds = HA_FAULT_KINDS if args.store == "postgresql" else FAULT_KINDS
        wrong = [k for k in args.faults if k not in kinds]
        if wrong or not args.faults:
            print(
                f"error: --faults {','.join(wrong) or '(none)'}: with --store {args.store} the kinds are "
                + ", ".join(kinds),
                file=sys.stderr,
            )
            return 2
    if args.out is not None:
        root = Path(args.out)
        if root.exists() and any(root.iterdir()):
            print(f"error: --out {root} exists and is not empty", file=sys.stderr)
            return 2
        root.mkdir(parents=True, exist_ok=True)
    else:
        root = Path(tempfile.mkdtemp(prefix="onceflow-chaos-"))
    try:
        chaos = Chaos(args, root)
    except ServiceUnavailable as exc:
        needs = "Patroni and etcd" if args.failover_manager == "patroni" else "PostgreSQL"
        print(f"error: --store postgresql needs {needs}: {exc}", file=sys.stderr)
        return 2
    try:
        return chaos.run()
    except KeyboardInterrupt:
        return 130
    finally:
        chaos.cleanup()


def add_chaos_parser(sub: Any) -> None:
    c = sub.add_parser(
        "chaos",
        help="run a mixed workload while injecting faults, then check the recorded history",
        description="Start a server, idempotent and transactional producers, a transactional copier, a consumer "
        "group, a read_committed reader, a Redis sink and a Spark pipeline; kill -9 / SIGSTOP the server and clients, drop and delay "
        "answers, garble log tails, fill the disk and make the data directory read-only on a seeded "
        "schedule; then read everything back and check the history for lost writes, duplicates, "
        "aborted reads, offset anomalies. Exits 1 on any anomaly. With --store postgresql the same "
        "workload and check run against two servers sharing a PostgreSQL primary and its synchronous "
        "standby, with the faults of high availability (docs/ha.md, docs/reliability.md).",
    )
    c.add_argument("--duration", type=float, default=60.0, metavar="S", help="seconds of faults (default: 60)")
    c.add_argument(
        "--seed",
        type=int,
        default=1,
        metavar="N",
        help="seed of the fault schedule and of the clients' choices (default: 1); "
        "timing still differs from run to run",
    )
    c.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="where to keep data, histories, logs and summary.json (must be empty; default: a new temp dir)",
    )
    c.add_argument(
        "--txn-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="transaction timeout of the server and clients (default: 5)",
    )
    c.add_argument(
        "--sink",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the sink client (a SinkRunner into a RedisAtomicSink on a throwaway redis-server; "
        "default: on when redis-server is installed)",
    )
    c.add_argument(
        "--spark",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the Spark demo pipeline as a client (slow: ~15 s per start; default: on when PySpark "
        "and Java are there)",
    )
    c.add_argument(
        "--store",
        choices=["local", "postgresql"],
        default="local",
        help="local (default): one server on a local data directory. postgresql: two 'onceflow serve "
        "--store' servers over a throwaway PostgreSQL primary and its synchronous standby (needs "
        "PostgreSQL and psycopg), every client and request of the harness given both servers and failing "
        "over; the faults are then kill-server (kill -9 of a random server, the leader at least once, "
        "restarted at once), stop-server (SIGSTOP of the leader, at least once past the lease's term: "
        "fenced, it exits with status 3 on SIGCONT and is restarted), fail-over-database (once: kill -9 "
        "of the primary, promotion of the standby; the summary gives the seconds from the promotion to "
        "the first acknowledged append, goal <= 5; once per run unless rejoin-old-primary is among "
        "the faults), rejoin-old-primary (after each database failover, the old primary rewound with "
        "pg_rewind and started as the new synchronous standby, so that the database can fail over "
        "again), lose-standby (the synchronous standby killed or stopped for a while: no append may "
        "be acknowledged with one copy meanwhile; sometimes followed by a database failover), "
        "catch-up-load (40 readers reading a stream of several MiB from offset -1 and 3 MiB appends "
        "on the leader: its lease must hold; the latency is reported), lose-commit, partition (a server, mostly the leader, "
        "cut off from the database, then healed), clock-step (a server's or the database's wall clock "
        "stepped forward or back, with libfaketime), sigstop-primary (the PostgreSQL primary paused), "
        "kill-client, stop-client, drop-acks and delay-acks; the summary gives each fault's "
        "unavailability (seconds from injection to the next acknowledged append); "
        "garble-tail, disk-full and read-only act on a local data directory and are left out",
    )
    c.add_argument(
        "--failover-manager",
        choices=list(FAILOVER_MANAGERS),
        default="none",
        help="with --store postgresql: what fails the database over. none (default): the harness, by "
        "pg_ctl promote (fail-over-database once: the old primary stays down). patroni: a Patroni "
        "cluster over a one-member etcd (Debian's patroni and etcd-server; synchronous_mode on; docs/ha.md, "
        "'Running with Patroni'): fail-over-database kills -9 the primary's postgres and Patroni promotes "
        "the standby and brings the old node back (pg_rewind), so it may strike again; the summary gives "
        "the seconds from the kill to the promotion and to the first acknowledged append. Every other "
        "fault works as without, but rejoin-old-primary (Patroni brings the old primary back itself) and "
        "lose-standby (Patroni restarts a lost standby, and without synchronous_mode_strict lets the primary "
        "commit alone meanwhile) are left out, and naming them in --faults is an error; clock-step of the "
        "database steps the clock of both Patronis too",
    )
    c.add_argument(
        "--lease-seconds",
        type=float,
        default=3.0,
        metavar="S",
        help="with --store postgresql: the term of the store's lease (default: 3; a follower takes over "
        "this long after the leader stops renewing it)",
    )
    c.add_argument(
        "--faults",
        type=lambda text: [k for k in text.split(",") if k],
        default=None,
        metavar="KIND,...",
        help="inject only these kinds of fault, each at least once (default: every kind of the store's mode; "
        f"local: {', '.join(FAULT_KINDS)}; postgresql: {', '.join(HA_FAULT_KINDS)})",
    )
    c.add_argument(
        "--sabotage",
        choices=["truncate-acked"],
        default=None,
        help="break the experiment on purpose to see the checker catch it: truncate-acked cuts 400 "
        "acknowledged bytes off every tail segment at each garble-tail fault (the run must fail; "
        "local store only)",
    )
    c.set_defaults(func=run_chaos)
