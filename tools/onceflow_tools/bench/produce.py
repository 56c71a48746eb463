"""``onceflow bench produce``: idempotent producer throughput and append-to-live-reader latency.

One run does, in order:

1. starts ``onceflow serve --fsync always`` (every acknowledged append is fdatasync'd) on a free port
   with a temp data dir, using the helpers of ``onceflow bench append``;
2. append-to-live-reader latency: a producer in this process appends one small JSON message at a
   time (``--latency-rate`` per second, each carrying ``time.perf_counter_ns()`` at its append), and
   a live reader with the same client in the same process (``AsyncStream.chunks`` with
   ``live="long-poll"``, then ``live="sse"``) notes when each message arrives: p50 / p99;
3. producer throughput with 100-byte messages, on a JSON stream (``application/json``: JSON objects
   padded to 100 bytes, pre-encoded) and on a byte stream (``application/octet-stream``: 100-byte
   newline-terminated records): the idempotent producer with ``max_in_flight`` 1 and 5, and the same
   batching and pipelining with idempotence off (no ``Producer-*`` headers). Each runs for
   ``--seconds`` after a warm-up; only acknowledged messages count (flush at the end; the clock stops
   when the flush returns). Afterwards the stream is checked: HEAD for the record count, and the
   whole stream read back and compared byte for byte with what was sent;
4. if a throughput target is missed: a short cProfile run of this (the producer) process for the best
   idempotent configuration, top 15 functions by own time, and which side is the bottleneck from
   the server's and the client's CPU time (read from /proc and ``time.process_time``);
5. the same latency measurement against the Durable Streams Node reference server
   (``@durable-streams/server``), file-backed (``dataDir``) and in memory, unless ``--skip-reference``
   or Node.js / npm are missing;
6. with ``--compression gzip|zstd``: what the coding does (docs/benchmarks.md, "Compression"), in
   the same run, on JSON events of ~150 B that vary as real ones do (ids, times, users, a random
   session; :func:`event_messages`, a pool of 32,000 cycled, so no batch and no zstd window holds
   one twice): the idempotent producer at in-flight 1 and 5, plain then compressed, each checked
   as in 3 (every message read back and compared), with the request body bytes sent per message;
   and a catch-up read of one such stream, plain then compressed (``Accept-Encoding``), with the
   answer bytes as received;
7. a results table (and JSON with ``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import importlib.util
import itertools
import json
import os
import pstats
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from onceflow.client import AsyncIdempotentProducer, AsyncStream, OnceflowError
from onceflow.client.lowlevel import Coding, accept_headers, async_http_client, request_url, stream_url
from onceflow.testing import ServerProcess, onceflow_server

from .append import (
    NODE_PACKAGE,
    BenchFailure,
    _node_version,
    _pct,
    _raise_on_sigterm,
    _run_loop,
    _say,
    find_reference,
    make_message,
    reference_server,
    report,
)

__all__ = ["run"]

MESSAGE_BYTES = 100
BATCH_BYTES = 1 << 20  # the producer's default max_batch_bytes
WARMUP_SECONDS = 1.0
APPEND_CHUNK = 1_000  # messages appended between two yields to the event loop
TARGET_MSG_PER_S = 1_000_000
PIPELINING_EXPECTED = 5.0  # the seed's expectation for max_in_flight 5 vs 1
IDEMPOTENCE_OVERHEAD_TARGET_PCT = 3.0
LATENCY_P50_TARGET_MS = 2.0
LATENCY_P99_TARGET_MS = 10.0
PROFILE_TOP = 15
PROFILE_MAX_SECONDS = 5.0

Content = Literal["json", "bytes", "events"]
LiveMode = Literal["long-poll", "sse"]

CONTENT_TYPES: dict[Content, str] = {
    "json": "application/json",
    "bytes": "application/octet-stream",
    "events": "application/json",
}
EVENT_POOL = 32 * APPEND_CHUNK  # distinct events, cycled: ~5 MB, more than a batch (1 MiB) or a zstd window


def byte_message(size: int = MESSAGE_BYTES) -> bytes:
    """A newline-terminated record of exactly ``size`` bytes."""
    return b"r" * (size - 1) + b"\n"


def message_for(content: Content) -> bytes:
    return make_message(MESSAGE_BYTES) if content == "json" else byte_message(MESSAGE_BYTES)


def event_messages(n: int = EVENT_POOL, seed: int = 32) -> list[bytes]:
    """``n`` JSON events as an application logs them, ~150 B each, compact: a sequence id and time,
    a user of 100,000, an event kind and path, an amount and a random 48-bit session id (which no
    coding compresses). Padded repeats (:func:`make_message`) compress a hundredfold: no measure of
    compression."""
    rng = random.Random(seed)
    kinds = ("page_view", "click", "add_to_cart", "purchase", "search", "login")
    return [
        json.dumps(
            {
                "id": i,
                "ts": 1_767_225_600_000 + i * 37 + rng.randrange(37),
                "user": f"u{rng.randrange(100_000):05d}",
                "session": f"{rng.getrandbits(48):012x}",
                "event": rng.choice(kinds),
                "path": f"/products/{rng.randrange(5000)}",
                "amount": round(rng.random() * 200, 2),
                "ok": rng.random() < 0.97,
            },
            separators=(",", ":"),
        ).encode()
        for i in range(n)
    ]


def messages_for(content: Content) -> list[bytes]:
    """What a throughput run appends, cycled: one message again and again, or the event pool."""
    return event_messages() if content == "events" else [message_for(content)]


# ---------------------------------------------------------------------------------------------- results


@dataclass
class ThroughputResult:
    content: Content
    idempotent: bool
    max_in_flight: int
    seconds: float  # from the start of the measured window until its final flush returned
    messages: int  # acknowledged in the measured window
    msg_per_s: float
    mb_per_s: float
    batches: int  # acknowledged POSTs in the measured window
    requests: int  # POSTs attempted in the measured window (retries included)
    retries: int = 0
    duplicates: int = 0
    gaps: int = 0
    server_cpu_pct: float | None = None  # 100 = one core, all threads of the server process
    client_cpu_pct: float | None = None  # this process (producer + event loop + HTTP client)
    other_cpu_pct: float | None = None  # the rest of the machine (other jobs), 100 = one core
    server_us_per_msg: float | None = None
    client_us_per_msg: float | None = None
    acknowledged: int = 0  # over warm-up + measurement
    stored_records: int | None = None  # from HEAD: Stream-Next-Offset's first number
    stored_messages: int | None = None  # read back
    failures: list[str] = field(default_factory=list)
    compression: str | None = None  # the producer's compression=
    body_bytes: int = 0  # request body bytes sent in the measured window, as sent (compressed or not)
    message_bytes: float = 0.0  # the average message, as appended

    @property
    def label(self) -> str:
        return (
            f"{self.content}, {'idempotent' if self.idempotent else 'idempotence off'}, in-flight {self.max_in_flight}"
            + (f", {self.compression}" if self.compression else "")
        )

    @property
    def wire_bytes_per_msg(self) -> float:
        return self.body_bytes / self.messages if self.messages else 0.0

    @property
    def batch_messages(self) -> float:
        return self.messages / self.batches if self.batches else 0.0


@dataclass
class CatchUpRead:
    """A catch-up read of a whole stream, in answers of up to 4 MiB (the server's max_read_bytes)."""

    coding: str | None  # what Accept-Encoding asked for (None: identity)
    seconds: float
    answers: int
    data_bytes: int  # as decoded
    wire_bytes: int  # answer bodies as received
    coded_answers: int  # answers that came in the coding
    server_cpu_pct: float | None = None
    client_cpu_pct: float | None = None

    @property
    def mb_per_s(self) -> float:
        return self.data_bytes / self.seconds / 1e6 if self.seconds else 0.0

    @property
    def server_cpu_seconds(self) -> float | None:
        return None if self.server_cpu_pct is None else self.server_cpu_pct * self.seconds / 100

    @property
    def client_cpu_seconds(self) -> float | None:
        return None if self.client_cpu_pct is None else self.client_cpu_pct * self.seconds / 100


@dataclass
class LatencyResult:
    system: str  # "onceflow" | "reference"
    mode: str  # "file" | "memory"
    live: LiveMode
    sent: int
    received: int
    posts: int  # POSTs the producer needed (fewer than messages: it batched while waiting for acks)
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    server_cpu_pct: float | None = None  # from the first append until the last message arrived
    client_cpu_pct: float | None = None
    other_cpu_pct: float | None = None
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures and self.p50_ms <= LATENCY_P50_TARGET_MS and self.p99_ms <= LATENCY_P99_TARGET_MS


@dataclass
class ProfileRow:
    function: str
    ncalls: int
    tottime_s: float
    cumtime_s: float


@dataclass
class ProfileResult:
    config: str
    seconds: float
    messages: int
    msg_per_s: float
    server_cpu_pct: float | None
    client_cpu_pct: float | None
    bottleneck: str
    client_us_per_msg: float | None = None  # of the unprofiled run
    server_us_per_msg: float | None = None
    rows: list[ProfileRow] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- producers


def _percentile(ordered: list[float], p: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]


def _cpu_pct(cpu: float | None, elapsed: float) -> float | None:
    return None if cpu is None or elapsed <= 0 else 100 * cpu / elapsed


def machine_busy_seconds() -> float | None:
    """CPU seconds all cores of the machine have spent busy so far (/proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    steal = int(fields[8]) if len(fields) > 8 else 0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _other_pct(machine: float | None, server: float | None, client: float | None) -> float | None:
    """CPU% used by neither the server nor this process (other jobs on the machine)."""
    if machine is None or server is None or client is None:
        return None
    return max(0.0, machine - server - client)


def _tail_records(token: str) -> int:
    """The record count in an onceflow offset token (``<records>_<bytes>``)."""
    head = token.split("_", 1)[0]
    if not head.isdigit():
        raise BenchFailure(f"unexpected offset token {token!r}")
    return int(head)


# ---------------------------------------------------------------------------------------------- throughput


def _chunks(msgs: list[bytes]) -> list[list[bytes]]:
    """``msgs`` in the lists of APPEND_CHUNK that :func:`_drive` appends in turn."""
    if len(msgs) == 1:
        return [msgs * APPEND_CHUNK]
    assert len(msgs) % APPEND_CHUNK == 0
    return [msgs[i : i + APPEND_CHUNK] for i in range(0, len(msgs), APPEND_CHUNK)]


async def _drive(
    producer: AsyncIdempotentProducer, chunks: Iterator[list[bytes]], until: float, max_pending: int
) -> None:
    """Append the next of ``chunks`` (:func:`_chunks`, cycled), and the next, as fast as the
    producer takes them until ``until``, never more than ``max_pending`` messages unacknowledged
    (the producer itself never pushes back). The next call goes on where this one stopped."""
    extend = producer.extend
    clock = time.perf_counter
    while clock() < until:
        chunk = next(chunks)
        await producer.wait_for_capacity(max_pending)
        extend(chunk)  # the batch API: one lock and wake-up per APPEND_CHUNK messages
        await asyncio.sleep(0)  # let the sender seal and dispatch


async def _verify(
    base_url: str, name: str, content: Content, msgs: list[bytes], acked: int, batches: int
) -> tuple[int, int, list[str]]:
    """(records per HEAD, messages read back, problems) for a stream that should hold ``acked``
    copies of ``msgs[0]`` in ``batches`` POSTs, or of ``msgs`` in turn, cycled, when there are several."""
    if len(msgs) > 1:
        return await _verify_cycle(base_url, name, msgs, acked)
    msg = msgs[0]
    problems: list[str] = []
    async with AsyncStream.connect(base_url, name) as stream:
        info = await stream.head()
        records = _tail_records(info.next_offset)
        expected_records = acked if content == "json" else batches  # a byte stream's record is one POST's body
        if records != expected_records:
            what = "messages" if content == "json" else "POSTs"
            problems.append(f"HEAD says {records:,} records, expected {expected_records:,} (acknowledged {what})")
        count = 0
        wrong_chunks = 0
        size = len(msg)
        async for chunk in stream.chunks("-1"):
            data = chunk.data
            if not data:
                continue
            if content == "json":
                n = (len(data) - 1) // (size + 1)
                ok = n > 0 and data == b"[" + (msg + b",") * (n - 1) + msg + b"]"
            else:
                n, rest = divmod(len(data), size)
                ok = rest == 0 and data == msg * n
            if not ok:
                wrong_chunks += 1
            count += n
        if wrong_chunks:
            problems.append(f"{wrong_chunks} chunk(s) read back differ from what was sent")
        if count < acked:
            problems.append(f"LOST ACKNOWLEDGED MESSAGES: {acked:,} acknowledged, {count:,} read back")
        elif count > acked:
            problems.append(f"DUPLICATES: {count:,} messages read back, only {acked:,} appended")
        await stream.delete()  # frees the disk for the next run
    return records, count, problems


async def _verify_cycle(base_url: str, name: str, msgs: list[bytes], acked: int) -> tuple[int, int, list[str]]:
    """:func:`_verify` of a JSON stream that should hold ``msgs`` in turn, cycled, ``acked`` of them:
    each answer's array is walked message by message against the one due next."""
    problems: list[str] = []
    async with AsyncStream.connect(base_url, name) as stream:
        records = _tail_records((await stream.head()).next_offset)
        if records != acked:
            problems.append(f"HEAD says {records:,} records, expected {acked:,} (acknowledged messages)")
        count, size = 0, len(msgs)
        async for chunk in stream.chunks("-1"):
            inner, at = chunk.data[1:-1], 0
            while at < len(inner):
                due = msgs[count % size]
                if not inner.startswith(due, at):
                    problems.append(f"message {count:,} read back differs from the one appended")
                    break
                at += len(due) + 1
                count += 1
            if problems:
                break
        if not problems and count != acked:
            problems.append(f"{count:,} messages read back for {acked:,} acknowledged (lost or duplicated)")
        await stream.delete()
    return records, count, problems


async def _catch_up(server: ServerProcess, name: str, coding: Coding | None) -> CatchUpRead:
    """Reads the whole stream ``name`` from the start, asking for answers in ``coding``."""
    target = request_url(stream_url(server.url, name))
    res = CatchUpRead(coding, 0.0, 0, 0, 0, 0)
    async with async_http_client(server.url, timeout=60.0) as client:
        srv0, cli0, t0 = server.cpu_seconds(), time.process_time(), time.perf_counter()
        offset = "-1"
        while True:
            resp = await client.get(target, params={"offset": offset}, headers=accept_headers(coding))
            if resp.status_code != 200:
                raise BenchFailure(f"catch-up read of {name} answered {resp.status_code}: {resp.text[:200]}")
            res.answers += 1
            res.data_bytes += len(resp.content)
            res.wire_bytes += resp.num_bytes_downloaded
            res.coded_answers += "content-encoding" in resp.headers
            if resp.headers.get("stream-up-to-date") == "true":
                break
            offset = resp.headers["stream-next-offset"]
        res.seconds = time.perf_counter() - t0
        srv1 = server.cpu_seconds()
        res.server_cpu_pct = _cpu_pct(None if srv0 is None or srv1 is None else srv1 - srv0, res.seconds)
        res.client_cpu_pct = _cpu_pct(time.process_time() - cli0, res.seconds)
    return res


async def _measure_throughput(
    server: ServerProcess,
    content: Content,
    idempotent: bool,
    max_in_flight: int,
    seconds: float,
    run_id: int,
    profiler: cProfile.Profile | None = None,
    compression: Coding | None = None,
    reads: list[CatchUpRead] | None = None,
    read_coding: Coding | None = None,
) -> ThroughputResult:
    msgs = messages_for(content)
    chunks = itertools.cycle(_chunks(msgs))  # warm-up and measurement: one sequence, which _verify follows
    ct = CONTENT_TYPES[content]
    name = f"produce-{run_id}-{content}-{'idem' if idempotent else 'plain'}-{max_in_flight}"
    async with AsyncStream.connect(server.url, name) as stream:
        await stream.create(ct)
    producer = AsyncIdempotentProducer(
        server.url,
        name,
        producer_id=f"bench-{name}",
        epoch=0,
        content_type=ct,
        idempotent=idempotent,
        max_batch_bytes=BATCH_BYTES,
        linger_ms=0,
        max_in_flight=max_in_flight,
        compression=compression,
    )
    size = sum(map(len, msgs)) / len(msgs)
    per_batch = int(BATCH_BYTES // (size + 1))
    max_pending = (max_in_flight + 2) * per_batch
    res = ThroughputResult(content, idempotent, max_in_flight, 0.0, 0, 0.0, 0.0, 0, 0)
    res.compression, res.message_bytes = compression, size
    try:
        await producer.start()
        await _drive(producer, chunks, time.perf_counter() + WARMUP_SECONDS, max_pending)
        await producer.flush()
        s0 = (
            producer.stats.acked,
            producer.stats.batches_sent,
            producer.stats.requests,
            producer.stats.retries,
            producer.stats.duplicates,
            producer.stats.gaps,
            producer.stats.body_bytes,
        )
        srv0, cli0, all0 = server.cpu_seconds(), time.process_time(), machine_busy_seconds()
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        try:
            await _drive(producer, chunks, t0 + seconds, max_pending)
            await producer.flush()
        finally:
            if profiler is not None:
                profiler.disable()
        elapsed = time.perf_counter() - t0
        srv1, cli1, all1 = server.cpu_seconds(), time.process_time(), machine_busy_seconds()
    except OnceflowError as exc:
        res.failures.append(f"producer failed: {exc}")
        return res
    finally:
        with contextlib.suppress(OnceflowError):
            await producer.close(flush=False)
    st = producer.stats
    res.seconds = elapsed
    res.messages = st.acked - s0[0]
    res.batches = st.batches_sent - s0[1]
    res.requests = st.requests - s0[2]
    res.retries, res.duplicates, res.gaps = st.retries - s0[3], st.duplicates - s0[4], st.gaps - s0[5]
    res.body_bytes = st.body_bytes - s0[6]
    res.msg_per_s = res.messages / elapsed
    res.mb_per_s = res.messages * size / elapsed / 1e6
    srv_cpu = None if srv0 is None or srv1 is None else srv1 - srv0
    res.server_cpu_pct = _cpu_pct(srv_cpu, elapsed)
    res.client_cpu_pct = _cpu_pct(cli1 - cli0, elapsed)
    res.other_cpu_pct = _other_pct(
        _cpu_pct(None if all0 is None or all1 is None else all1 - all0, elapsed), res.server_cpu_pct, res.client_cpu_pct
    )
    if res.messages:
        res.server_us_per_msg = None if srv_cpu is None else srv_cpu / res.messages * 1e6
        res.client_us_per_msg = (cli1 - cli0) / res.messages * 1e6
    res.acknowledged = st.acked
    if st.failed:
        res.failures.append(f"{st.failed} messages failed")
    if reads is not None:  # the same stream read plain, then in the coding
        for coding in (None, read_coding):
            reads.append(await _catch_up(server, name, coding))
    records, stored, problems = await _verify(server.url, name, content, msgs, st.acked, st.batches_sent)
    res.stored_records, res.stored_messages = records, stored
    res.failures.extend(problems)
    return res


def measure_throughput(
    server: ServerProcess,
    content: Content,
    idempotent: bool,
    max_in_flight: int,
    seconds: float,
    run_id: int,
    compression: Coding | None = None,
    reads: list[CatchUpRead] | None = None,
    read_coding: Coding | None = None,
) -> ThroughputResult:
    mode = "idempotent" if idempotent else "idempotence off"
    _say(
        f"throughput: {content} stream, {mode}, max_in_flight {max_in_flight}"
        + (f", compression {compression}" if compression else "")
        + f": {WARMUP_SECONDS:g} s warm-up, then {seconds:g} s"
    )
    res = _run_loop(
        _measure_throughput(
            server,
            content,
            idempotent,
            max_in_flight,
            seconds,
            run_id,
            compression=compression,
            reads=reads,
            read_coding=read_coding,
        )
    )
    status = "FAILED: " + "; ".join(res.failures) if res.failures else "ok"
    _say(
        f"  {res.msg_per_s:,.0f} msg/s ({res.mb_per_s:,.1f} MB/s), {res.batches:,} POSTs of {res.batch_messages:,.0f} msgs, "
        f"server CPU {_pct(res.server_cpu_pct)}, client CPU {_pct(res.client_cpu_pct)}; "
        f"check: {res.stored_messages or 0:,} read back for {res.acknowledged:,} acknowledged: {status}"
    )
    return res


# ---------------------------------------------------------------------------------------------- profile


def bottleneck(r: ThroughputResult) -> str:
    """Which side limits a throughput run, from its CPU use and CPU time per message."""
    cores = os.cpu_count() or 1
    s, c, o = r.server_cpu_pct or 0.0, r.client_cpu_pct or 0.0, r.other_cpu_pct or 0.0
    s_us, c_us = r.server_us_per_msg or 0.0, r.client_us_per_msg or 0.0
    heavier = "the client (this producer process)" if c_us >= s_us else "the server"
    costs = f"CPU per message: client {c_us:.2f} µs, server {s_us:.2f} µs"
    if c >= 85 or s >= 85:
        busy = "client" if c >= s else "server"
        side = "the client (this producer process)" if busy == "client" else "the server"
        return (
            f"{side}: its event loop is busy {max(c, s):.0f}% of one core (client {c:.0f}%, server {s:.0f}%); {costs}"
        )
    if s + c + o >= 85 * cores:
        return (
            f"{heavier}, on a CPU-saturated machine: client {c:.0f}% + server {s:.0f}% + other jobs {o:.0f}% of "
            f"{cores * 100}%, so both processes wait for a core; {costs}"
        )
    return (
        f"neither side's CPU (client {c:.0f}%, server {s:.0f}%, other jobs {o:.0f}%): the time goes to waiting "
        f"(fsync, round trips); {costs}"
    )


def _short(filename: str) -> str:
    for marker in ("/site-packages/", "/src/", "/lib/python3"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def profile_rows(prof: cProfile.Profile, top: int = PROFILE_TOP) -> list[ProfileRow]:
    stats = pstats.Stats(prof)
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = stats.stats  # type: ignore[attr-defined]
    ordered = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    rows = []
    for (filename, line, func), (_cc, ncalls, tottime, cumtime, _callers) in ordered:
        where = func if filename == "~" else f"{func} ({_short(filename)}:{line})"
        rows.append(ProfileRow(where, ncalls, tottime, cumtime))
    return rows


def measure_profile(server: ServerProcess, best: ThroughputResult, seconds: float, run_id: int) -> ProfileResult:
    _say(f"profile: {best.label} under cProfile for {seconds:g} s")
    prof = cProfile.Profile()
    res = _run_loop(
        _measure_throughput(server, best.content, best.idempotent, best.max_in_flight, seconds, run_id, prof)
    )
    if res.failures:
        raise BenchFailure(f"profiled run failed: {'; '.join(res.failures)}")
    return ProfileResult(
        config=best.label,
        seconds=res.seconds,
        messages=res.messages,
        msg_per_s=res.msg_per_s,
        server_cpu_pct=res.server_cpu_pct,
        client_cpu_pct=res.client_cpu_pct,
        bottleneck=bottleneck(best),
        client_us_per_msg=best.client_us_per_msg,
        server_us_per_msg=best.server_us_per_msg,
        rows=profile_rows(prof),
    )


# ---------------------------------------------------------------------------------------------- latency


async def _measure_latency(
    server: ServerProcess, system: str, mode: str, live: LiveMode, count: int, rate: float, run_id: int
) -> LatencyResult:
    base_url = server.url
    name = f"latency-{run_id}-{live}"
    async with AsyncStream.connect(base_url, name) as admin:
        await admin.create("application/json")
    arrived: dict[int, int] = {}  # message index -> nanoseconds from its append to its arrival
    done = asyncio.Event()
    pad = b"p" * 16

    async def reader(stream: AsyncStream) -> None:
        async for chunk in stream.chunks("-1", live=live):
            now = time.perf_counter_ns()
            for m in chunk.messages():
                arrived[int(m["i"])] = now - int(m["t"])
            if len(arrived) >= count:
                done.set()
                return

    res = LatencyResult(system, mode, live, count, 0, 0, 0.0, 0.0, 0.0, 0.0)
    reader_stream = AsyncStream.connect(base_url, name, content_type="application/json")
    task = asyncio.get_running_loop().create_task(reader(reader_stream))
    producer = AsyncIdempotentProducer(
        base_url, name, producer_id=f"bench-{name}", epoch=0, content_type="application/json", linger_ms=0
    )
    try:
        await producer.start()
        await asyncio.sleep(0.3)  # the reader's first request is parked at the tail
        if task.done():
            task.result()
            raise BenchFailure("the live reader stopped before anything was appended")
        interval = 1.0 / rate
        srv0, cli0, all0, t0 = server.cpu_seconds(), time.process_time(), machine_busy_seconds(), time.perf_counter()
        next_at = t0
        for i in range(count):
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            next_at += interval
            producer.append(b'{"i":%d,"t":%d,"p":"%s"}' % (i, time.perf_counter_ns(), pad))
        await producer.flush()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 30)
        elapsed = time.perf_counter() - t0
        srv1, all1 = server.cpu_seconds(), machine_busy_seconds()
        res.server_cpu_pct = _cpu_pct(None if srv0 is None or srv1 is None else srv1 - srv0, elapsed)
        res.client_cpu_pct = _cpu_pct(time.process_time() - cli0, elapsed)
        res.other_cpu_pct = _other_pct(
            _cpu_pct(None if all0 is None or all1 is None else all1 - all0, elapsed),
            res.server_cpu_pct,
            res.client_cpu_pct,
        )
        if task.done() and not task.cancelled() and task.exception() is not None:
            res.failures.append(f"live reader failed: {task.exception()!r}")
    except OnceflowError as exc:
        res.failures.append(f"failed: {exc}")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, OnceflowError, httpx.HTTPError):
            await task
        with contextlib.suppress(OnceflowError):
            await producer.close(flush=False)
        await reader_stream.close()
    res.posts = producer.stats.batches_sent
    res.received = len(arrived)
    if res.received < count:
        res.failures.append(f"the live reader received {res.received} of {count} messages")
    ms = sorted(v / 1e6 for v in arrived.values())
    res.p50_ms, res.p90_ms, res.p99_ms = _percentile(ms, 50), _percentile(ms, 90), _percentile(ms, 99)
    res.max_ms = ms[-1] if ms else 0.0
    return res


def measure_latency(
    server: ServerProcess, system: str, mode: str, live: LiveMode, count: int, rate: float, run_id: int
) -> LatencyResult:
    _say(f"latency: {system} ({mode}), live={live}: {count:,} messages at {rate:g}/s")
    res = _run_loop(_measure_latency(server, system, mode, live, count, rate, run_id))
    status = "FAILED: " + "; ".join(res.failures) if res.failures else "ok"
    _say(
        f"  p50 {res.p50_ms:.2f} ms, p90 {res.p90_ms:.2f} ms, p99 {res.p99_ms:.2f} ms, max {res.max_ms:.2f} ms "
        f"({res.received:,} of {res.sent:,} received, {res.posts:,} POSTs), server CPU {_pct(res.server_cpu_pct)}, "
        f"client CPU {_pct(res.client_cpu_pct)}: {status}"
    )
    return res


# ---------------------------------------------------------------------------------------------- report


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def _find(loads: list[ThroughputResult], content: Content, idempotent: bool, inflight: int) -> ThroughputResult | None:
    for r in loads:
        if (r.content, r.idempotent, r.max_in_flight) == (content, idempotent, inflight) and not r.failures:
            return r
    return None


def throughput_targets(loads: list[ThroughputResult]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for content in ("json", "bytes"):
        for idem in (True, False):
            one, five = _find(loads, content, idem, 1), _find(loads, content, idem, 5)
            pipe = five.msg_per_s / one.msg_per_s if one and five and one.msg_per_s else None
            out.append(
                {
                    "content": content,
                    "check": f"pipelining: in-flight 5 / 1, {'idempotent' if idem else 'idempotence off'}",
                    "value": pipe,
                    "shown": "n/a" if pipe is None else f"{pipe:.2f}x",
                    "target": f"~{PIPELINING_EXPECTED:g}x expected",
                    "verdict": _verdict(None if pipe is None else pipe >= 0.8 * PIPELINING_EXPECTED),
                }
            )
        for inflight in (1, 5):
            on, off = _find(loads, content, True, inflight), _find(loads, content, False, inflight)
            overhead = (off.msg_per_s - on.msg_per_s) / off.msg_per_s * 100 if on and off and off.msg_per_s else None
            out.append(
                {
                    "content": content,
                    "check": f"idempotence overhead: (off - on) / off, in-flight {inflight}",
                    "value": overhead,
                    "shown": "n/a" if overhead is None else f"{overhead:+.1f} %",
                    "target": f"<= {IDEMPOTENCE_OVERHEAD_TARGET_PCT:g} %",
                    "verdict": _verdict(None if overhead is None else overhead <= IDEMPOTENCE_OVERHEAD_TARGET_PCT),
                }
            )
        ok = [r for r in loads if r.content == content and r.idempotent and not r.failures]
        best = max(ok, key=lambda r: r.msg_per_s) if ok else None
        out.append(
            {
                "content": content,
                "check": "idempotent producer, best msg/s",
                "value": best.msg_per_s if best else None,
                "shown": "n/a" if best is None else f"{best.msg_per_s:,.0f}",
                "target": f">= {TARGET_MSG_PER_S:,}",
                "verdict": _verdict(None if best is None else best.msg_per_s >= TARGET_MSG_PER_S),
            }
        )
    return out


def latency_ratios(lats: list[LatencyResult]) -> list[dict[str, Any]]:
    by = {(r.system, r.mode, r.live): r for r in lats if not r.failures}
    out: list[dict[str, Any]] = []
    for live in ("long-poll", "sse"):
        once = by.get(("onceflow", "file", live))
        for mode in ("file", "memory"):
            ref = by.get(("reference", mode, live))
            if once is None or ref is None:
                continue
            out.append(
                {
                    "live": live,
                    "reference_mode": mode,
                    "p50_ratio": once.p50_ms / ref.p50_ms if ref.p50_ms else None,
                    "p99_ratio": once.p99_ms / ref.p99_ms if ref.p99_ms else None,
                }
            )
    return out


def _ratio_text(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def compression_ratios(coded: list[ThroughputResult], reads: list[CatchUpRead]) -> list[dict[str, Any]]:
    """Each compressed run against the plain one of the same in-flight, and the compressed catch-up
    read against the plain one: ratios compressed / plain, measured in the same run."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    out: list[dict[str, Any]] = []
    for r in coded:
        if r.compression is None or r.failures:
            continue
        plain = next(
            (p for p in coded if p.compression is None and p.max_in_flight == r.max_in_flight and not p.failures), None
        )
        if plain is None:
            continue
        out.append(
            {
                "what": f"produce, in-flight {r.max_in_flight}",
                "compression": r.compression,
                "throughput": ratio(r.msg_per_s, plain.msg_per_s),
                "wire_bytes": ratio(r.wire_bytes_per_msg, plain.wire_bytes_per_msg),
                "server_cpu_per_msg": ratio(r.server_us_per_msg, plain.server_us_per_msg),
                "client_cpu_per_msg": ratio(r.client_us_per_msg, plain.client_us_per_msg),
            }
        )
    plain_read = next((x for x in reads if x.coding is None), None)
    for x in reads:
        if x.coding is not None and plain_read is not None:
            out.append(
                {
                    "what": "catch-up read",
                    "compression": x.coding,
                    "throughput": ratio(x.mb_per_s, plain_read.mb_per_s),
                    "wire_bytes": ratio(x.wire_bytes, plain_read.wire_bytes),
                    "server_cpu_per_msg": ratio(x.server_cpu_seconds, plain_read.server_cpu_seconds),
                    "client_cpu_per_msg": ratio(x.client_cpu_seconds, plain_read.client_cpu_seconds),
                }
            )
    return out


def _render_compression(coded: list[ThroughputResult], reads: list[CatchUpRead], seconds: float) -> list[str]:
    lines = [
        "",
        f"COMPRESSION: JSON events of ~{coded[0].message_bytes:.0f} B that vary as real ones do (docs/benchmarks.md), "
        f"idempotent producer, max_batch_bytes {BATCH_BYTES >> 20} MiB, {seconds:g} s each, plain then compressed, same run",
    ]
    lines.append(
        f"{'in-flight':>9} {'coding':<7} {'msg/s':>11} {'MB/s':>7} {'wire B/msg':>10} {'srv µs/msg':>10} {'cli µs/msg':>10} "
        f"{'srv CPU':>8} {'cli CPU':>8} {'other':>6}  check"
    )
    for r in coded:
        check = (
            ("FAILED: " + "; ".join(r.failures)) if r.failures else f"ok ({r.stored_messages:,} read back and compared)"
        )
        srv_us = "n/a" if r.server_us_per_msg is None else f"{r.server_us_per_msg:.2f}"
        cli_us = "n/a" if r.client_us_per_msg is None else f"{r.client_us_per_msg:.2f}"
        lines.append(
            f"{r.max_in_flight:>9} {r.compression or 'none':<7} {r.msg_per_s:>11,.0f} {r.mb_per_s:>7.1f} "
            f"{r.wire_bytes_per_msg:>10.1f} {srv_us:>10} {cli_us:>10} {_pct(r.server_cpu_pct):>8} "
            f"{_pct(r.client_cpu_pct):>8} {_pct(r.other_cpu_pct):>6}  {check}"
        )
    if reads:
        lines.append(
            f"catch-up read of the in-flight-5 plain stream ({reads[0].data_bytes / 1e6:,.1f} MB), plain then compressed:"
        )
        for x in reads:
            lines.append(
                f"  {x.coding or 'none':<7} {x.mb_per_s:>8,.1f} MB/s, {x.answers:,} answers ({x.coded_answers:,} coded), "
                f"{x.wire_bytes / 1e6:,.1f} MB on the wire, server CPU {_pct(x.server_cpu_pct)}, client CPU {_pct(x.client_cpu_pct)}"
            )
    lines.append("ratio compressed / plain (same run):")
    for q in compression_ratios(coded, reads):
        lines.append(
            f"  {q['what']:<22} {q['compression']:<5} throughput {_ratio_text(q['throughput']):>7}   "
            f"bytes on the wire {_ratio_text(q['wire_bytes']):>7}   server CPU {_ratio_text(q['server_cpu_per_msg']):>7}   "
            f"client CPU {_ratio_text(q['client_cpu_per_msg']):>7}"
        )
    lines.append("(produce: CPU per message; read: CPU for the whole read)")
    return lines


def render(
    loads: list[ThroughputResult],
    lats: list[LatencyResult],
    profile: ProfileResult | None,
    notes: list[str],
    seconds: float,
    latency_count: int,
    latency_rate: float,
    coded: list[ThroughputResult] | None = None,
    reads: list[CatchUpRead] | None = None,
) -> tuple[str, dict[str, Any]]:
    lines: list[str] = []
    rule = "=" * 118
    lines += ["", rule, "onceflow bench produce: idempotent producer throughput and append-to-live-reader latency"]
    lines += [f"note: {n}" for n in notes]
    lines.append("")
    lines.append(
        f"THROUGHPUT: {MESSAGE_BYTES} B messages, onceflow serve --fsync always, one producer, max_batch_bytes "
        f"{BATCH_BYTES >> 20} MiB, linger 0 ms; {seconds:g} s each after a {WARMUP_SECONDS:g} s warm-up; "
        "acknowledged messages only (clock stops when the final flush returns)"
    )
    lines.append(
        f"{'stream':<7} {'producer':<16} {'in-flight':>9} {'msg/s':>11} {'MB/s':>7} {'POSTs':>7} {'msgs/POST':>9} "
        f"{'srv CPU':>8} {'cli CPU':>8} {'other':>6} {'srv µs/msg':>10} {'cli µs/msg':>10}  check"
    )
    for r in loads:
        check = (
            ("FAILED: " + "; ".join(r.failures))
            if r.failures
            else (
                f"ok ({r.stored_messages:,} read back = {r.acknowledged:,} acked"
                + (f", {r.retries} retries" if r.retries else "")
                + (f", {r.gaps} gaps" if r.gaps else "")
                + ")"
            )
        )
        srv_us = "n/a" if r.server_us_per_msg is None else f"{r.server_us_per_msg:.2f}"
        cli_us = "n/a" if r.client_us_per_msg is None else f"{r.client_us_per_msg:.2f}"
        lines.append(
            f"{r.content:<7} {'idempotent' if r.idempotent else 'idempotence off':<16} {r.max_in_flight:>9} "
            f"{r.msg_per_s:>11,.0f} {r.mb_per_s:>7.1f} {r.batches:>7,} {r.batch_messages:>9,.0f} "
            f"{_pct(r.server_cpu_pct):>8} {_pct(r.client_cpu_pct):>8} {_pct(r.other_cpu_pct):>6} "
            f"{srv_us:>10} {cli_us:>10}  {check}"
        )
    lines.append(
        "(CPU: 100% = one core; other = the rest of the machine, i.e. other jobs; µs/msg = CPU time per acknowledged "
        "message; gaps = batches the server refused with 409 because they overtook an earlier one, resent)"
    )
    targets = throughput_targets(loads)
    lines.append("")
    for t in targets:
        lines.append(f"  {t['content']:<6} {t['check']:<56} {t['shown']:>12}   target {t['target']:<16} {t['verdict']}")

    lines.append("")
    lines.append(
        f"LATENCY append -> live reader: {latency_count:,} JSON messages of ~60 B, one at a time at {latency_rate:g}/s "
        "(AsyncIdempotentProducer, linger 0), read by AsyncStream.chunks(live=...) in the same process; "
        f"target p50 <= {LATENCY_P50_TARGET_MS:g} ms, p99 <= {LATENCY_P99_TARGET_MS:g} ms"
    )
    lines.append(
        f"{'system':<10} {'mode':<20} {'live':<10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} "
        f"{'POSTs':>6} {'srv CPU':>8} {'cli CPU':>8} {'other':>6}  target  check"
    )
    for lr in lats:
        mode = {"file": "file, fsync always" if lr.system == "onceflow" else "file (dataDir)", "memory": "in-memory"}[
            lr.mode
        ]
        check = (
            ("FAILED: " + "; ".join(lr.failures)) if lr.failures else f"ok ({lr.received:,} of {lr.sent:,} received)"
        )
        lines.append(
            f"{lr.system:<10} {mode:<20} {lr.live:<10} {lr.p50_ms:>8.2f} {lr.p90_ms:>8.2f} {lr.p99_ms:>8.2f} "
            f"{lr.max_ms:>8.2f} {lr.posts:>6,} {_pct(lr.server_cpu_pct):>8} {_pct(lr.client_cpu_pct):>8} "
            f"{_pct(lr.other_cpu_pct):>6}  "
            f"{'PASS' if lr.passed else 'MISS':<6}  {check}"
        )
    if coded:
        lines += _render_compression(coded, reads or [], seconds)
    ratios = latency_ratios(lats)
    if ratios:
        lines.append("ratio onceflow / reference (same client, same run; < 1 means onceflow delivers sooner):")
        for q in ratios:
            lines.append(
                f"  {q['live']:<10} vs reference {q['reference_mode']:<7} p50 {_ratio_text(q['p50_ratio']):>7}   "
                f"p99 {_ratio_text(q['p99_ratio']):>7}"
            )

    if profile is not None:
        lines.append("")
        lines.append(f"WHERE THE TIME GOES (a target was missed): best idempotent configuration = {profile.config}")
        lines.append(f"  bottleneck (from the unprofiled run's CPU): {profile.bottleneck}")
        lines.append(
            f"  {TARGET_MSG_PER_S:,} msg/s needs each side under {1e6 / TARGET_MSG_PER_S:.0f} µs of CPU per "
            "message, on a core of its own"
        )
        lines.append(
            f"  cProfile of the producer process, {profile.seconds:.1f} s, {profile.msg_per_s:,.0f} msg/s under the "
            f"profiler (server CPU {_pct(profile.server_cpu_pct)}, client CPU {_pct(profile.client_cpu_pct)}); "
            f"top {len(profile.rows)} by own time:"
        )
        lines.append(f"  {'tottime s':>10} {'cumtime s':>10} {'ncalls':>11}  function")
        for row in profile.rows:
            lines.append(f"  {row.tottime_s:>10.3f} {row.cumtime_s:>10.3f} {row.ncalls:>11,}  {row.function}")
    lines.append(rule)
    doc: dict[str, Any] = {
        "benchmark": "produce",
        "message_bytes": MESSAGE_BYTES,
        "batch_bytes": BATCH_BYTES,
        "seconds": seconds,
        "warmup_seconds": WARMUP_SECONDS,
        "notes": notes,
        "throughput": [{**asdict(r), "label": r.label, "batch_messages": r.batch_messages} for r in loads],
        "throughput_targets": targets,
        "latency": {
            "messages": latency_count,
            "rate_per_s": latency_rate,
            "target_p50_ms": LATENCY_P50_TARGET_MS,
            "target_p99_ms": LATENCY_P99_TARGET_MS,
            "runs": [{**asdict(lr), "verdict": "PASS" if lr.passed else "MISS"} for lr in lats],
            "ratios_onceflow_over_reference": ratios,
        },
        "profile": asdict(profile) if profile is not None else None,
        "compression": None
        if not coded
        else {
            "runs": [{**asdict(r), "label": r.label, "wire_bytes_per_msg": r.wire_bytes_per_msg} for r in coded],
            "reads": [{**asdict(x), "mb_per_s": x.mb_per_s} for x in reads or []],
            "ratios_compressed_over_plain": compression_ratios(coded, reads or []),
        },
    }
    return "\n".join(lines), doc


# ---------------------------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> int:
    """Entry point of ``onceflow bench produce``; returns the exit code (1 on any failed check)."""
    seconds = float(args.seconds)
    rate = float(args.latency_rate)
    if seconds <= 0 or rate <= 0:
        print("--seconds and --latency-rate must be positive", file=sys.stderr)
        return 2
    latency_count = int(args.latency_messages) if args.latency_messages is not None else max(1, round(rate * seconds))
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    root = Path(tempfile.mkdtemp(prefix="onceflow-bench-produce-"))
    servers: list[ServerProcess] = []
    loads: list[ThroughputResult] = []
    coded: list[ThroughputResult] = []  # --compression: the event runs, plain and compressed
    reads: list[CatchUpRead] = []
    compression: Coding | None = getattr(args, "compression", None)
    lats: list[LatencyResult] = []
    profile: ProfileResult | None = None
    failures: list[str] = []
    notes: list[str] = [
        f"client and servers share this machine's {os.cpu_count()} cores (loopback); the client is onceflow.client "
        "(httpx) on one event loop in this process" + (" (uvloop)" if _has_uvloop() else ""),
        "onceflow: every acknowledged append is fdatasync'd (--fsync always, group commit); latency includes that fsync",
        "idempotence off = AsyncIdempotentProducer(idempotent=False): the same batching, linger and "
        "max_in_flight, POSTs without Producer-Id/-Epoch/-Seq (no server-side dedup or sequence check)",
        "JSON stream: JSON objects padded to 100 B, passed to append() pre-encoded (no json.dumps in the client; the "
        "server still parses and re-encodes each one). Byte stream: 100 B newline-terminated records (no JSON anywhere)",
        "checks: HEAD record count (JSON: messages; bytes: POSTs, one record per POST) and the whole stream read back "
        "and compared byte for byte with the acknowledged messages (exactly once: no loss, no duplicates)",
    ]
    if importlib.util.find_spec("sniffio") is None:
        notes.append(
            "sniffio is not installed (anyio 4.x no longer pulls it in): httpcore's current_async_library() "
            "retries `import sniffio` -- a failing sys.path scan -- several times per async request, "
            "which adds client CPU to every POST and GET measured here"
        )
    run_ids = itertools.count()

    def started(server: ServerProcess) -> ServerProcess:
        servers.append(server)
        startup = server.start()
        _say(f"{server.name} pid {server.pid} ready at {server.url} in {startup * 1e3:,.0f} ms")
        return server

    def latency_pair(server: ServerProcess, system: str, mode: str) -> None:
        for live in ("long-poll", "sse"):
            lr = measure_latency(server, system, mode, live, latency_count, rate, next(run_ids))
            lats.append(lr)
            failures.extend(f"latency {system} {mode} {live}: {f}" for f in lr.failures)

    try:
        _say(f"temp dir {root}; servers bind 127.0.0.1 only")
        server = started(onceflow_server(root / "onceflow-data", "always"))
        try:
            latency_pair(server, "onceflow", "file")
            configs: list[tuple[Content, bool, int]] = [
                (content, idem, inflight)
                for content in ("json", "bytes")
                for inflight in (1, 5)
                for idem in (True, False)
            ]
            for content, idem, inflight in configs:
                r = measure_throughput(server, content, idem, inflight, seconds, next(run_ids))
                loads.append(r)
                failures.extend(f"throughput {r.label}: {f}" for f in r.failures)
            if compression is not None:
                for inflight in (1, 5):
                    for coding in (None, compression):
                        read_here = inflight == 5 and coding is None  # one stream read both ways
                        r = measure_throughput(
                            server,
                            "events",
                            True,
                            inflight,
                            seconds,
                            next(run_ids),
                            compression=coding,
                            reads=reads if read_here else None,
                            read_coding=compression,
                        )
                        coded.append(r)
                        failures.extend(f"throughput {r.label}: {f}" for f in r.failures)
            missed = any(t["verdict"] == "MISS" for t in throughput_targets(loads))
            good = [r for r in loads if r.idempotent and not r.failures]
            if args.no_profile:
                notes.append("profile skipped (--no-profile)")
            elif not missed:
                notes.append("no throughput target missed: no profile")
            elif good:
                best = max(good, key=lambda r: r.msg_per_s)
                profile = measure_profile(server, best, min(seconds, PROFILE_MAX_SECONDS), next(run_ids))
        finally:
            server.stop()

        found = find_reference(args.skip_reference, notes)
        if found is not None:
            script, version = found
            notes.append(
                f"reference: {NODE_PACKAGE} {version} (Node {_node_version()}), DurableStreamTestServer; "
                "file mode = dataDir set, memory mode = no dataDir; latency only"
            )
            ref_data = root / "reference-data"
            ref_data.mkdir()
            for data, mode in ((ref_data, "file"), (None, "memory")):
                ref = started(reference_server(script, data))
                try:
                    latency_pair(ref, "reference", mode)
                finally:
                    ref.stop()
    except BenchFailure as exc:
        failures.append(str(exc))
        print(f"\n[bench] FAILED: {exc}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("\n[bench] interrupted; stopping servers and removing the temp dir", file=sys.stderr, flush=True)
        return 130
    finally:
        for s in servers:
            s.stop()
        shutil.rmtree(root, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)

    text, doc = render(loads, lats, profile, notes, seconds, latency_count, rate, coded, reads)
    return report(text, doc, failures, args.out)


def _has_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True
