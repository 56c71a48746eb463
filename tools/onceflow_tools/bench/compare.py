"""``onceflow bench compare``: onceflow beside Redis Streams, NATS JetStream and the Durable Streams
reference server, the same workloads in one run, with a markdown report and PNG plots.

Every peer is started by this command on a free loopback port with its data in a temporary
directory, and stopped afterwards (an installed Redis or NATS on its standard port is never used):

- onceflow: ``onceflow serve --fsync always`` (fdatasync before every acknowledgement, group commit);
- the Durable Streams reference server ``@durable-streams/server`` on Node, file-backed (``dataDir``);
- Redis Streams: ``redis-server --appendonly yes`` with ``--appendfsync always`` (durable) and
  ``everysec``;
- NATS JetStream: ``nats-server`` with JetStream file storage, publishing with ``Nats-Msg-Id``
  (deduplication). ``sync_interval: always`` is asked for in the configuration when the server
  accepts it (2.10+); older servers do not, and then JetStream acknowledges before any fsync.

Workloads, most important first (``--only`` picks some):

1. ``produce``: producer throughput on each system's best path, 100 B and 1 KiB messages: onceflow's
   ``AsyncIdempotentProducer`` on a byte stream (1 MiB batches, 5 in flight); Redis ``XADD``
   pipelined by ``redis-benchmark`` (C client, ``-c 8 -P 64``); JetStream ``publish_async`` (nats-py,
   up to 3,000 publishes awaiting their acks);
2. ``append``: single-message appends at concurrency 75: onceflow and the reference with ``wrk``
   (one POST per message), Redis with ``redis-benchmark -c 75 -P 1``, JetStream with 75 coroutines
   each awaiting its ``publish`` ack (nats-py: a Python client, so a handicap for JetStream);
3. ``latency``: append-to-consumer latency at 200 messages/s: onceflow and the reference SSE
   readers, Redis ``XREAD BLOCK``, a JetStream ordered push consumer; p50 / p99 / p99.9;
4. catch-up read throughput: the timed read-back of the 100 B producer stream from its start
   (part of ``produce``).

5. ``readers``: 1,000 live readers of one stream (onceflow SSE, Redis ``XREAD BLOCK`` on a connection
   each, JetStream ordered push consumers) while one producer appends 20 messages/s: every reader
   must get every message once; append-to-reader latency over all deliveries.

``--store postgresql`` (and/or ``postgresql-ha``) measures onceflow on a PostgreSQL store too, in the
same run: a throwaway PostgreSQL (``fsync`` and ``synchronous_commit`` on; ``-ha``: a primary and a
synchronous standby) and ``onceflow serve --store`` on it, measured once it leads, with the same
onceflow workloads; its rows ("onceflow (PostgreSQL store)") come with their ratio to the local
store and a table of where the time goes (each side's CPU per message, the database's commits and
WAL; ``bench/store.py``).

Correctness: after every load the stream is read back from its start and compared with what the
system acknowledged: exactly (a count equal to the acknowledgements and every message as sent)
where the client knows its acknowledgements, and within [acknowledged, acknowledged + in flight]
for ``wrk``, which stops with requests in flight. Any difference fails the run (exit code 1).

Output: a text report on stdout, ``compare.md`` (tables of absolute figures and onceflow/peer
ratios against the targets) and ``compare-throughput.png`` / ``compare-latency-cdf.png``
(matplotlib, Agg) in ``--out-dir``; JSON with ``--out``. ``--profile`` records the onceflow server
with py-spy during its throughput and append runs and adds the functions with the most samples.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import io
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from onceflow.testing import RedisServer, ServerProcess, ServiceUnavailable, free_port, onceflow_server

from .append import (
    NODE_PACKAGE,
    BenchFailure,
    LoadGenerator,
    _node_version,
    _raise_on_sigterm,
    _run_loop,
    _say,
    find_reference,
    measure_fsync_rate,
    measure_server,
    reference_server,
    report,
)
from .append import WARMUP_SECONDS as LOAD_WARMUP_SECONDS
from .floor import app_cost, serve_noop
from .store import STORE_KINDS, DbUse, PostgresStore, StoreKind

__all__ = ["run"]

CONCURRENCY = 75
SIZES = (100, 1024)
BATCH_BYTES = 1 << 20
MAX_IN_FLIGHT = 5
REDIS_PIPE_CLIENTS = 8
REDIS_PIPELINE = 64
NATS_WINDOW = 3_000  # + a burst of 500 stays under nats-py's publish_async_max_pending (4,000)
LATENCY_RATE = 200.0
READERS = 1_000
READER_RATE = 20.0  # messages/s appended while the readers follow the stream
MAX_STREAM_BYTES = 1 << 30  # a peer's producer run is cut to this much data (Redis keeps it in memory)
WARMUP_SECONDS = 1.0
PROFILE_TOP = 14

# targets (issue 9)
PRODUCE_RATIO_TARGET = 1.0
APPEND_REDIS_TARGET = 0.5
APPEND_NATS_TARGET = 1.0
APPEND_REFERENCE_TARGET = 10.0
LATENCY_P99_TARGET_MS = 10.0

# targets of onceflow on a PostgreSQL store against the local store, same run (issue 17)
STORE_RATIO_TARGET = 0.5
STORE_LATENCY_P99_TARGET_MS = 20.0

ONCEFLOW = "onceflow"
ONCEFLOW_PG = "onceflow (PostgreSQL store)"
ONCEFLOW_PG_HA = "onceflow (PostgreSQL store, sync standby)"
STORE_SYSTEMS: dict[StoreKind, str] = {"postgresql": ONCEFLOW_PG, "postgresql-ha": ONCEFLOW_PG_HA}
REFERENCE = "reference (file)"
REDIS_ALWAYS = "Redis (fsync always)"
REDIS_EVERYSEC = "Redis (fsync everysec)"
JETSTREAM = "JetStream"
FLOOR = "onceflow's HTTP server, no-op app"
SYSTEM_ORDER = (ONCEFLOW, FLOOR, ONCEFLOW_PG, ONCEFLOW_PG_HA, REFERENCE, REDIS_ALWAYS, REDIS_EVERYSEC, JETSTREAM)
COLORS = {
    ONCEFLOW: "tab:blue",
    FLOOR: "lightsteelblue",
    ONCEFLOW_PG: "tab:purple",
    ONCEFLOW_PG_HA: "plum",
    REFERENCE: "tab:orange",
    REDIS_ALWAYS: "tab:red",
    REDIS_EVERYSEC: "salmon",
    JETSTREAM: "tab:green",
}


# ---------------------------------------------------------------------------------------------- results


@dataclass
class Measurement:
    workload: str  # "append" | "produce-100" | "produce-1024" | "catch-up-100"
    system: str
    path: str  # the client path used
    msg_per_s: float
    seconds: float
    messages: int  # acknowledged (or read) in the measured window
    p50_ms: float | None = None
    p99_ms: float | None = None
    acknowledged: int = 0  # over warm-up + measurement: what the stream must hold
    stored: int | None = None  # read back afterwards
    exact: bool = True  # False: the client stops with requests in flight (wrk)
    server_cpu_pct: float | None = None
    db: DbUse | None = None  # on a PostgreSQL store: what the database did in the measured window
    failures: list[str] = field(default_factory=list)

    @property
    def check(self) -> str:
        if self.failures:
            return "FAILED: " + "; ".join(self.failures)
        if self.stored is None:
            return "n/a"
        rel = "=" if self.exact else ">="
        return f"ok ({self.stored:,} read back {rel} {self.acknowledged:,} acked)"


@dataclass
class Latency:
    system: str
    path: str
    sent: int
    received: int
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    p999_ms: float = 0.0
    max_ms: float = 0.0
    samples_ms: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


@dataclass
class Fanout:
    """One producer, ``readers`` live readers of the same stream: append-to-reader latency over all deliveries."""

    system: str
    path: str
    readers: int
    sent: int
    deliveries: int = 0  # (reader, message) pairs received
    connect_s: float = 0.0  # from the first reader's start until every reader had the first message
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    p999_ms: float = 0.0
    max_ms: float = 0.0
    failures: list[str] = field(default_factory=list)


@dataclass
class Profile:
    label: str
    samples: int
    rows: list[tuple[str, int]]  # (function, samples with it on top of the stack), event-loop thread
    note: str = ""
    layers: list[tuple[str, int]] = field(default_factory=list)  # (layer, samples with it anywhere on the stack)


@dataclass
class Run:
    seconds: float
    quick: bool
    notes: list[str] = field(default_factory=list)
    measurements: list[Measurement] = field(default_factory=list)
    latencies: list[Latency] = field(default_factory=list)
    profiles: list[Profile] = field(default_factory=list)
    fanouts: list[Fanout] = field(default_factory=list)
    jetstream_durable: bool = True  # False: the server took no sync_interval, acks precede fsync
    skipped: list[str] = field(default_factory=list)
    app_us: float | None = None  # CPU per append of onceflow's app alone, no HTTP (bench/floor.py)

    def find(self, workload: str, system: str) -> Measurement | None:
        for m in self.measurements:
            if m.workload == workload and m.system == system and not m.failures:
                return m
        return None


def _pctl(ordered: list[float], p: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


def payload(size: int) -> bytes:
    """An opaque message of exactly ``size`` bytes, newline-terminated (a byte-stream record)."""
    return b"r" * (size - 1) + b"\n"


# ---------------------------------------------------------------------------------------------- onceflow (and the reference)


async def _onceflow_produce(
    server: ServerProcess, name: str, size: int, seconds: float, system: str = ONCEFLOW, db: PostgresStore | None = None
) -> tuple[Measurement, Measurement]:
    """Idempotent producer throughput on a byte stream, then the timed catch-up read of it (``db``: the
    server's PostgreSQL store, whose use in both windows is measured too)."""
    from onceflow.client import AsyncIdempotentProducer, AsyncStream, OnceflowError

    from .produce import _chunks, _drive

    msg = payload(size)
    chunks = itertools.cycle(_chunks([msg]))
    url = server.url
    ct = "application/octet-stream"
    async with AsyncStream.connect(url, name) as stream:
        await stream.create(ct)
    producer = AsyncIdempotentProducer(
        url,
        name,
        producer_id=f"bench-{name}",
        epoch=0,
        content_type=ct,
        max_batch_bytes=BATCH_BYTES,
        linger_ms=0,
        max_in_flight=MAX_IN_FLIGHT,
    )
    max_pending = (MAX_IN_FLIGHT + 2) * (BATCH_BYTES // size)
    path = f"AsyncIdempotentProducer, byte stream, 1 MiB batches, {MAX_IN_FLIGHT} in flight"
    res = Measurement(f"produce-{size}", system, path, 0.0, 0.0, 0)
    elapsed = 0.0
    try:
        await producer.start()
        await _drive(producer, chunks, time.perf_counter() + WARMUP_SECONDS, max_pending)
        await producer.flush()
        acked0 = producer.stats.acked
        db0 = db.sample() if db is not None else None
        cpu0, client0 = server.cpu_seconds(), time.process_time()
        t0 = time.perf_counter()
        await _drive(producer, chunks, t0 + seconds, max_pending)
        await producer.flush()
        elapsed = time.perf_counter() - t0
        res.server_cpu_pct = _cpu_pct(cpu0, server.cpu_seconds(), elapsed)
        res.db = db.since(db0) if db is not None and db0 is not None else None
        res.path += f" (client CPU {_cpu_pct(client0, time.process_time(), elapsed) or 0:.0f} %)"
    except OnceflowError as exc:
        res.failures.append(f"producer failed: {exc}")
    finally:
        with contextlib.suppress(OnceflowError):
            await producer.close(flush=False)
    st = producer.stats
    res.acknowledged = st.acked
    if elapsed:
        res.messages = st.acked - acked0
        res.seconds = elapsed
        res.msg_per_s = res.messages / elapsed
    if st.failed:
        res.failures.append(f"{st.failed} messages failed")
    # catch-up: read the whole stream from its start, checking every byte
    count, wrong = 0, 0
    db1 = db.sample() if db is not None else None
    cpu1 = server.cpu_seconds()
    t1 = time.perf_counter()
    async with AsyncStream.connect(url, name) as stream:
        async for chunk in stream.chunks("-1"):
            data = chunk.data
            if not data:
                continue
            n, rest = divmod(len(data), size)
            if rest or data != msg * n:
                wrong += 1
            count += n
        read_s = time.perf_counter() - t1
        cpu2 = server.cpu_seconds()
        read_db = db.since(db1) if db is not None and db1 is not None else None
        await stream.delete()
    _check_count(res, count, wrong)
    catch = Measurement(
        f"catch-up-{size}",
        system,
        "AsyncStream.chunks from the start (HTTP GETs)",
        count / read_s if read_s else 0.0,
        read_s,
        count,
        acknowledged=res.acknowledged,
        stored=count,
        server_cpu_pct=_cpu_pct(cpu1, cpu2, read_s),
        db=read_db,
    )
    catch.failures = list(res.failures)
    return res, catch


def _check_count(res: Measurement, stored: int, wrong: int, in_flight: int = 0) -> None:
    res.stored = stored
    if wrong:
        res.failures.append(f"{wrong} message(s) or chunk(s) read back differ from what was sent")
    if stored < res.acknowledged:
        res.failures.append(f"LOST ACKNOWLEDGED MESSAGES: {res.acknowledged:,} acknowledged, {stored:,} read back")
    elif stored > res.acknowledged + in_flight:
        res.failures.append(
            f"{stored:,} read back, more than {res.acknowledged:,} acknowledged + {in_flight} in flight"
        )


async def _http_latency(url: str, name: str, system: str, count: int, rate: float) -> Latency:
    """One JSON message at a time from an idempotent producer, read by an SSE reader in this process."""
    from onceflow.client import AsyncIdempotentProducer, AsyncStream, OnceflowError

    async with AsyncStream.connect(url, name) as admin:
        await admin.create("application/json")
    arrived: dict[int, int] = {}
    done = asyncio.Event()
    reader_stream = AsyncStream.connect(url, name, content_type="application/json")

    async def reader() -> None:
        async for chunk in reader_stream.chunks("-1", live="sse"):
            now = time.perf_counter_ns()
            for m in chunk.messages():
                arrived[int(m["i"])] = now - int(m["t"])
            if len(arrived) >= count:
                done.set()
                return

    res = Latency(system, "AsyncIdempotentProducer (linger 0) -> AsyncStream SSE reader", count, 0)
    task = asyncio.get_running_loop().create_task(reader())
    producer = AsyncIdempotentProducer(
        url, name, producer_id=f"bench-{name}", epoch=0, content_type="application/json", linger_ms=0
    )
    try:
        await producer.start()
        await asyncio.sleep(0.3)
        await _paced(count, rate, lambda i: producer.append(b'{"i":%d,"t":%d}' % (i, time.perf_counter_ns())))
        await producer.flush()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 30)
        if task.done() and not task.cancelled() and task.exception() is not None:
            res.failures.append(f"live reader failed: {task.exception()!r}")
    except OnceflowError as exc:
        res.failures.append(f"failed: {exc}")
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        with contextlib.suppress(OnceflowError):
            await producer.close(flush=False)
        await reader_stream.close()
    _finish_latency(res, arrived)
    return res


async def _paced(count: int, rate: float, send: Callable[[int], object]) -> None:
    """Call ``send(i)`` ``count`` times at ``rate`` per second (awaiting it when it is awaitable)."""
    interval = 1.0 / rate
    next_at = time.perf_counter()
    for i in range(count):
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        next_at += interval
        out = send(i)
        if isinstance(out, Awaitable):
            await out


def _finish_latency(res: Latency, arrived: dict[int, int]) -> None:
    res.received = len(arrived)
    if res.received != res.sent:
        res.failures.append(f"the reader received {res.received} distinct messages of {res.sent} sent")
    ms = sorted(v / 1e6 for v in arrived.values())
    res.samples_ms = ms
    res.p50_ms, res.p99_ms, res.p999_ms = _pctl(ms, 50), _pctl(ms, 99), _pctl(ms, 99.9)
    res.max_ms = ms[-1] if ms else 0.0


# ---------------------------------------------------------------------------------------------- Redis


def _pid_cpu(pid: int | None) -> float | None:
    """User + system CPU seconds of a process so far (/proc), or None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_pct(cpu0: float | None, cpu1: float | None, elapsed: float) -> float | None:
    return None if cpu0 is None or cpu1 is None or elapsed <= 0 else 100 * (cpu1 - cpu0) / elapsed


def _redis_benchmark(
    port: int, key: str, value: bytes, clients: int, pipeline: int, n: int
) -> tuple[float, float, float]:
    """``redis-benchmark`` running ``XADD key * m value`` n times: (requests/s, p50 ms, p99 ms)."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        raise BenchFailure("redis-benchmark is not on PATH (Debian's redis-tools package)")
    argv = [
        exe,
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
        "-c",
        str(clients),
        "-P",
        str(pipeline),
        "-n",
        str(n),
        "--csv",
        "XADD",
        key,
        "*",
        "m",
        value.decode(),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    rows = [r for r in csv.reader(io.StringIO(proc.stdout)) if r and r[0] != "test"]
    if proc.returncode != 0 or not rows:
        raise BenchFailure(
            f"redis-benchmark failed (exit {proc.returncode}): {proc.stdout[-500:]} {proc.stderr[-500:]}"
        )
    row = rows[-1]
    # "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
    return float(row[1]), float(row[4]), float(row[6])


async def _redis_read_back(url: str, key: str, value: bytes) -> tuple[int, int, float]:
    """(entries, entries unlike ``value``, seconds): XRANGE from the start in pages of 10,000."""
    import redis.asyncio as aredis

    client: Any = aredis.Redis.from_url(url)
    count, wrong, start = 0, 0, "-"
    t0 = time.perf_counter()
    try:
        while True:
            page = await client.xrange(key, min=start, max="+", count=10_000)
            if not page:
                break
            for _id, fields in page:
                if fields != {b"m": value}:
                    wrong += 1
            count += len(page)
            start = "(" + page[-1][0].decode()
        elapsed = time.perf_counter() - t0
        await client.delete(key)
    finally:
        await client.aclose()
    return count, wrong, elapsed


def redis_load(
    server: RedisServer, system: str, workload: str, size: int, clients: int, pipeline: int, seconds: float
) -> tuple[Measurement, Measurement | None]:
    """A redis-benchmark warm-up sized by ``seconds``, the run, and the read-back (catch-up)."""
    value = payload(size)[:-1] + b"r"  # no newline on a command line
    key = f"{workload}-{size}"
    unit = clients * pipeline  # redis-benchmark sends whole pipelines: keep n a multiple so it sends exactly n
    warm_n = max(2_000, 200 * unit // 8) // unit * unit
    rps, _, _ = _redis_benchmark(server.port, key, value, clients, pipeline, warm_n)
    n = min(max(warm_n, int(rps * seconds)), MAX_STREAM_BYTES // size) // unit * unit
    cpu0 = _pid_cpu(server.proc.pid if server.proc else None)
    t0 = time.perf_counter()
    rps, p50, p99 = _redis_benchmark(server.port, key, value, clients, pipeline, n)
    elapsed = time.perf_counter() - t0
    cpu1 = _pid_cpu(server.proc.pid if server.proc else None)
    path = f"redis-benchmark XADD -c {clients} -P {pipeline}"
    res = Measurement(
        workload if workload == "append" else f"produce-{size}",
        system,
        path,
        rps,
        n / rps if rps else elapsed,
        n,
        p50,
        p99,
        acknowledged=warm_n + n,
        server_cpu_pct=_cpu_pct(cpu0, cpu1, elapsed),
    )
    count, wrong, read_s = _run_loop(_redis_read_back(server.url, key, value))
    _check_count(res, count, wrong)
    catch = None
    if workload != "append":
        catch = Measurement(
            f"catch-up-{size}",
            system,
            "XRANGE pages of 10,000 (redis-py asyncio)",
            count / read_s if read_s else 0.0,
            read_s,
            count,
            acknowledged=res.acknowledged,
            stored=count,
            failures=list(res.failures),
        )
    return res, catch


async def _redis_latency(url: str, system: str, count: int, rate: float) -> Latency:
    import redis.asyncio as aredis

    key = "latency"
    writer: Any = aredis.Redis.from_url(url)
    reader: Any = aredis.Redis.from_url(url)
    arrived: dict[int, int] = {}
    res = Latency(system, "XADD (one connection) -> XREAD BLOCK (another)", count, 0)

    async def read() -> None:
        last = "0-0"
        while len(arrived) < count:
            out = await reader.xread({key: last}, block=5_000, count=1_000)
            now = time.perf_counter_ns()
            for _stream, entries in out:
                for eid, fields in entries:
                    i, t = fields[b"m"].split(b":")
                    arrived[int(i)] = now - int(t)
                    last = eid.decode()

    task = asyncio.get_running_loop().create_task(read())
    try:
        await asyncio.sleep(0.2)
        await _paced(count, rate, lambda i: writer.xadd(key, {"m": b"%d:%d" % (i, time.perf_counter_ns())}))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), 30)
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        await writer.aclose()
        await reader.aclose()
    _finish_latency(res, arrived)
    return res


# ---------------------------------------------------------------------------------------------- NATS JetStream

NATS_CONF = """\
listen: 127.0.0.1:{port}
max_payload: 8MB
jetstream {{
  store_dir: "{store}"
  {sync}
}}
"""


def nats_server(root: Path, notes: list[str]) -> tuple[ServerProcess, bool]:
    """nats-server with JetStream file storage; ``sync_interval: always`` when this version takes it."""
    exe = shutil.which("nats-server")
    if exe is None:
        raise ServiceUnavailable("nats-server is not on PATH (Debian's nats-server package)")
    root.mkdir(parents=True, exist_ok=True)
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    conf = root / "nats.conf"
    port = free_port()
    conf.write_text(NATS_CONF.format(port=port, store=root / "js", sync="sync_interval: always"))
    probe = subprocess.run([exe, "-c", str(conf), "-t"], capture_output=True, text=True, check=False)
    if probe.returncode != 0 and "sync_interval" in probe.stdout + probe.stderr:
        conf.write_text(NATS_CONF.format(port=port, store=root / "js", sync=""))
        notes.append(
            f"JetStream ({version}): this version does not know `sync_interval`, so it acknowledges a publish "
            "once written to the OS, before any fsync (its file store syncs in the background): "
            "NOT durable in the sense of the other rows; its figures are an upper bound for a durable JetStream"
        )
    else:
        notes.append(f"JetStream ({version}): file storage with `sync_interval: always` (fsync before every ack)")
    durable = "sync_interval" in conf.read_text()
    return (
        ServerProcess("nats-server", [exe, "-c", str(conf)], re.compile(r"Listening for client connections on (\S+)")),
        durable,
    )


async def _nats_connect(server: ServerProcess) -> Any:
    import nats

    return await nats.connect(f"nats://{server.url}", max_reconnect_attempts=0)


async def _nats_stream(js: Any, name: str) -> None:
    from nats.js.api import StorageType, StreamConfig

    await js.add_stream(StreamConfig(name=name, subjects=[name.lower()], storage=StorageType.FILE))


async def _nats_read_back(nc: Any, js: Any, name: str, value: bytes, expected: int) -> tuple[int, int, float]:
    """(messages, messages unlike ``value``, seconds): an ordered push consumer from the first message."""
    from nats.js.api import DeliverPolicy

    info = await js.stream_info(name)
    stored = int(info.state.messages)
    got, wrong = 0, 0
    done = asyncio.Event()

    async def cb(msg: Any) -> None:
        nonlocal got, wrong
        got += 1
        if msg.data != value:
            wrong += 1
        if got >= stored:
            done.set()

    t0 = time.perf_counter()
    sub = await js.subscribe(name.lower(), cb=cb, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    if stored:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 120)
    elapsed = time.perf_counter() - t0
    await sub.unsubscribe()
    await js.delete_stream(name)
    if got != stored:
        wrong += abs(stored - got)
    return stored, wrong, elapsed


async def _nats_produce(
    server: ServerProcess, size: int, seconds: float, workload: str
) -> tuple[Measurement, Measurement | None]:
    """Async publish with a window of NATS_WINDOW (produce) or 75 publishers awaiting each ack (append)."""
    value = payload(size)
    nc = await _nats_connect(server)
    js = nc.jetstream()
    name = f"B{workload.upper().replace('-', '')}{size}"
    subject = name.lower()
    await _nats_stream(js, name)
    acked = 0
    dups = 0
    latencies: list[float] = []
    seq = 0

    def msg_id() -> dict[str, str]:
        nonlocal seq
        seq += 1
        return {"Nats-Msg-Id": f"p-{seq}"}

    async def batched(until: float) -> int:
        nonlocal acked, dups
        pending: deque[asyncio.Future[Any]] = deque()
        n = 0
        while time.perf_counter() < until:
            for _ in range(500):
                pending.append(await js.publish_async(subject, value, headers=msg_id()))
            while len(pending) > NATS_WINDOW:
                ack = await pending.popleft()
                dups += bool(ack.duplicate)
                n += 1
        while pending:
            ack = await pending.popleft()
            dups += bool(ack.duplicate)
            n += 1
        acked += n
        return n

    async def single(until: float, record: bool) -> int:
        nonlocal acked, dups
        counts = [0] * CONCURRENCY
        dup = [0] * CONCURRENCY

        async def worker(w: int) -> None:
            while time.perf_counter() < until:
                t = time.perf_counter()
                ack = await js.publish(subject, value, headers=msg_id())
                if record:
                    latencies.append(time.perf_counter() - t)
                dup[w] += bool(ack.duplicate)
                counts[w] += 1

        await asyncio.gather(*(worker(w) for w in range(CONCURRENCY)))
        acked += sum(counts)
        dups += sum(dup)
        return sum(counts)

    try:
        if workload == "append":
            await single(time.perf_counter() + WARMUP_SECONDS, False)
            cpu0, client0 = server.cpu_seconds(), time.process_time()
            t0 = time.perf_counter()
            n = await single(t0 + seconds, True)
            path = f"nats-py: {CONCURRENCY} coroutines, each awaiting its publish ack, Nats-Msg-Id"
        else:
            await batched(time.perf_counter() + WARMUP_SECONDS)
            cpu0, client0 = server.cpu_seconds(), time.process_time()
            t0 = time.perf_counter()
            n = await batched(t0 + seconds)
            path = f"nats-py publish_async, up to {NATS_WINDOW:,} unacked, Nats-Msg-Id"
        elapsed = time.perf_counter() - t0
        client_pct = _cpu_pct(client0, time.process_time(), elapsed)
        latencies.sort()
        res = Measurement(
            workload if workload == "append" else f"produce-{size}",
            JETSTREAM,
            f"{path} (client CPU {client_pct or 0:.0f} %)",
            n / elapsed,
            elapsed,
            n,
            _pctl(latencies, 50) * 1e3 if latencies else None,
            _pctl(latencies, 99) * 1e3 if latencies else None,
            acknowledged=acked,
            server_cpu_pct=_cpu_pct(cpu0, server.cpu_seconds(), elapsed),
        )
        if dups:
            res.failures.append(f"{dups} publishes acknowledged as duplicates")
        stored, wrong, read_s = await _nats_read_back(nc, js, name, value, acked)
        _check_count(res, stored, wrong)
    finally:
        await nc.close()
    catch = None
    if workload != "append":
        catch = Measurement(
            f"catch-up-{size}",
            JETSTREAM,
            "ordered push consumer (nats-py), from the first message",
            stored / read_s if read_s else 0.0,
            read_s,
            stored,
            acknowledged=acked,
            stored=stored,
            failures=list(res.failures),
        )
    return res, catch


async def _nats_latency(server: ServerProcess, count: int, rate: float) -> Latency:
    from nats.js.api import DeliverPolicy

    nc = await _nats_connect(server)
    js = nc.jetstream()
    await _nats_stream(js, "LATENCY")
    arrived: dict[int, int] = {}
    done = asyncio.Event()

    async def cb(msg: Any) -> None:
        now = time.perf_counter_ns()
        i, t = msg.data.split(b":")
        arrived[int(i)] = now - int(t)
        if len(arrived) >= count:
            done.set()

    res = Latency(JETSTREAM, "js.publish (awaiting the ack) -> ordered push consumer", count, 0)
    try:
        sub = await js.subscribe("latency", cb=cb, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
        await asyncio.sleep(0.2)
        await _paced(
            count,
            rate,
            lambda i: js.publish("latency", b"%d:%d" % (i, time.perf_counter_ns()), headers={"Nats-Msg-Id": f"l-{i}"}),
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 30)
        await sub.unsubscribe()
    finally:
        await nc.close()
    _finish_latency(res, arrived)
    return res


# ---------------------------------------------------------------------------------------------- 1,000 live readers


class _FanoutState:
    """What the readers saw: per reader the message indices received; latencies of all deliveries."""

    def __init__(self, readers: int, count: int) -> None:
        self.count = count
        self.seen: list[set[int]] = [set() for _ in range(readers)]
        self.dups = 0
        self.lat_ns: list[int] = []
        self.first = asyncio.Event()  # every reader has message -1
        self.all = asyncio.Event()  # every reader has every message
        self._have_first = 0
        self._complete = 0

    def got(self, reader: int, i: int, t_ns: int, now: int) -> None:
        seen = self.seen[reader]
        if i in seen:
            self.dups += 1
            return
        seen.add(i)
        if i < 0:
            self._have_first += 1
            if self._have_first == len(self.seen):
                self.first.set()
            return
        self.lat_ns.append(now - t_ns)
        if len(seen) == self.count + 1:
            self._complete += 1
            if self._complete == len(self.seen):
                self.all.set()

    def done(self, reader: int) -> bool:
        return len(self.seen[reader]) >= self.count + 1


async def _fanout(
    system: str,
    path: str,
    readers: int,
    count: int,
    rate: float,
    start_reader: Callable[[int, _FanoutState], Coroutine[Any, Any, None]],
    send: Callable[[int], Awaitable[object]],
) -> Fanout:
    """Start the readers, append message -1 until all have it (connect time), then ``count`` at ``rate``."""
    st = _FanoutState(readers, count)
    res = Fanout(system, path, readers, count)
    t0 = time.perf_counter()
    tasks = [asyncio.get_running_loop().create_task(start_reader(k, st)) for k in range(readers)]
    try:
        await asyncio.sleep(0.5)
        await send(-1)
        try:
            await asyncio.wait_for(st.first.wait(), 120)
        except TimeoutError:
            res.failures.append(
                f"only {sum(1 for s in st.seen if -1 in s)} of {readers} readers were following after 120 s"
            )
            return res
        res.connect_s = time.perf_counter() - t0
        await _paced(count, rate, send)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(st.all.wait(), 60)
    finally:
        for task in tasks:
            task.cancel()
        errors = []
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # noqa: BLE001 - reported as a failure of the run
                errors.append(repr(exc))
        if errors:
            res.failures.append(f"{len(errors)} reader(s) failed, e.g. {errors[0][:200]}")
    res.deliveries = sum(len(s) - (1 if -1 in s else 0) for s in st.seen)
    short = sum(1 for k in range(readers) if not st.done(k))
    if short:
        res.failures.append(f"{short} of {readers} readers did not receive all {count} messages")
    if st.dups:
        res.failures.append(f"{st.dups} duplicate deliveries")
    ms = sorted(v / 1e6 for v in st.lat_ns)
    res.p50_ms, res.p99_ms, res.p999_ms = _pctl(ms, 50), _pctl(ms, 99), _pctl(ms, 99.9)
    res.max_ms = ms[-1] if ms else 0.0
    return res


def _stamp(i: int) -> bytes:
    return b"%d:%d" % (i, time.perf_counter_ns())


async def _http_fanout(url: str, system: str, readers: int, count: int, rate: float) -> Fanout:
    import httpx

    from onceflow.client import AsyncIdempotentProducer, AsyncStream

    name = "fanout"
    async with AsyncStream.connect(url, name) as admin:
        await admin.create("application/json")
    limits = httpx.Limits(max_connections=readers + 8, max_keepalive_connections=readers + 8)
    client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120.0))
    producer = AsyncIdempotentProducer(
        url, name, producer_id="bench-fanout", epoch=0, content_type="application/json", linger_ms=0
    )

    async def reader(k: int, st: _FanoutState) -> None:
        stream = AsyncStream.connect(url, name, client=client, content_type="application/json")
        async for chunk in stream.chunks("-1", live="sse"):
            now = time.perf_counter_ns()
            for m in chunk.messages():
                st.got(k, int(m["i"]), int(m["t"]), now)
            if st.done(k):
                return

    async def send(i: int) -> None:
        producer.append(b'{"i":%d,"t":%d}' % (i, time.perf_counter_ns()))

    try:
        await producer.start()
        return await _fanout(
            system,
            f"{readers:,} AsyncStream SSE readers (one httpx client, a connection each)",
            readers,
            count,
            rate,
            reader,
            send,
        )
    finally:
        await producer.close(flush=False)
        await client.aclose()


async def _redis_fanout(url: str, system: str, readers: int, count: int, rate: float) -> Fanout:
    import redis.asyncio as aredis

    pool: Any = aredis.ConnectionPool.from_url(url, max_connections=readers + 8)
    client: Any = aredis.Redis(connection_pool=pool)
    writer: Any = aredis.Redis.from_url(url)

    async def reader(k: int, st: _FanoutState) -> None:
        last = "0-0"
        while not st.done(k):
            out = await client.xread({"fanout": last}, block=30_000, count=100)
            now = time.perf_counter_ns()
            for _stream, entries in out:
                for eid, fields in entries:
                    i, t = fields[b"m"].split(b":")
                    st.got(k, int(i), int(t), now)
                    last = eid.decode()

    async def send(i: int) -> None:
        await writer.xadd("fanout", {"m": _stamp(i)})

    try:
        return await _fanout(
            system, f"{readers:,} XREAD BLOCK loops (a connection each)", readers, count, rate, reader, send
        )
    finally:
        await client.aclose()
        await pool.disconnect()
        await writer.aclose()


async def _nats_fanout(server: ServerProcess, readers: int, count: int, rate: float) -> Fanout:
    from nats.js.api import DeliverPolicy

    nc = await _nats_connect(server)
    js = nc.jetstream()
    await _nats_stream(js, "FANOUT")
    subs: list[Any] = []

    async def reader(k: int, st: _FanoutState) -> None:
        async def cb(msg: Any) -> None:
            now = time.perf_counter_ns()
            i, t = msg.data.split(b":")
            st.got(k, int(i), int(t), now)

        subs.append(await js.subscribe("fanout", cb=cb, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL))
        await asyncio.Event().wait()  # the subscription lives until the task is cancelled

    async def send(i: int) -> None:
        await js.publish("fanout", _stamp(i), headers={"Nats-Msg-Id": f"f-{i}"})

    try:
        return await _fanout(
            JETSTREAM,
            f"{readers:,} ordered push consumers on one connection (nats-py)",
            readers,
            count,
            rate,
            reader,
            send,
        )
    finally:
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await nc.close()


def _say_fanout(f: Fanout) -> None:
    status = "FAILED: " + "; ".join(f.failures) if f.failures else "ok"
    _say(
        f"  {f.readers:,} readers following after {f.connect_s:.1f} s; {f.deliveries:,} deliveries, p50 {f.p50_ms:.2f} "
        f"p99 {f.p99_ms:.2f} p99.9 {f.p999_ms:.2f} ms: {status}"
    )


# ---------------------------------------------------------------------------------------------- profile


class PySpy:
    """py-spy recording a server process (raw collapsed stacks) until stopped."""

    def __init__(self, pid: int, out: Path, label: str) -> None:
        self.out = out
        self.label = label
        exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        self.proc: subprocess.Popen[bytes] | None = None
        if not Path(exe).exists():
            _say("py-spy not found: no profile (pip install py-spy)")
            return
        self.proc = subprocess.Popen(
            [
                exe,
                "record",
                "--pid",
                str(pid),
                "--rate",
                "200",
                "--nonblocking",
                "--threads",
                "--format",
                "raw",
                "--output",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def stop(self) -> Profile | None:
        proc = self.proc
        if proc is None:
            return None
        self.proc = None
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if not self.out.exists():
            return Profile(self.label, 0, [], f"py-spy wrote nothing: {err.decode(errors='replace')[-300:]}")
        return summarize_collapsed(self.out.read_text(), self.label)


PROFILE_LAYERS = (
    ("HTTP/1.1 server (onceflow/server/http.py), incl. what it calls", "onceflow/server/http.py"),
    ("ASGI app (onceflow/server/app.py), incl. what it calls", "onceflow/server/app.py"),
    ("core (onceflow/core/), incl. storage calls", "onceflow/core/"),
    ("storage (onceflow/storage/)", "onceflow/storage/"),
    ("of which the PostgreSQL store (onceflow/storage/pgfs.py)", "onceflow/storage/pgfs.py"),
    ("dataclass constructors", "__create_fn__"),
    ("hand-offs to the writer thread (ThreadPoolExecutor.submit)", "ThreadPoolExecutor.submit"),
)


def summarize_collapsed(text: str, label: str, top: int = PROFILE_TOP) -> Profile:
    """The event-loop (main) thread's samples from py-spy's raw output (``--threads``): per innermost
    frame, and per layer of the server anywhere on the stack. Samples whose innermost frame is
    ``Runner.run`` are time in the event loop's C code (uvloop: socket I/O, epoll) or idle."""
    own: Counter[str] = Counter()
    layers: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit() or "_run_module_as_main" not in stack:  # the main thread only
            continue
        leaf = stack.rsplit(";", 1)[-1]
        leaf = re.sub(r" \(.*?(site-packages/|src/|lib/python3\.\d+/)", " (", leaf)
        own[leaf] += int(n)
        total += int(n)
        for name, marker in PROFILE_LAYERS:
            if marker in stack:
                layers[name] += int(n)
    return Profile(label, total, own.most_common(top), layers=[(name, layers[name]) for name, _ in PROFILE_LAYERS])


# ---------------------------------------------------------------------------------------------- report


def _fmt(v: float | None, digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:,.{digits}f}"


WORKLOAD_TITLES = {
    "produce-100": "producer throughput, 100 B (best path)",
    "produce-1024": "producer throughput, 1 KiB (best path)",
    "append": f"single-message appends, concurrency {CONCURRENCY}",
    "catch-up-100": "catch-up read, 100 B messages",
    "catch-up-1024": "catch-up read, 1 KiB messages",
}


def targets(run: Run) -> list[tuple[str, str, float | None, str, str]]:
    """(workload, comparison, ratio, target, verdict)."""
    out: list[tuple[str, str, float | None, str, str]] = []

    def ratio(workload: str, peer: str, target: float, system: str = ONCEFLOW) -> None:
        a, b = run.find(workload, system), run.find(workload, peer)
        r = a.msg_per_s / b.msg_per_s if a and b and b.msg_per_s else None
        verdict = (
            "not measured" if r is None else ("met" if r >= target else f"missed by {(1 - r / target) * 100:.0f} %")
        )
        if peer == REDIS_EVERYSEC:  # the targets compare durable with durable: this row is for information
            out.append(
                (WORKLOAD_TITLES[workload], f"onceflow / {peer}", r, "none (not fsync'd before ack)", "information")
            )
            return
        if peer == JETSTREAM and not run.jetstream_durable and r is not None:
            verdict += " (JetStream not fsync'd before ack)"
        out.append((WORKLOAD_TITLES[workload], f"{system} / {peer}", r, f">= {target:g}x", verdict))

    for size in SIZES:
        for peer in (REDIS_ALWAYS, REDIS_EVERYSEC, JETSTREAM):
            ratio(f"produce-{size}", peer, PRODUCE_RATIO_TARGET)
    ratio("append", REDIS_ALWAYS, APPEND_REDIS_TARGET)
    ratio("append", REDIS_EVERYSEC, APPEND_REDIS_TARGET)
    ratio("append", JETSTREAM, APPEND_NATS_TARGET)
    ratio("append", REFERENCE, APPEND_REFERENCE_TARGET)
    stores = [s for s in STORE_SYSTEMS.values() if any(m.system == s for m in run.measurements)]
    for system in stores:  # a PostgreSQL store beside the local store
        for workload in ("produce-100", "produce-1024", "append", "catch-up-100"):
            ratio(workload, ONCEFLOW, STORE_RATIO_TARGET, system)
    for lat in run.latencies:
        limit = LATENCY_P99_TARGET_MS if lat.system == ONCEFLOW else STORE_LATENCY_P99_TARGET_MS
        if lat.system == ONCEFLOW or lat.system in STORE_SYSTEMS.values():
            ok = not lat.failures and lat.p99_ms <= limit
            verdict = "met" if ok else f"missed by {lat.p99_ms - limit:.1f} ms"
            out.append(
                ("append-to-consumer latency", f"{lat.system} p99 (ms)", lat.p99_ms, f"<= {limit:g} ms", verdict)
            )
    return out


def _per_msg_us(cpu_pct: float | None, msg_per_s: float) -> float | None:
    return None if cpu_pct is None or msg_per_s <= 0 else cpu_pct / 100 / msg_per_s * 1e6


def _store_table(run: Run) -> list[str]:
    """Where the time goes on the PostgreSQL stores, beside the local store: each side's CPU per message,
    the database's commits (one per sync of a file) and its WAL."""
    if not any(m.db is not None for m in run.measurements):
        return []
    lines = [
        "",
        "onceflow's stores side by side: CPU per message (of the onceflow server process; of every PostgreSQL "
        "process), the database's write transactions (a sync of a file is one; an acknowledged group commit) "
        "and its WAL, in the measured window:",
        "",
        "| workload | system | msg/s | server CPU | server µs/msg | PostgreSQL CPU | PostgreSQL µs/msg | commits/s "
        "| messages per commit | WAL bytes per message |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    order = {s: i for i, s in enumerate(SYSTEM_ORDER)}
    wl = list(WORKLOAD_TITLES)
    rows = [m for m in run.measurements if m.system == ONCEFLOW or m.system in STORE_SYSTEMS.values()]
    for m in sorted(rows, key=lambda m: (wl.index(m.workload), order.get(m.system, 99))):
        db = m.db
        commits = None if db is None else db.transactions / db.seconds if db.seconds else None
        writes = db is not None and not m.workload.startswith("catch-up")  # a read commits only lease renewals
        per_commit = m.messages / db.transactions if writes and db is not None and db.transactions > 0 else None
        wal = db.wal_bytes / m.messages if writes and db is not None and m.messages else None
        lines.append(
            f"| {WORKLOAD_TITLES[m.workload]} | {m.system} | {m.msg_per_s:,.0f} | {_fmt(m.server_cpu_pct, 0)} % | "
            f"{_fmt(_per_msg_us(m.server_cpu_pct, m.msg_per_s), 2)} | "
            f"{'n/a' if db is None else f'{db.cpu_pct:.0f} %'} | "
            f"{_fmt(_per_msg_us(None if db is None else db.cpu_pct, m.msg_per_s), 2)} | {_fmt(commits, 0)} | "
            f"{_fmt(per_commit, 1)} | {_fmt(wal, 1)} |"
        )
    return lines


def render_markdown(run: Run, images: list[str]) -> str:
    lines = [f"`onceflow bench compare` ({'--quick, ' if run.quick else ''}{run.seconds:g} s per measurement)", ""]
    lines += [f"- {n}" for n in run.notes]
    lines += [
        "",
        "| workload | system | client path | msg/s | p50 ms | p99 ms | server CPU | read-back check |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    order = {s: i for i, s in enumerate(SYSTEM_ORDER)}
    wl = list(WORKLOAD_TITLES)
    for m in sorted(run.measurements, key=lambda m: (wl.index(m.workload), order.get(m.system, 99))):
        lines.append(
            f"| {WORKLOAD_TITLES[m.workload]} | {m.system} | {m.path} | {m.msg_per_s:,.0f} | {_fmt(m.p50_ms, 2)} | "
            f"{_fmt(m.p99_ms, 2)} | {_fmt(m.server_cpu_pct, 0)}{' %' if m.server_cpu_pct is not None else ''} | {m.check} |"
        )
    lines += _append_cpu_table(run)
    lines += _store_table(run)
    if run.latencies:
        lines += [
            "",
            f"Append-to-consumer latency ({LATENCY_RATE:g} messages/s, one at a time, producer and consumer in one process):",
            "",
            "| system | path | received | p50 ms | p99 ms | p99.9 ms | max ms | check |",
            "|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for lat in sorted(run.latencies, key=lambda x: order.get(x.system, 99)):
            check = "FAILED: " + "; ".join(lat.failures) if lat.failures else "ok (every message once)"
            lines.append(
                f"| {lat.system} | {lat.path} | {lat.received:,}/{lat.sent:,} | {lat.p50_ms:.2f} | {lat.p99_ms:.2f} | "
                f"{lat.p999_ms:.2f} | {lat.max_ms:.2f} | {check} |"
            )
    lines += ["", "| workload | comparison | value | target | verdict |", "|---|---|---:|---|---|"]
    for workload, comp, value, target, verdict in targets(run):
        shown = "n/a" if value is None else (f"{value:.2f}" if "ms" in comp else f"{value:.2f}x")
        lines.append(f"| {workload} | {comp} | {shown} | {target} | {verdict} |")
    for prof in run.profiles:
        lines += [
            "",
            f"py-spy, onceflow server during {prof.label}: {prof.samples:,} samples of the event-loop thread"
            + (f" ({prof.note})" if prof.note else ""),
            "",
            "| layer (inclusive) | share |",
            "|---|---:|",
        ]
        lines += [f"| {name} | {n / prof.samples * 100:.1f} % |" for name, n in prof.layers if prof.samples]
        lines += [
            "",
            "| innermost frame (own time; `Runner.run` = the event loop's C code or idle) | share |",
            "|---|---:|",
        ]
        lines += [f"| `{fn}` | {n / prof.samples * 100:.1f} % |" for fn, n in prof.rows if prof.samples]
    if run.fanouts:
        lines += [
            "",
            f"{run.fanouts[0].readers:,} live readers of one stream, one producer at {READER_RATE:g} messages/s "
            "(all in this process):",
            "",
            "| system | readers | all following after s | deliveries | p50 ms | p99 ms | p99.9 ms | max ms | check |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        for f in sorted(run.fanouts, key=lambda x: order.get(x.system, 99)):
            check = "FAILED: " + "; ".join(f.failures) if f.failures else "ok (every reader got every message once)"
            lines.append(
                f"| {f.system} | {f.path} | {f.connect_s:.1f} | {f.deliveries:,}/{f.readers * f.sent:,} | {f.p50_ms:.2f} | "
                f"{f.p99_ms:.2f} | {f.p999_ms:.2f} | {f.max_ms:.2f} | {check} |"
            )
    if run.skipped:
        lines += ["", "Not measured:"] + [f"- {s}" for s in run.skipped]
    if images:
        lines += [""] + [f"![{Path(p).stem}]({Path(p).name})" for p in images]
    return "\n".join(lines) + "\n"


def plot(run: Run, out_dir: Path) -> list[str]:
    """compare-throughput.png (bars, log scale) and compare-latency-cdf.png; the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[str] = []
    workloads = [w for w in WORKLOAD_TITLES if any(m.workload == w for m in run.measurements)]
    systems = [s for s in SYSTEM_ORDER if any(m.system == s for m in run.measurements)]
    fig, ax = plt.subplots(figsize=(11, 5.5))
    width = 0.8 / max(1, len(systems))
    for si, system in enumerate(systems):
        xs, ys = [], []
        for wi, w in enumerate(workloads):
            m = next((m for m in run.measurements if m.workload == w and m.system == system), None)
            if m is not None and m.msg_per_s > 0:
                xs.append(wi + (si - (len(systems) - 1) / 2) * width)
                ys.append(m.msg_per_s)
        bars = ax.bar(xs, ys, width, label=system, color=COLORS.get(system))
        ax.bar_label(
            bars,
            labels=[f"{y / 1e3:,.0f}k" if y >= 1e4 else f"{y:,.0f}" for y in ys],
            fontsize=7,
            rotation=90,
            padding=2,
        )
    ax.set_xticks(range(len(workloads)), [WORKLOAD_TITLES[w].replace(", ", "\n", 1) for w in workloads], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("messages / s (log scale)")
    ax.set_title("onceflow bench compare: throughput (same run, same machine)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "compare-throughput.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(str(path))

    fig, ax = plt.subplots(figsize=(8, 5))
    for lat in sorted(run.latencies, key=lambda x: SYSTEM_ORDER.index(x.system) if x.system in SYSTEM_ORDER else 99):
        if lat.samples_ms:
            n = len(lat.samples_ms)
            ax.plot(
                lat.samples_ms,
                [(i + 1) / n for i in range(n)],
                label=f"{lat.system} (p99 {lat.p99_ms:.1f} ms)",
                color=COLORS.get(lat.system),
            )
    ax.axvline(LATENCY_P99_TARGET_MS, color="grey", linestyle=":", label=f"target p99 {LATENCY_P99_TARGET_MS:g} ms")
    if any(lat.system in STORE_SYSTEMS.values() for lat in run.latencies):
        ax.axvline(
            STORE_LATENCY_P99_TARGET_MS,
            color="grey",
            linestyle="--",
            label=f"target p99 on a PostgreSQL store {STORE_LATENCY_P99_TARGET_MS:g} ms",
        )
    ax.set_xscale("log")
    ax.set_xlabel("append-to-consumer latency, ms (log scale)")
    ax.set_ylabel("fraction of messages")
    ax.set_title(f"latency CDF, {LATENCY_RATE:g} msg/s one at a time")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "compare-latency-cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(str(path))
    return written


# ---------------------------------------------------------------------------------------------- main


def _stores(args: argparse.Namespace) -> list[StoreKind]:
    chosen = [s.strip() for s in (args.store or "").split(",") if s.strip() and s.strip() != "local"]
    bad = [s for s in chosen if s not in STORE_KINDS]
    if bad:
        raise SystemExit(f"unknown store(s) {bad}; choose from local, {', '.join(STORE_KINDS)}")
    return [kind for kind in STORE_KINDS if kind in chosen]


def _systems(args: argparse.Namespace) -> list[str]:
    chosen = [s.strip() for s in args.systems.split(",") if s.strip()]
    known = {"onceflow", "reference", "redis", "nats"}
    bad = [s for s in chosen if s not in known]
    if bad:
        raise SystemExit(f"unknown system(s) {bad}; choose from {sorted(known)}")
    return chosen


def _serve_args(plan: _Plan) -> list[str]:
    """More ``onceflow serve`` arguments: room for the live readers beside the default cap of 1,000
    connections (each reader holds one; a refused one retries, which once made "all following"
    take 97 s instead of 2)."""
    if "readers" not in plan.only or plan.readers + 100 <= 1000:
        return []
    return ["--max-connections", str(plan.readers + 100)]


@dataclass
class _Plan:
    """What one run measures, with what, and where its results go (made by :func:`run`)."""

    args: argparse.Namespace
    res: Run
    root: Path
    only: set[str]
    seconds: float
    lat_count: int
    readers: int
    fan_count: int
    _gen: LoadGenerator | None = None

    @property
    def wsec(self) -> int:
        return max(1, round(self.seconds))  # wrk takes whole seconds

    def gen(self) -> LoadGenerator:
        """The HTTP load generator for single-message appends, made (wrk installed) when first needed."""
        if self._gen is None:
            self._gen = LoadGenerator(self.args.generator, self.root)
            self._gen.name = self._gen.name.replace("<concurrency>", str(CONCURRENCY))
            self.res.notes.append(f"HTTP single-message load: {self._gen.name}")
        return self._gen


def _measure_floors(plan: _Plan) -> None:
    """The floors under onceflow's single-message append (bench/floor.py): the same load against its
    HTTP server with a no-op app, and the app's CPU per append with no HTTP."""
    gen, res = plan.gen(), plan.res
    server = serve_noop()
    server.start()
    try:
        body = b'{"floor":true}'
        _say(f"{FLOOR}: {LOAD_WARMUP_SECONDS} s warm-up, then {plan.wsec} s at concurrency {CONCURRENCY}")
        gen.run(server.url + "/v1/stream/floor", body, CONCURRENCY, LOAD_WARMUP_SECONDS)
        cpu0 = server.cpu_seconds()
        raw = gen.run(server.url + "/v1/stream/floor", body, CONCURRENCY, plan.wsec)
        cpu1 = server.cpu_seconds()
    finally:
        server.stop()
    m = Measurement("append", FLOOR, gen.name, raw.ok / raw.elapsed if raw.elapsed else 0.0, raw.elapsed, raw.ok)
    m.p50_ms, m.p99_ms = raw.p50_ms, raw.p99_ms
    m.server_cpu_pct = _cpu_pct(cpu0, cpu1, raw.elapsed)
    if raw.non_2xx or raw.socket_errors:
        m.failures.append(f"{raw.non_2xx} non-2xx responses, {raw.socket_errors} socket errors")
    res.measurements.append(m)
    _say(f"  {m.msg_per_s:,.0f} req/s at {_fmt(m.server_cpu_pct, 0)} % CPU")
    try:
        res.app_us = app_cost()
    except subprocess.CalledProcessError as exc:  # reported, the rest of the run goes on
        res.skipped.append(f"onceflow's app alone: the measurement failed ({(exc.stderr or '').strip()[-300:]})")
        return
    _say(f"onceflow's app alone (no HTTP, fsync always, {CONCURRENCY} appenders): {res.app_us:.1f} us CPU per append")


def _append_cpu_table(run: Run) -> list[str]:
    """Server CPU per single-message append, every system measured, and the floors under onceflow's."""
    rows = [m for m in run.measurements if m.workload == "append" and m.server_cpu_pct is not None]
    if not rows:
        return []
    order = {s: i for i, s in enumerate(SYSTEM_ORDER)}
    lines = [
        "",
        f"Server CPU per single-message append (concurrency {CONCURRENCY}; all threads of the server process, "
        "100 % = one core):",
        "",
        "| system | msg/s | server CPU | server µs per append |",
        "|---|---:|---:|---:|",
    ]
    for m in sorted(rows, key=lambda m: order.get(m.system, 99)):
        lines.append(
            f"| {m.system} | {m.msg_per_s:,.0f} | {m.server_cpu_pct:.0f} % | "
            f"{_fmt(_per_msg_us(m.server_cpu_pct, m.msg_per_s), 1)} |"
        )
    if run.app_us is not None:
        lines.append(f"| onceflow's app alone: broker, fsync always, no HTTP (in one process) | | | {run.app_us:.1f} |")
    return lines


def _measure_onceflow(plan: _Plan, server: ServerProcess, system: str, db: PostgresStore | None = None) -> None:
    """The onceflow workloads of the plan against ``server`` (on a local or, with ``db``, a PostgreSQL
    store), as rows of ``system``."""
    res, only, seconds = plan.res, plan.only, plan.seconds

    def spied(label: str, work: Callable[[], None]) -> None:
        out = plan.root / f"onceflow-{len(res.profiles)}.pyspy"
        spy = PySpy(server.pid or 0, out, f"{label} ({system})") if plan.args.profile else None
        try:
            work()
        finally:
            prof = spy.stop() if spy is not None else None
            if prof is not None:
                res.profiles.append(prof)

    def produce() -> None:
        for size in SIZES:
            _say(f"{system}: producer throughput, {size} B, {seconds:g} s")
            m, c = _run_loop(_onceflow_produce(server, f"produce-{size}", size, seconds, system, db))
            res.measurements.append(m)
            if size == 100:
                res.measurements.append(c)
            _say(f"  {m.msg_per_s:,.0f} msg/s; catch-up {c.msg_per_s:,.0f} msg/s; {m.check}")

    def append() -> None:
        lr = measure_server(server, system, db.kind if db else "file", plan.gen(), CONCURRENCY, plan.wsec, db)
        res.measurements.append(_from_load(lr, system, plan.gen()))
        if db is None:
            _measure_floors(plan)

    if "produce" in only:
        spied("the producer throughput runs (and their read-back)", produce)
    if "append" in only:
        spied(f"the single-message appends at concurrency {CONCURRENCY} (wrk, with warm-up and read-back)", append)
    if "latency" in only:
        _say(f"{system}: latency, {plan.lat_count} messages at {LATENCY_RATE:g}/s")
        lat = _run_loop(_http_latency(server.url, "latency", system, plan.lat_count, LATENCY_RATE))
        res.latencies.append(lat)
        _say(f"  p50 {lat.p50_ms:.2f} p99 {lat.p99_ms:.2f} p99.9 {lat.p999_ms:.2f} ms")
    if "readers" in only:
        _say(f"{system}: {plan.readers:,} live SSE readers, {plan.fan_count} messages at {READER_RATE:g}/s")
        fo = _run_loop(_http_fanout(server.url, system, plan.readers, plan.fan_count, READER_RATE))
        res.fanouts.append(fo)
        _say_fanout(fo)


def _measure_store(plan: _Plan, kind: StoreKind) -> None:
    """A throwaway PostgreSQL of ``kind``, ``onceflow serve --store`` on it once it leads, the onceflow
    workloads against it; both stopped after."""
    system = STORE_SYSTEMS[kind]
    try:
        store = PostgresStore(kind)
    except ServiceUnavailable as exc:
        plan.res.skipped.append(f"{system}: {exc}")
        return
    _say(f"{system}: starting PostgreSQL ({kind})")
    store.start()
    try:
        plan.res.notes.append(
            f"{system}: `onceflow serve --store <conninfo> --fsync always` (an append is acknowledged once its "
            f"sync committed); {store.describe()}"
        )
        server = onceflow_server(plan.root / f"unused-{kind}", "always", *_serve_args(plan), store=store.conninfo)
        took = server.start(timeout=120)
        _say(f"{system}: leads the store {took:.1f} s after its start")
        try:
            _measure_onceflow(plan, server, system, store)
        finally:
            server.stop()
    finally:
        store.stop()


def run(args: argparse.Namespace) -> int:
    """Entry point of ``onceflow bench compare``; the exit code (1 on any failed check)."""
    quick = bool(args.quick)
    seconds = float(args.seconds) if args.seconds is not None else (2.0 if quick else 10.0)
    lat_seconds = 2.0 if quick else 10.0
    systems = _systems(args)
    stores = _stores(args)
    only = {w.strip() for w in args.only.split(",")} if args.only else {"produce", "append", "latency", "readers"}
    readers = int(args.readers)
    _raise_fd_limit(readers)
    out_dir = Path(args.out_dir)
    res = Run(seconds=seconds, quick=quick)
    failures: list[str] = []
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    root = Path(tempfile.mkdtemp(prefix="onceflow-compare-"))
    plan = _Plan(
        args,
        res,
        root,
        only,
        seconds,
        lat_count=int(LATENCY_RATE * lat_seconds),
        readers=readers,
        fan_count=int(READER_RATE * (2.0 if quick else 5.0)),
    )
    wsec, lat_count, fan_count, gen_ = plan.wsec, plan.lat_count, plan.fan_count, plan.gen
    load = os.getloadavg()
    res.notes.append(
        f"machine: {os.cpu_count()} cores shared by every server and client of the run; load average at start "
        f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
    )
    try:
        fs = measure_fsync_rate(root, 1.0)
        res.notes.append(f"machine fsync rate {fs.per_second:,.0f}/s (100 B write + fdatasync)")

        # ------------------------------------------------------------------ onceflow, on each store
        if "onceflow" in systems:
            server = onceflow_server(root / "onceflow-data", "always", *_serve_args(plan))
            server.start()
            res.notes.append(
                "onceflow: `onceflow serve --fsync always` (fdatasync before every acknowledgement, group commit)"
                + (f", `{' '.join(_serve_args(plan))}`" if _serve_args(plan) else "")
            )
            try:
                _measure_onceflow(plan, server, ONCEFLOW)
            finally:
                server.stop()
        for kind in stores:
            _measure_store(plan, kind)

        # ------------------------------------------------------------------ reference
        if "reference" in systems and ({"append", "latency"} & only):
            found = find_reference(False, res.notes)
            if found is None:
                res.skipped.append("the Durable Streams reference server (see the notes)")
            else:
                script, version = found
                res.notes.append(
                    f"reference: {NODE_PACKAGE} {version} on Node {_node_version()}, file-backed (`dataDir`)"
                )
                data = root / "reference-data"
                data.mkdir()
                server = reference_server(script, data)
                server.start()
                try:
                    if "append" in only:
                        lr = measure_server(server, "reference", "file", gen_(), CONCURRENCY, wsec)
                        res.measurements.append(_from_load(lr, REFERENCE, gen_()))
                    if "latency" in only:
                        lat = _run_loop(_http_latency(server.url, "latency", REFERENCE, lat_count, LATENCY_RATE))
                        res.latencies.append(lat)
                        _say(f"reference latency: p50 {lat.p50_ms:.2f} p99 {lat.p99_ms:.2f} ms")
                finally:
                    server.stop()

        # ------------------------------------------------------------------ Redis
        if "redis" in systems:
            res.notes.append(
                "Redis: `redis-server --appendonly yes --appendfsync always|everysec`, stream entries "
                "`XADD key * m <value>` (value 99 / 1,023 B + the field name)"
            )
            for fsync, system in (("always", REDIS_ALWAYS), ("everysec", REDIS_EVERYSEC)):
                try:
                    redis = RedisServer(appendonly=True, appendfsync=fsync)
                except ServiceUnavailable as exc:
                    res.skipped.append(f"Redis: {exc}")
                    break
                redis.start()
                try:
                    if "produce" in only:
                        for size in SIZES:
                            _say(f"{system}: pipelined XADD, {size} B")
                            mr, cr = redis_load(
                                redis, system, "produce", size, REDIS_PIPE_CLIENTS, REDIS_PIPELINE, seconds
                            )
                            res.measurements.append(mr)
                            if cr is not None and size == 100:
                                res.measurements.append(cr)
                            _say(f"  {mr.msg_per_s:,.0f} msg/s; {mr.check}")
                    if "append" in only:
                        _say(f"{system}: XADD at concurrency {CONCURRENCY}, unpipelined")
                        ma, _ = redis_load(redis, system, "append", 100, CONCURRENCY, 1, seconds)
                        res.measurements.append(ma)
                        _say(f"  {ma.msg_per_s:,.0f} msg/s; {ma.check}")
                    if "latency" in only and fsync == "always":
                        lat = _run_loop(_redis_latency(redis.url, system, lat_count, LATENCY_RATE))
                        res.latencies.append(lat)
                        _say(f"  latency p50 {lat.p50_ms:.2f} p99 {lat.p99_ms:.2f} ms")
                    if "readers" in only and fsync == "always":
                        _say(f"{system}: {readers:,} XREAD BLOCK readers, {fan_count} messages at {READER_RATE:g}/s")
                        fo = _run_loop(_redis_fanout(redis.url, system, readers, fan_count, READER_RATE))
                        res.fanouts.append(fo)
                        _say_fanout(fo)
                finally:
                    redis.stop()

        # ------------------------------------------------------------------ NATS JetStream
        if "nats" in systems:
            try:
                nats, res.jetstream_durable = nats_server(root / "nats", res.notes)
            except ServiceUnavailable as exc:
                res.skipped.append(f"NATS JetStream: {exc}")
            else:
                nats.start()
                try:
                    if "produce" in only:
                        for size in SIZES:
                            _say(f"JetStream: publish_async, {size} B")
                            mj, cj = _run_loop(_nats_produce(nats, size, seconds, "produce"))
                            res.measurements.append(mj)
                            if cj is not None and size == 100:
                                res.measurements.append(cj)
                            _say(f"  {mj.msg_per_s:,.0f} msg/s; {mj.check}")
                    if "append" in only:
                        _say(f"JetStream: publish at concurrency {CONCURRENCY}")
                        mn, _ = _run_loop(_nats_produce(nats, 100, seconds, "append"))
                        res.measurements.append(mn)
                        _say(f"  {mn.msg_per_s:,.0f} msg/s; {mn.check}")
                    if "latency" in only:
                        lat = _run_loop(_nats_latency(nats, lat_count, LATENCY_RATE))
                        res.latencies.append(lat)
                        _say(f"  latency p50 {lat.p50_ms:.2f} p99 {lat.p99_ms:.2f} ms")
                    if "readers" in only:
                        _say(
                            f"JetStream: {readers:,} ordered push consumers, {fan_count} messages at {READER_RATE:g}/s"
                        )
                        fo = _run_loop(_nats_fanout(nats, readers, fan_count, READER_RATE))
                        res.fanouts.append(fo)
                        _say_fanout(fo)
                finally:
                    nats.stop()
    except BenchFailure as exc:
        failures.append(str(exc))
        print(f"\n[bench] FAILED: {exc}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("\n[bench] interrupted; servers stopped, temp dir removed", file=sys.stderr, flush=True)
        return 130
    except Exception as exc:  # noqa: BLE001 - a peer or client error ends the run, but what was measured is reported
        failures.append(f"{type(exc).__name__}: {exc}")
        print(f"\n[bench] FAILED: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)

    load = os.getloadavg()
    res.notes.append(f"load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}")
    for m in res.measurements:
        failures.extend(f"{m.workload} {m.system}: {f}" for f in m.failures)
    for lat in res.latencies:
        failures.extend(f"latency {lat.system}: {f}" for f in lat.failures)
    for fo in res.fanouts:
        failures.extend(f"{fo.readers} readers {fo.system}: {f}" for f in fo.failures)
    images = plot(res, out_dir) if res.measurements or res.latencies else []
    md = render_markdown(res, images)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.md").write_text(md)
    _say(f"report written to {out_dir / 'compare.md'}; plots: {', '.join(images) or 'none'}")
    doc: dict[str, Any] = {
        "benchmark": "compare",
        **{k: v for k, v in asdict(res).items() if k != "latencies"},
        "latencies": [{k: v for k, v in asdict(lat).items() if k != "samples_ms"} for lat in res.latencies],
        "targets": [
            dict(zip(("workload", "comparison", "value", "target", "verdict"), t, strict=True)) for t in targets(res)
        ],
        "images": images,
    }
    return report(md, doc, failures, args.out)


def _raise_fd_limit(readers: int) -> None:
    """Room for the readers' sockets (here and in the servers started after, which inherit it)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * readers + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


def _from_load(lr: Any, system: str, gen: LoadGenerator) -> Measurement:
    m = Measurement(
        "append",
        system,
        gen.name if not gen.is_python else "Python aiohttp, one POST per message",
        lr.msg_per_s,
        lr.seconds,
        lr.ok,
        lr.p50_ms,
        lr.p99_ms,
        acknowledged=lr.acknowledged,
        stored=lr.stored,
        exact=gen.is_python,
        server_cpu_pct=lr.server_cpu_pct,
        db=lr.db,
        failures=list(lr.failures),
    )
    return m


def add_parser(bsub: Any) -> None:
    c = bsub.add_parser(
        "compare",
        help="onceflow beside Redis Streams, NATS JetStream and the Durable Streams reference, same run: tables + PNG plots",
        description="Runs the same workloads against onceflow and each peer (each started here on a free loopback port and "
        "stopped after): producer throughput on each system's best path (100 B and 1 KiB), single-message "
        f"appends at concurrency {CONCURRENCY}, append-to-consumer latency, catch-up reads, {READERS:,} live readers. "
        "Every stream is read "
        "back and checked against what was acknowledged. Writes compare.md and compare-*.png to --out-dir.",
    )
    c.add_argument("--quick", action="store_true", help="a few seconds per measurement (2 s; latency 400 messages)")
    c.add_argument(
        "--seconds", type=float, default=None, help="seconds per throughput measurement (default: 10, --quick: 2)"
    )
    c.add_argument(
        "--systems",
        default="onceflow,reference,redis,nats",
        help="comma-separated subset of onceflow,reference,redis,nats (default: all)",
    )
    c.add_argument(
        "--only", default=None, help="comma-separated subset of produce,append,latency,readers (default: all)"
    )
    c.add_argument(
        "--store",
        default="local",
        help="the stores onceflow is measured on, comma-separated: local (always, with onceflow in --systems), "
        "postgresql (a throwaway PostgreSQL started here, fsync and synchronous_commit on: `onceflow serve "
        "--store`), postgresql-ha (a primary and a synchronous standby); each beside the local store, same "
        "workloads, same run, with its ratio to it (default: local)",
    )
    c.add_argument(
        "--readers", type=int, default=READERS, help=f"live readers in the readers workload (default: {READERS:,})"
    )
    c.add_argument("--out-dir", default="docs/img", help="where compare.md and the PNGs go (default: docs/img)")
    c.add_argument(
        "--profile", action="store_true", help="record the onceflow server with py-spy during its throughput runs"
    )
    c.add_argument(
        "--generator",
        choices=["auto", "wrk", "python"],
        default="auto",
        help="HTTP load generator for single-message appends (default: auto = wrk when it can be had)",
    )
    c.add_argument("--out", default=None, help="also write the results as JSON to this file")
    c.set_defaults(func=_bench_compare)


def _bench_compare(args: argparse.Namespace) -> int:
    from .progress import bench_progress

    with bench_progress("compare"):  # a bar on a terminal, the plain [bench] lines elsewhere
        return run(args)
