"""``onceflow bench append``: single-message appends, onceflow vs the Durable Streams reference server.

One run does, in order:

1. the machine's fsync rate (100-byte write + ``fdatasync`` in a loop), for context;
2. ``onceflow serve --fsync always`` under load: one 100-byte JSON message per POST, to one stream,
   from N concurrent keep-alive connections, for ``--seconds`` (after a 1 s warm-up);
3. the same load against the Node reference server ``@durable-streams/server``, file-backed
   (``dataDir``) and in memory, unless ``--skip-reference`` or Node.js / npm are missing;
4. recovery time of a ``--recovery-gib`` log: built through the storage layer (no HTTP), then
   opened after a clean shutdown, after a crash (from the last periodic snapshot, and with no
   snapshot at all), and a whole ``onceflow serve`` restart on it;
5. a results table (and JSON with ``--out``).

Every load run is checked for correctness: any non-2xx response or socket error fails the run, and
afterwards the whole stream is read back over HTTP to confirm it holds every acknowledged message
(and no more than acknowledged + in flight), each exactly as sent.

The load generator is ``wrk`` (installed with apt-get when missing and possible); without it, a
Python asyncio + aiohttp client, which competes with the servers for the same CPU cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from onceflow.testing import ServerFailure, ServerProcess, onceflow_server

from .progress import say
from .store import DbUse, PostgresStore

__all__ = ["run"]

STREAM_PATH = "/v1/stream/bench"
MESSAGE_BYTES = 100
WARMUP_SECONDS = 1
NODE_PACKAGE = "@durable-streams/server"
RECOVERY_TARGET_S = 2.0
FILE_RATIO_TARGET = 10.0
MEMORY_RATIO_TARGET = 1.0
RECOVERY_BATCH_BYTES = 1 << 20
LOADER_PRODUCER = "bench-loader"

_T = TypeVar("_T")


# A measurement that could not be made or whose result is wrong (lost or corrupted appends, errors); a
# server that did not start (onceflow.testing.ServerProcess) is one too, so the two are one exception.
BenchFailure = ServerFailure


# ---------------------------------------------------------------------------------------------- output


def _say(text: str) -> None:
    say(text)  # a plain "[bench] ..." line, or a step above the bench's bar on a terminal


def make_message(size: int = MESSAGE_BYTES) -> bytes:
    """A JSON object of exactly ``size`` bytes: ``{"k":"xxx…"}``."""
    head, tail = b'{"k":"', b'"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def _run_loop(coro: Coroutine[Any, Any, _T]) -> _T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# ---------------------------------------------------------------------------------------------- results


@dataclass
class LoadResult:
    system: str  # "onceflow" | "reference"
    mode: str  # "file" | "memory"
    generator: str
    seconds: float
    requests: int  # responses received in the measured window
    ok: int  # 2xx among them
    non_2xx: int
    socket_errors: int
    msg_per_s: float
    p50_ms: float
    p99_ms: float
    server_cpu_pct: float | None = None  # all threads of the server process, 100 = one core
    client_cpu_pct: float | None = None
    stored: int | None = None  # messages read back from the stream afterwards
    acknowledged: int = 0  # 2xx responses over warm-up + measurement
    in_flight_bound: int = 0  # appends that may have been stored without their response counted
    db: DbUse | None = None  # on a PostgreSQL store: what the database did in the measured window
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class RecoveryCase:
    name: str
    seconds: float
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.seconds <= RECOVERY_TARGET_S


@dataclass
class RecoveryResult:
    log_bytes: int
    segments: int
    batches: int
    messages: int
    build_seconds: float
    cases: list[RecoveryCase] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


@dataclass
class FsyncRate:
    per_second: float
    mean_us: float
    directory: str


# ---------------------------------------------------------------------------------------------- processes


# ---------------------------------------------------------------------------------------------- tools

NODE_SCRIPT = """\
// Written by `onceflow bench append`: runs the Durable Streams reference server.
import { DurableStreamTestServer } from "@durable-streams/server";

