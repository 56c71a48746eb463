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
import json
import os
import random
import resource
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from onceflow._progress import Display, progress_display
from onceflow.demo import check_pipeline, sink_batch, spark_missing
from onceflow.testing import FaultProxy, free_port

from .history import Anomaly, HistoryWriter, check, load_history
from .worker import parse_records

__all__ = ["FAULT_KINDS", "add_chaos_parser", "run_chaos"]

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
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
                self.proc.kill()
            self.proc.wait()
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
    """Every committed record of ``stream`` as ``[[offset, value], ...]`` and the end token."""
    records: list[list[Any]] = []
    offset = "-1"
    while True:
        r = c.get(
            f"{url}/v1/stream/{stream}", params={"offset": offset, "format": "records", "isolation": "read_committed"}
        )
        r.raise_for_status()
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
        self.data = root / "data"
        self.hist = root / "history"
        self.logs = root / "logs"
        for d in (self.data, self.hist, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.server = Server(self.data, self.logs / "server.log", txn_timeout=args.txn_timeout)
        self.proxy: FaultProxy | None = None
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
        from onceflow.testing import RedisServer, ServiceUnavailable

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
        self.server.start()
        self.proxy = FaultProxy(self.server.port, drop_probability=0.05, seed=self.args.seed)
        self.proxy.start()
        with httpx.Client(timeout=10) as c:
            for s in self.streams:
                _retry(
                    f"create {s}",
                    lambda s=s: c.put(
                        f"{self.server.url}/v1/stream/{s}",  # type: ignore[misc]
                        headers={"content-type": "application/json"},
                    ),
                    (200, 201),
                )
        self.history.record("copy", inputs=INPUTS, outputs=OUTPUTS)
        url, purl = self.server.url, self.proxy.url
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
        exits when it is fenced, e.g. after the server aborted its transaction on timeout)."""
        proc = self.server.proc
        if proc is not None and proc.poll() is not None:
            _say(f"the server exited by itself with status {proc.returncode}; restarting it (see {self.server.log})")
            self.effects["unexpected server exits"] += 1
            self.server.proc = None
            self.server.start()
        for cl in self.clients:
            if not cl.alive():
                cl.exits += 1
                cl.kill()  # what is left of its process group
                cl.start()

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
                done = _sink_batch(self.server.url, f"{SPARK_SINK_PREFIX}enrich") >= 0
            if done:
                return cl
        return None

    def fault(self, kind: str, victim: Client | None = None) -> None:
        rng = self.rng
        self.faults[kind] += 1
        assert self.proxy is not None
        if kind == "kill-server":
            self.server.kill()
            time.sleep(rng.uniform(0.0, 0.5))
            self.server.start()
        elif kind == "stop-server":
            self.server.signal(signal.SIGSTOP)
            time.sleep(rng.uniform(0.5, 2.0))
            self.server.signal(signal.SIGCONT)
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
            _say(f"  ... {kind} {victim.name}")
        elif kind == "drop-acks":
            dropped = self.proxy.responses_dropped
            self.proxy.drop_probability = 0.4
            time.sleep(rng.uniform(2.0, 3.0))
            self.proxy.drop_probability = 0.05
            self.effects["acks dropped"] += self.proxy.responses_dropped - dropped
        elif kind == "delay-acks":
            delayed = self.proxy.responses_delayed
            self.proxy.delay_jitter = 1.5
            time.sleep(rng.uniform(2.0, 3.0))
            self.proxy.delay_jitter = 0.0
            self.effects["acks delayed"] += self.proxy.responses_delayed - delayed
        elif kind == "garble-tail":
            self.server.kill()
            garbage: list[tuple[Path, int, bytes]] = []
            for seg in _tail_segments(self.data):
                junk = rng.randbytes(rng.randint(1, 300))
                if self.args.sabotage == "truncate-acked":  # a broken experiment: loses acknowledged data
                    os.truncate(seg, max(0, seg.stat().st_size - 400))
                with open(seg, "ab") as f:
                    garbage.append((seg, f.tell(), junk))
                    f.write(junk)
            self.server.start()
            for seg, at, junk in garbage:  # recovery must have cut the junk off (new batches may follow)
                with open(seg, "rb") as f:
                    f.seek(at)
                    kept = f.read(len(junk)) == junk
                self.effects["garbled tails kept after recovery" if kept else "garbled tails dropped by recovery"] += 1
        elif kind == "disk-full":
            self.server.kill()
            biggest = max((p.stat().st_size for p in self.data.rglob("*") if p.is_file()), default=0)
            limit = biggest + rng.randint(2_000, 20_000)
            try:
                self.server.start(fsize_limit=limit)
            except RuntimeError as exc:  # could not even recover within the limit: a finding, not a crash of the run
                _say(f"the server did not start under the file size limit: {exc}")
                self.effects["failed starts while disk full"] += 1
                self.server.kill()
            time.sleep(rng.uniform(2.0, 3.0))
            self.effects["refusals while disk full"] += self._probe_create("full", limit)
            self.server.kill()
            self.server.start()
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

    def _warm_up_spark(self, limit: float = 120.0) -> None:
        """Wait until the Spark pipeline committed its first batch, so that it is at work during the faults."""
        t0 = time.monotonic()
        while time.monotonic() < t0 + limit:
            if _sink_batch(self.server.url, f"{SPARK_SINK_PREFIX}enrich") >= 0:
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
            heads = [_retry(f"head {s}", lambda s=s: c.head(f"{self.server.url}/v1/stream/{s}")) for s in SPARK_STREAMS]  # type: ignore[misc]
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
                r = c.put(f"{self.server.url}/v1/stream/{name}", headers={"content-type": "application/json"})
                if r.status_code >= 400:
                    return 1
                body = json.dumps({"probe": name, "pad": "x" * size}).encode()
                r = c.post(
                    f"{self.server.url}/v1/stream/{name}", content=body, headers={"content-type": "application/json"}
                )
                return 1 if r.status_code >= 500 else 0
        except httpx.TransportError:
            return 1

    # ------------------------------------------------------------------ the run

    def run(self) -> int:
        started = time.monotonic()
        self.set_up()
        _say(
            f"server {self.server.url} (data {self.data}), proxy {self.proxy.url if self.proxy else '-'}, "
            f"{len(self.clients)} clients ({', '.join(c.name for c in self.clients)}), {self.args.duration:.0f} s, "
            f"seed {self.args.seed}" + "".join(f"; no {k}: {v}" for k, v in self.skipped.items())
        )
        if self.client("spark-0"):
            self._warm_up_spark()
            started = time.monotonic()  # the faults' duration starts now
        schedule = list(FAULT_KINDS)
        self.rng.shuffle(schedule)
        end = started + self.args.duration
        # a bar of the duration on stderr when both stdout and stderr are a terminal (the fault lines go
        # above it); in logs, only the lines, as before
        with progress_display(enabled=sys.stdout.isatty()) as display:
            bar = display.task("chaos", self.args.duration, unit="s", rate=False, text="{faults} faults", faults=0)
            faults = 0
            while schedule or time.monotonic() < end:  # every kind once, even if that outlasts the duration
                time.sleep(self.rng.uniform(0.3, 1.2))
                victim = self._ready_victim()
                if victim is not None:  # the sink and the Spark driver are killed once while at work
                    kind = "kill-client"
                else:
                    kind = schedule.pop(0) if schedule else self.rng.choice(FAULT_KINDS)
                _say(f"fault: {kind}", display)
                self.fault(kind, victim)
                self.supervise()
                faults += 1
                bar.update(min(self.args.duration, time.monotonic() - started), faults=faults)
        return self.finish()

    def _behind(self, c: httpx.Client, name: str) -> bool:
        """Whether the copier, the sink or the Spark pipeline has not yet processed all of its input."""
        url = self.server.url

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
        url = self.server.url
        with httpx.Client(timeout=10) as c:
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
            {q: _sink_batch(url, f"{SPARK_SINK_PREFIX}{q}") for q in ("enrich", "counts")}
            if self.client("spark-0")
            else {}
        )
        self.history.close()
        if self.proxy is not None:
            self.proxy.stop()
        self.server.kill()
        skipped: list[str] = []
        ops = load_history([self.hist], skipped)
        result = check(ops)
        result.notes.extend(skipped)
        if self.effects["garbled tails kept after recovery"]:
            result.notes.append("recovery kept garbage after a tail segment: see fault effects")
        print()
        result.report(sys.stdout)
        starts = {c.name: c.starts for c in self.clients}
        # a server that exited by itself, or kept garbage after recovery, fails the run too
        healthy = not self.effects["garbled tails kept after recovery"] and not self.effects["unexpected server exits"]
        extra = self._evidence(ops, result.anomalies, final, target, spark_batches)
        summary = {
            "seed": self.args.seed,
            "duration_s": self.args.duration,
            "operations": dict(result.ops),
            "values_checked": result.values_checked,
            "faults": {k: self.faults[k] for k in FAULT_KINDS},
            "fault_effects": dict(self.effects),
            "client_starts": starts,
            "clients": {"ran": [c.name for c in self.clients], "skipped": self.skipped},
            **extra,
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

    def cleanup(self) -> None:
        for cl in self.clients:
            cl.kill()
        if self.proxy is not None:
            self.proxy.stop()
        self.server.kill()
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
    if args.out is not None:
        root = Path(args.out)
        if root.exists() and any(root.iterdir()):
            print(f"error: --out {root} exists and is not empty", file=sys.stderr)
            return 2
        root.mkdir(parents=True, exist_ok=True)
    else:
        root = Path(tempfile.mkdtemp(prefix="onceflow-chaos-"))
    chaos = Chaos(args, root)
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
        "aborted reads, offset anomalies. Exits 1 on any anomaly.",
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
        "--sabotage",
        choices=["truncate-acked"],
        default=None,
        help="break the experiment on purpose to see the checker catch it: truncate-acked cuts 400 "
        "acknowledged bytes off every tail segment at each garble-tail fault (the run must fail)",
    )
    c.set_defaults(func=run_chaos)