const server = new DurableStreamTestServer({
  port: Number(process.env.PORT || 0),
  host: "127.0.0.1",
  dataDir: process.env.DATA_DIR || undefined,
});
const url = await server.start();
console.log(`durable-streams reference listening on ${url}`);
let stopping = false;
const stop = async () => {
  if (stopping) return;
  stopping = true;
  await server.stop();
  process.exit(0);
};
process.on("SIGTERM", stop);
process.on("SIGINT", stop);
"""


def node_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "onceflow" / "bench-node"


def find_reference(skip: bool, notes: list[str]) -> tuple[Path, str] | None:
    """The reference server's start script and version, or None (with a note saying why) when it is
    skipped or cannot be installed."""
    if skip:
        notes.append("reference server skipped (--skip-reference)")
        _say("reference server skipped (--skip-reference)")
        return None
    try:
        return ensure_node_reference()
    except BenchFailure as exc:
        notes.append(f"reference server skipped: {exc}")
        _say(f"reference server skipped: {exc}")
        return None


def ensure_node_reference() -> tuple[Path, str]:
    """Install the reference server into the cache directory if needed; (script, version).

    Raises BenchFailure with the reason when it cannot be had.
    """
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        raise BenchFailure("node and npm are needed for the reference server and are not on PATH")
    home = node_cache_dir()
    home.mkdir(parents=True, exist_ok=True)
    pkg_json = home / "package.json"
    if not pkg_json.exists():
        pkg_json.write_text(
            json.dumps({"name": "onceflow-bench-node", "private": True, "type": "module"}, indent=2) + "\n"
        )
    installed = home / "node_modules" / "@durable-streams" / "server" / "package.json"
    if not installed.exists():
        _say(f"installing {NODE_PACKAGE} into {home} (npm install)")
        try:
            proc = subprocess.run(
                [npm, "install", "--no-audit", "--no-fund", NODE_PACKAGE],
                cwd=home,
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise BenchFailure("npm install did not finish within 10 minutes") from None
        if proc.returncode != 0 or not installed.exists():
            raise BenchFailure(f"npm install {NODE_PACKAGE} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    version = str(json.loads(installed.read_text()).get("version", "?"))
    types = installed.parent / "dist" / "index.d.ts"
    if types.exists() and "DurableStreamTestServer" not in types.read_text():
        raise BenchFailure(f"{NODE_PACKAGE} {version} does not export DurableStreamTestServer")
    script = home / "bench-server.mjs"
    if not script.exists() or script.read_text() != NODE_SCRIPT:
        script.write_text(NODE_SCRIPT)
    return script, version


def reference_server(script: Path, data: Path | None) -> ServerProcess:
    env = dict(os.environ, PORT="0", DATA_DIR=str(data) if data is not None else "")
    node = shutil.which("node") or "node"
    mode = "file" if data is not None else "memory"
    return ServerProcess(
        f"reference ({mode})",
        [node, script.name],
        re.compile(r"reference listening on (http://\S+)"),
        cwd=script.parent,
        env=env,
    )


def ensure_wrk() -> str | None:
    """The path of wrk, installing it with apt-get (as root) when missing; None if impossible."""
    found = shutil.which("wrk")
    if found:
        return found
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        _say("wrk is not installed and cannot be installed here (needs apt-get as root)")
        return None
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for step in ([apt, "install", "-y", "wrk"], [apt, "update"], [apt, "install", "-y", "wrk"]):
        _say("wrk not found: " + " ".join(["apt-get", *step[1:]]))
        try:
            proc = subprocess.run(step, env=env, capture_output=True, text=True, timeout=600, check=False)
        except subprocess.TimeoutExpired:
            _say("apt-get timed out")
            return None
        if step[1] == "install" and proc.returncode == 0:
            break
    return shutil.which("wrk")


def wrk_version(wrk: str) -> str:
    proc = subprocess.run([wrk, "-v"], capture_output=True, text=True, check=False)
    m = re.search(r"wrk (\S+)", proc.stdout + proc.stderr)
    return f"wrk {m.group(1)}" if m else "wrk"


# ---------------------------------------------------------------------------------------------- load


@dataclass
class _Raw:
    """One load run as the generator saw it."""

    requests: int
    ok: int
    non_2xx: int
    socket_errors: int
    elapsed: float
    p50_ms: float
    p99_ms: float
    client_cpu: float | None
    error_detail: str = ""


_UNITS_MS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def parse_wrk(output: str) -> _Raw:
    """Requests, errors and the latency distribution from ``wrk --latency`` output."""
    m = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m|h)", output)
    if m is None:
        raise BenchFailure(f"could not parse wrk output:\n{output}")
    requests = int(m.group(1))
    elapsed = float(m.group(2)) * _UNITS_MS[m.group(3)] / 1e3
    dist = {
        int(p): float(v) * _UNITS_MS[u]
        for p, v, u in re.findall(r"^\s+(\d+)%\s+([\d.]+)(us|ms|s|m|h)\s*$", output, re.M)
    }
    non = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output)
    non_2xx = int(non.group(1)) if non else 0
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output)
    socket_errors = sum(int(x) for x in sock.groups()) if sock else 0
    if requests and (50 not in dist or 99 not in dist):
        raise BenchFailure(f"wrk printed no latency distribution:\n{output}")
    return _Raw(
        requests=requests,
        ok=requests - non_2xx,
        non_2xx=non_2xx,
        socket_errors=socket_errors,
        elapsed=elapsed,
        p50_ms=dist.get(50, 0.0),
        p99_ms=dist.get(99, 0.0),
        client_cpu=None,
        error_detail=sock.group(0) if sock else "",
    )


def run_wrk(wrk: str, url: str, body: bytes, concurrency: int, seconds: int, workdir: Path) -> _Raw:
    script = workdir / "post.lua"
    if not script.exists():
        text = body.decode()
        if "]==]" in text:
            raise ValueError("message body cannot be quoted for Lua")
        script.write_text(
            f'wrk.method = "POST"\nwrk.body = [==[{text}]==]\nwrk.headers["Content-Type"] = "application/json"\n'
        )
    threads = max(1, min(2, concurrency))
    argv = [
        wrk,
        f"-t{threads}",
        f"-c{concurrency}",
        f"-d{seconds}s",
        "--timeout",
        "30s",
        "--latency",
        "-s",
        str(script),
        url,
    ]
    cpu0 = _children_cpu()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 120, check=False)
    cpu1 = _children_cpu()
    if proc.returncode != 0:
        raise BenchFailure(f"wrk failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    raw = parse_wrk(proc.stdout)
    raw.client_cpu = cpu1 - cpu0
    return raw


async def _python_load(url: str, body: bytes, concurrency: int, seconds: float) -> _Raw:
    import aiohttp

    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    errors: Counter[str] = Counter()
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=30)
    cpu0 = time.process_time()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        deadline = start + seconds

        async def worker() -> None:
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                try:
                    async with session.post(url, data=body, headers=headers) as resp:
                        await resp.read()
                        status = resp.status
                except (aiohttp.ClientError, TimeoutError) as exc:
                    errors[type(exc).__name__] += 1
                    continue
                latencies.append(time.perf_counter() - t)
                statuses[status] += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    latencies.sort()

    def pct(p: float) -> float:
        if not latencies:
            return 0.0
        return latencies[min(len(latencies) - 1, max(0, round(p / 100 * len(latencies)) - 1))] * 1e3

    ok = sum(n for s, n in statuses.items() if 200 <= s < 300)
    requests = sum(statuses.values())
    return _Raw(
        requests=requests,
        ok=ok,
        non_2xx=requests - ok,
        socket_errors=sum(errors.values()),
        elapsed=elapsed,
        p50_ms=pct(50),
        p99_ms=pct(99),
        client_cpu=time.process_time() - cpu0,
        error_detail=", ".join(f"{k} {v}" for k, v in errors.items()),
    )


class LoadGenerator:
    """wrk when available, else the Python client."""

    def __init__(self, choice: str, workdir: Path) -> None:
        self.workdir = workdir
        self.wrk: str | None = None
        if choice in ("auto", "wrk"):
            self.wrk = ensure_wrk()
            if self.wrk is None and choice == "wrk":
                raise BenchFailure("--generator wrk was asked for and wrk is not available")
        if self.wrk is not None:
            self.name = f"{wrk_version(self.wrk)} (-t2 -c<concurrency> --latency, Lua POST script)"
        else:
            self.name = "python asyncio + aiohttp (fallback)"

    @property
    def is_python(self) -> bool:
        return self.wrk is None

    def run(self, url: str, body: bytes, concurrency: int, seconds: int) -> _Raw:
        if self.wrk is not None:
            return run_wrk(self.wrk, url, body, concurrency, seconds, self.workdir)
        return _run_loop(_python_load(url, body, concurrency, seconds))


# ---------------------------------------------------------------------------------------------- HTTP checks


def create_stream(base_url: str) -> None:
    import httpx

    r = httpx.put(base_url + STREAM_PATH, headers={"Content-Type": "application/json"}, timeout=30)
    if r.status_code not in (200, 201):
        raise BenchFailure(f"PUT {STREAM_PATH} answered {r.status_code}: {r.text[:300]}")


def read_back(base_url: str, expected: Any) -> tuple[int, int]:
    """(messages, messages unlike ``expected``) read from the start of the stream to its tail."""
    import httpx

    offset, count, wrong = "-1", 0, 0
    with httpx.Client(timeout=60) as client:
        for _ in range(100_000):
            r = client.get(base_url + STREAM_PATH, params={"offset": offset})
            if r.status_code != 200:
                raise BenchFailure(f"read-back GET answered {r.status_code}: {r.text[:300]}")
            items = r.json()
            if not isinstance(items, list):
                raise BenchFailure(f"read-back GET returned {type(items).__name__}, not a JSON array")
            count += len(items)
            wrong += sum(1 for item in items if item != expected)
            nxt = r.headers.get("Stream-Next-Offset")
            if nxt is None:
                raise BenchFailure("read-back GET had no Stream-Next-Offset header")
            if r.headers.get("Stream-Up-To-Date", "").lower() == "true" or not items or nxt == offset:
                return count, wrong
            offset = nxt
    raise BenchFailure("read-back did not reach the tail")


def stream_tail(base_url: str) -> str:
    import httpx

    r = httpx.head(base_url + STREAM_PATH, timeout=30)
    if r.status_code != 200:
        raise BenchFailure(f"HEAD {STREAM_PATH} answered {r.status_code}")
    return str(r.headers.get("Stream-Next-Offset", ""))


def measure_server(
    server: ServerProcess,
    system: str,
    mode: str,
    gen: LoadGenerator,
    concurrency: int,
    seconds: int,
    db: PostgresStore | None = None,
) -> LoadResult:
    """Warm up, measure, then read the stream back and check it against the acknowledgements
    (``db``: the server's PostgreSQL store, whose use in the measured window is measured too)."""
    body = make_message()
    url = server.url + STREAM_PATH
    create_stream(server.url)
    _say(f"{system} ({mode}): {WARMUP_SECONDS} s warm-up, then {seconds} s at concurrency {concurrency}")
    warm = gen.run(url, body, concurrency, WARMUP_SECONDS)
    db0 = db.sample() if db is not None else None
    cpu0 = server.cpu_seconds()
    raw = gen.run(url, body, concurrency, seconds)
    cpu1 = server.cpu_seconds()
    used = db.since(db0) if db is not None and db0 is not None else None
    res = LoadResult(
        system=system,
        mode=mode,
        generator=gen.name,
        seconds=raw.elapsed,
        requests=raw.requests,
        ok=raw.ok,
        non_2xx=raw.non_2xx,
        socket_errors=raw.socket_errors,
        msg_per_s=raw.ok / raw.elapsed if raw.elapsed > 0 else 0.0,
        p50_ms=raw.p50_ms,
        p99_ms=raw.p99_ms,
        server_cpu_pct=100 * (cpu1 - cpu0) / raw.elapsed
        if cpu0 is not None and cpu1 is not None and raw.elapsed
        else None,
        client_cpu_pct=100 * raw.client_cpu / raw.elapsed if raw.client_cpu is not None and raw.elapsed else None,
        db=used,
    )
    for label, r in (("warm-up", warm), ("measurement", raw)):
        if r.non_2xx:
            res.failures.append(f"{label}: {r.non_2xx} non-2xx responses")
        if r.socket_errors:
            res.failures.append(f"{label}: {r.socket_errors} socket errors ({r.error_detail})")
    res.acknowledged = warm.ok + raw.ok
    # wrk stops with up to one request per connection in flight: stored, but never counted.
    res.in_flight_bound = 0 if gen.is_python else 2 * concurrency
    stored, wrong = read_back(server.url, json.loads(body))
    res.stored = stored
    if stored < res.acknowledged:
        res.failures.append(f"LOST ACKNOWLEDGED APPENDS: {res.acknowledged} acknowledged, {stored} in the stream")
    elif stored > res.acknowledged + res.in_flight_bound:
        res.failures.append(
            f"stream holds {stored} messages, more than {res.acknowledged} acknowledged + {res.in_flight_bound} in flight"
        )
    if wrong:
        res.failures.append(f"{wrong} messages read back differ from what was sent")
    status = "FAILED: " + "; ".join(res.failures) if res.failures else "ok"
    _say(
        f"  {res.msg_per_s:,.0f} msg/s, p50 {res.p50_ms:.2f} ms, p99 {res.p99_ms:.2f} ms, "
        f"server CPU {_pct(res.server_cpu_pct)}, client CPU {_pct(res.client_cpu_pct)}; "
        f"read back {stored:,} messages for {res.acknowledged:,} acknowledged: {status}"
    )
    return res


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}%"


# ---------------------------------------------------------------------------------------------- fsync


def measure_fsync_rate(directory: Path, seconds: float = 2.0) -> FsyncRate:
    path = directory / "fsync-probe"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    data = b"x" * MESSAGE_BYTES
    n, at = 0, 0
    try:
        start = time.perf_counter()
        end = start + seconds
        while True:
            os.pwrite(fd, data, at)
            os.fdatasync(fd)
            n += 1
            at += len(data)
            now = time.perf_counter()
            if now >= end:
                break
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    elapsed = now - start
    return FsyncRate(per_second=n / elapsed, mean_us=elapsed / n * 1e6, directory=str(directory))


# ---------------------------------------------------------------------------------------------- recovery


@dataclass
class _BuiltLog:
    data_dir: Path
    stream_dir: Path
    end_offset: int
    end_pos: int
    last_seq: int
    segments: int
    batches: int
    roll_snapshot: bytes | None  # producers.snap as the last segment roll wrote it
    final_snapshot: bytes  # producers.snap as a clean close wrote it


async def _build_log(data_dir: Path, total_bytes: int) -> _BuiltLog:
    """A server data directory holding stream ``bench`` with ~``total_bytes`` of 1 MiB JSON batches.

    Writes go through StreamLog.stage with policy ``never`` and the server's 64 MiB segments, so
    the segments roll and snapshot exactly as under a real server.
    """
    from onceflow.core.broker import Broker
    from onceflow.storage.batch import FLAG_JSON
    from onceflow.storage.log import SNAPSHOT_NAME

    msg = make_message() + b","  # as stored: compact JSON text + comma
    per_batch = max(1, RECOVERY_BATCH_BYTES // len(msg))
    payload = msg * per_batch
    broker = Broker(data_dir, fsync="never")
    broker.open()
    try:
        created = broker.create("bench", content_type="application/json")
        if created.stream is None:
            raise BenchFailure(f"could not create the recovery stream: {created.kind} {created.detail}")
        slog = created.stream.log
        in_flight: deque[asyncio.Future[None]] = deque()
        seq = 0
        while slog.pending.end.pos < total_bytes:
            staged = slog.stage(
                count=per_batch,
                payload=payload,
                flags=FLAG_JSON,
                producer_id=LOADER_PRODUCER,
                epoch=0,
                first_seq=seq,
                last_seq=seq,
            )
            seq += 1
            in_flight.append(staged.done)
            if len(in_flight) >= 8:
                await in_flight.popleft()
        for fut in in_flight:
            await fut
        snap = slog.directory / SNAPSHOT_NAME
        roll_snapshot = snap.read_bytes() if snap.exists() else None
        end = slog.durable.end
        directory = slog.directory
    finally:
        await broker.close()
    segs = sorted(directory.glob("*.seg"))
    for seg in segs:
        fd = os.open(seg, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return _BuiltLog(
        data_dir=data_dir,
        stream_dir=directory,
        end_offset=end.offset,
        end_pos=end.pos,
        last_seq=seq - 1,
        segments=len(segs),
        batches=seq,
        roll_snapshot=roll_snapshot,
        final_snapshot=(directory / SNAPSHOT_NAME).read_bytes(),
    )


def _drop_page_cache(directory: Path) -> None:
    """Evict the directory's files from the page cache (they are clean: synced after the build)."""
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _time_open(directory: Path, *, use_snapshot: bool, cold: bool, check: Callable[[Any], None]) -> float:
    from onceflow.storage.log import StreamLog
    from onceflow.storage.position import Position

    if cold:
        _drop_page_cache(directory)
    t0 = time.perf_counter()
    slog = StreamLog.open(directory, Position(0, 0), use_snapshot=use_snapshot)
    dt = time.perf_counter() - t0
    try:
        check(slog)
    finally:
        slog.close_files()
    return dt


@contextlib.contextmanager
def _snapshot_as(directory: Path, content: bytes | None, final: bytes) -> Iterator[None]:
    """Put ``content`` (None: no file) in place of the snapshot; restore the clean one after."""
    from onceflow.storage.log import SNAPSHOT_NAME

    snap = directory / SNAPSHOT_NAME
    if content is None:
        snap.unlink(missing_ok=True)
    else:
        snap.write_bytes(content)
    try:
        yield
    finally:
        snap.write_bytes(final)


def _small_batch_segment(directory: Path, size: int) -> int:
    """One segment of ``size`` bytes of single-message batches, as HTTP appends write them."""
    from onceflow.storage.batch import FLAG_JSON, encode_batch

    directory.mkdir(parents=True)
    payload = make_message() + b","
    ts = int(time.time() * 1000)
    n, written, chunk = 0, 0, []
    with open(directory / f"{0:020d}-{0:020d}.seg", "wb") as f:  # the first segment: position 0, offset 0
        while written < size:
            data = encode_batch(base_offset=n, count=1, payload=payload, flags=FLAG_JSON, timestamp=ts)
            chunk.append(data)
            written += len(data)
            n += 1
            if len(chunk) >= 20_000:
                f.write(b"".join(chunk))
                chunk.clear()
        f.write(b"".join(chunk))
        f.flush()
        os.fsync(f.fileno())
    return n


def measure_recovery(root: Path, gib: float) -> RecoveryResult:
    from onceflow.storage.log import DEFAULT_SEGMENT_BYTES, StreamLog

    total = int(gib * (1 << 30))
    data_dir = root / "recovery-data"
    _say(f"recovery: building a {gib:g} GiB log of {RECOVERY_BATCH_BYTES >> 20} MiB batches through the storage layer")
    t0 = time.perf_counter()
    built = _run_loop(_build_log(data_dir, total))
    build_s = time.perf_counter() - t0
    messages = built.end_offset
    res = RecoveryResult(
        log_bytes=built.end_pos,
        segments=built.segments,
        batches=built.batches,
        messages=messages,
        build_seconds=build_s,
    )
    _say(
        f"  built {built.end_pos / (1 << 30):.2f} GiB, {built.segments} segments, {built.batches:,} batches, "
        f"{messages:,} messages in {build_s:.1f} s"
    )

    def check(slog: StreamLog) -> None:
        end = slog.durable.end
        if (end.offset, end.pos) != (built.end_offset, built.end_pos):
            raise BenchFailure(
                f"recovered tail {end} differs from the written tail ({built.end_offset}, {built.end_pos})"
            )
        p = slog.producers.get(LOADER_PRODUCER)
        if p is None or p.last_seq != built.last_seq:
            raise BenchFailure(f"recovered producer state {p} differs from last_seq {built.last_seq}")

    d = built.stream_dir
    rolls = (
        "from the last periodic snapshot (every 8 MiB and at each roll)"
        if built.roll_snapshot is not None
        else "before the first snapshot"
    )
    cases: list[tuple[str, bytes | None, bool, str]] = [
        ("open after clean shutdown (snapshot at the tail)", built.final_snapshot, True, "no scan"),
        (
            f"open after crash, {rolls}",
            built.roll_snapshot,
            True,
            "scans + CRC-checks what was written after that snapshot (< 8 MiB)",
        ),
        (
            "open after crash, no snapshot (use_snapshot=False)",
            built.final_snapshot,
            False,
            f"scans + CRC-checks all {built.end_pos / (1 << 20):.0f} MiB",
        ),
    ]
    for name, snap, use_snapshot, detail in cases:
        with _snapshot_as(d, snap, built.final_snapshot):
            warm = statistics.median(
                _time_open(d, use_snapshot=use_snapshot, cold=False, check=check) for _ in range(3)
            )
            cold = _time_open(d, use_snapshot=use_snapshot, cold=True, check=check)
        res.cases.append(RecoveryCase(f"{name}, warm cache", warm, detail + ", median of 3"))
        res.cases.append(RecoveryCase(f"{name}, cold cache", cold, detail + ", page cache dropped (fadvise)"))
        _say(f"  {name}: {warm * 1e3:,.1f} ms warm, {cold * 1e3:,.1f} ms cold")

    # The realistic crash after single-message appends: the last segment is full of tiny batches.
    small_size = min(DEFAULT_SEGMENT_BYTES, total)
    small_dir = root / "small-batches"
    t1 = time.perf_counter()
    n_small = _small_batch_segment(small_dir, small_size)
    _say(
        f"  built a {small_size >> 20} MiB segment of {n_small:,} single-message batches in {time.perf_counter() - t1:.1f} s"
    )

    def check_small(slog: StreamLog) -> None:
        if slog.durable.end.offset != n_small:
            raise BenchFailure(f"small-batch segment recovered {slog.durable.end.offset} of {n_small} batches")

    small_warm = _time_open(small_dir, use_snapshot=False, cold=False, check=check_small)
    small_cold = _time_open(small_dir, use_snapshot=False, cold=True, check=check_small)
    label = f"no snapshot at all: scan of one {small_size >> 20} MiB segment of single-message batches (worst case)"
    res.cases.append(
        RecoveryCase(f"{label}, warm cache", small_warm, f"{n_small:,} batches of {small_size // n_small} B")
    )
    res.cases.append(RecoveryCase(f"{label}, cold cache", small_cold, f"{n_small:,} batches, page cache dropped"))
    _say(f"  {label}: {small_warm * 1e3:,.1f} ms warm, {small_cold * 1e3:,.1f} ms cold")
    shutil.rmtree(small_dir)

    # Whole server restarts: process start, imports, recovery, bind, until the listening line.
    empty = root / "empty-data"
    empty.mkdir()
    restarts: list[tuple[str, Path, bytes | None, str]] = [
        ("server start, empty data dir (baseline: interpreter + imports)", empty, None, ""),
        ("server restart after clean shutdown", data_dir, built.final_snapshot, "snapshot at the tail"),
        (
            f"server restart after crash, {rolls}",
            data_dir,
            built.roll_snapshot,
            "scan since the last periodic snapshot",
        ),
        ("server restart after crash, no snapshot", data_dir, None, "full scan"),
    ]
    expected_tail = f"{built.end_offset:016d}_{built.end_pos:016d}"
    for name, ddir, snap, detail in restarts:
        server = onceflow_server(ddir)
        ctx = _snapshot_as(d, snap, built.final_snapshot) if ddir == data_dir else contextlib.nullcontext()
        with ctx:
            try:
                dt = server.start(timeout=120)
                if ddir == data_dir:
                    tail = stream_tail(server.url)
                    if tail != expected_tail:
                        res.failures.append(f"{name}: tail {tail}, expected {expected_tail}")
            finally:
                server.stop()
        res.cases.append(RecoveryCase(name, dt, detail + (", " if detail else "") + "spawn until the listening line"))
        _say(f"  {name}: {dt * 1e3:,.0f} ms")
    return res


# ---------------------------------------------------------------------------------------------- report


def _ratio(a: LoadResult | None, b: LoadResult | None) -> float | None:
    if a is None or b is None or b.msg_per_s <= 0:
        return None
    return a.msg_per_s / b.msg_per_s


def render(
    loads: list[LoadResult],
    fsync: FsyncRate | None,
    recovery: RecoveryResult | None,
    generator: str,
    notes: list[str],
    concurrency: int,
) -> tuple[str, dict[str, Any]]:
    lines: list[str] = []
    lines.append("")
    lines.append("=" * 100)
    lines.append(
        f"onceflow bench append: 1 message of {MESSAGE_BYTES} B JSON per POST, one stream, concurrency {concurrency}"
    )
    lines.append(f"load generator: {generator}")
    for note in notes:
        lines.append(f"note: {note}")
    if fsync is not None:
        lines.append(
            f"machine fsync rate: {fsync.per_second:,.0f}/s ({MESSAGE_BYTES} B pwrite + fdatasync, "
            f"{fsync.mean_us:,.0f} µs each, in {fsync.directory})"
        )
    lines.append("")
    lines.append(
        f"{'system':<10} {'mode':<22} {'msg/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'srv CPU':>8} {'cli CPU':>8}  check"
    )
    for r in loads:
        mode = {"file": "file, fsync always" if r.system == "onceflow" else "file (dataDir)", "memory": "in-memory"}[
            r.mode
        ]
        check = (
            "FAILED: " + "; ".join(r.failures)
            if r.failures
            else f"ok ({r.stored:,} stored >= {r.acknowledged:,} acked)"
        )
        lines.append(
            f"{r.system:<10} {mode:<22} {r.msg_per_s:>10,.0f} {r.p50_ms:>8.2f} {r.p99_ms:>8.2f} "
            f"{_pct(r.server_cpu_pct):>8} {_pct(r.client_cpu_pct):>8}  {check}"
        )
    by = {(r.system, r.mode): r for r in loads}
    once = by.get(("onceflow", "file"))
    ratios: dict[str, Any] = {}
    lines.append("")
    for key, ref_mode, target in (
        ("onceflow/reference-file", "file", FILE_RATIO_TARGET),
        ("onceflow/reference-memory", "memory", MEMORY_RATIO_TARGET),
    ):
        ratio = _ratio(once, by.get(("reference", ref_mode)))
        verdict = "n/a" if ratio is None else ("PASS" if ratio >= target else "MISS")
        ratios[key] = {"ratio": ratio, "target": target, "verdict": verdict}
        shown = "n/a (not measured)" if ratio is None else f"{ratio:.2f}x"
        lines.append(f"ratio {key:<27} {shown:>20}   target >= {target:g}x   {verdict}")
    if recovery is not None:
        lines.append("")
        lines.append(
            f"recovery of a {recovery.log_bytes / (1 << 30):.2f} GiB log ({recovery.segments} segments, rolled at 64 MiB, "
            f"{recovery.batches:,} batches of ~1 MiB, {recovery.messages:,} messages; built in {recovery.build_seconds:.1f} s), "
            f"target <= {RECOVERY_TARGET_S:g} s"
        )
        for c in recovery.cases:
            lines.append(f"  {c.name:<96} {c.seconds * 1e3:>9,.1f} ms  {'PASS' if c.passed else 'MISS'}   ({c.detail})")
        for f in recovery.failures:
            lines.append(f"  FAILED: {f}")
    lines.append("=" * 100)
    doc: dict[str, Any] = {
        "benchmark": "append",
        "message_bytes": MESSAGE_BYTES,
        "concurrency": concurrency,
        "generator": generator,
        "notes": notes,
        "fsync_rate": asdict(fsync) if fsync is not None else None,
        "loads": [asdict(r) for r in loads],
        "ratios": ratios,
        "recovery": (
            None
            if recovery is None
            else {
                **{k: v for k, v in asdict(recovery).items() if k != "cases"},
                "target_seconds": RECOVERY_TARGET_S,
                "cases": [{**asdict(c), "verdict": "PASS" if c.passed else "MISS"} for c in recovery.cases],
            }
        ),
    }
    return "\n".join(lines), doc


# ---------------------------------------------------------------------------------------------- main


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``onceflow bench append``; returns the exit code (1 on any failed check)."""
    seconds = max(1, round(args.seconds))
    concurrency = int(args.concurrency)
    if concurrency < 1:
        print("--concurrency must be at least 1", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    root = Path(tempfile.mkdtemp(prefix="onceflow-bench-"))
    servers: list[ServerProcess] = []
    loads: list[LoadResult] = []
    notes: list[str] = []
    failures: list[str] = []
    fsync: FsyncRate | None = None
    recovery: RecoveryResult | None = None
    generator = "none"

    def measure(server: ServerProcess, system: str, mode: str, gen: LoadGenerator) -> None:
        servers.append(server)
        try:
            startup = server.start()
            _say(f"{server.name} pid {server.pid} ready at {server.url} in {startup * 1e3:,.0f} ms")
            result = measure_server(server, system, mode, gen, concurrency, seconds)
            loads.append(result)
            failures.extend(f"{system} {mode}: {f}" for f in result.failures)
        finally:
            server.stop()

    try:
        if seconds != args.seconds:
            _say(f"wrk takes whole seconds: measuring {seconds} s")
        _say(f"temp dir {root}; servers bind 127.0.0.1 only")
        fsync = measure_fsync_rate(root)
        _say(
            f"machine fsync rate: {fsync.per_second:,.0f}/s ({fsync.mean_us:,.0f} µs per {MESSAGE_BYTES} B write + fdatasync)"
        )

        gen = LoadGenerator(getattr(args, "generator", "auto"), root)
        generator = gen.name = gen.name.replace("<concurrency>", str(concurrency))
        _say(f"load generator: {generator}")
        if gen.is_python:
            why = "--generator python" if getattr(args, "generator", "auto") == "python" else "wrk unavailable"
            notes.append(
                f"{why}: the Python load generator competes with the servers for the same "
                f"{os.cpu_count()} cores, so all figures are lower than a dedicated client would show"
            )
        else:
            notes.append(f"wrk shares the machine's {os.cpu_count()} cores with the servers (loopback)")
        notes.append(
            "onceflow: every append is fsync'd (fdatasync) before its acknowledgement: --fsync always, "
            "group commit (one fdatasync per group of concurrently staged appends)"
        )
        notes.append(
            f"each server gets a {WARMUP_SECONDS} s warm-up that is not measured; "
            "afterwards the stream is read back and checked against the acknowledged appends"
        )

        measure(onceflow_server(root / "onceflow-data"), "onceflow", "file", gen)

        found = find_reference(args.skip_reference, notes)
        if found is not None:
            script, version = found
            notes.append(
                f"reference: {NODE_PACKAGE} {version} (Node {_node_version()}), DurableStreamTestServer; "
                "file mode = dataDir set, memory mode = no dataDir"
            )
            ref_data = root / "reference-data"
            ref_data.mkdir()
            measure(reference_server(script, ref_data), "reference", "file", gen)
            measure(reference_server(script, None), "reference", "memory", gen)

        if args.recovery_gib > 0:
            recovery = measure_recovery(root, args.recovery_gib)
            failures.extend(f"recovery: {f}" for f in recovery.failures)
        else:
            _say("recovery measurement skipped (--recovery-gib 0)")
    except BenchFailure as exc:
        failures.append(str(exc))
        print(f"\n[bench] FAILED: {exc}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        print("\n[bench] interrupted; stopping servers and removing the temp dir", file=sys.stderr, flush=True)
        return 130
    finally:
        for server in servers:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)

    text, doc = render(loads, fsync, recovery, generator, notes, concurrency)
    return report(text, doc, failures, args.out)


def report(text: str, doc: dict[str, Any], failures: list[str], out: str | None) -> int:
    """Print a bench's report, list failed checks, write the JSON if asked; the exit code."""
    doc["failures"] = failures
    print(text, flush=True)
    if failures:
        print("\nFAILED CHECKS:\n" + "\n".join(f"  - {f}" for f in failures), file=sys.stderr, flush=True)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2) + "\n")
        _say(f"results written to {path}")
    return 1 if failures else 0


def _node_version() -> str:
    node = shutil.which("node")
    if node is None:
        return "?"
    proc = subprocess.run([node, "--version"], capture_output=True, text=True, check=False)
    return proc.stdout.strip() or "?"
