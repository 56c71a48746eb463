"""Running the server: the ready line, signals, and a clean shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import resource
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

from ..core.broker import Broker
from ..core.limits import StateLimits
from ..core.subscriptions import WebhookTargets
from ..storage.fs import FileSystem, OsFileSystem, raise_open_file_limit
from ..storage.log import FsyncPolicy
from .app import App, AppConfig
from .guard import Guard, GuardConfig
from .http import HttpLimits, HttpServerProtocol, start_server
from .instrument import Instrumented

__all__ = ["build_handler", "serve", "shut_down"]

log = logging.getLogger("onceflow")


async def serve(
    *,
    data: Path,
    host: str = "127.0.0.1",
    port: int = 4437,
    fsync: FsyncPolicy = "always",
    long_poll_timeout: float = 20.0,
    max_body_bytes: int = 64 << 20,
    compress_min_bytes: int | None = 1 << 10,
    http: Literal["native", "uvicorn"] = "native",
    txn_timeout: float = 60.0,
    max_streams: int = 100_000,
    state_limits: StateLimits | None = None,
    max_open_files: int | None = None,
    log_level: str = "warning",
    guard: GuardConfig | None = None,
    limits: HttpLimits | None = None,
    webhook_targets: WebhookTargets = "public",
    retention_seconds: int | None = None,
    retention_bytes: int | None = None,
    segment_bytes: int = 64 << 20,
    retention_interval: float = 10.0,
    metrics_allow: Sequence[str] = (),
    store: str | None = None,
    advertise: str | None = None,
    lease_seconds: float = 3.0,
    forward: bool = True,
    forward_buffer: int | None = None,
    store_timeouts: tuple[float, float] = (2.0, 5.0),
    store_cold_reads: int = 4,
) -> None:
    """Recover the data directory, serve until SIGTERM / SIGINT, then finish appends and close.

    ``store``: a PostgreSQL URL instead of ``data``: the streams live in that database, and of the
    servers sharing it the one holding its lease serves (server/leader.py, docs/ha.md);
    ``advertise`` is this server's URL as the others tell clients, ``lease_seconds`` the lease's term;
    ``forward``: a follower passes requests on to the leader (else it answers 503 ``not_leader``),
    holding at most ``forward_buffer`` body bytes at once to do so (by default ``max_body_bytes``);
    ``store_timeouts``: how long the event loop waits for one read and one write of the database;
    ``store_cold_reads``: how many clients' reads wait for the database at once.
    ``compress_min_bytes``: the smallest read answer compressed for a client that accepts a coding
    (None: none is; docs/protocol.md, "Compression").

    Shutdown: stop accepting, end live reads (long-poll / SSE), let in-flight appends become durable
    (up to a few seconds), close connections, then flush and snapshot every stream.

    ``limits`` are the HTTP layer's timeouts and caps (server/http.py); uvicorn applies only
    ``idle_timeout`` and ``max_connections`` of them (docs/security.md, "HTTP layer").
    ``metrics_allow``: name prefixes whose streams, groups and sinks get a label of their own in
    ``/metrics`` (docs/operations.md). ``state_limits``: how many groups, transactional ids, sinks
    and subscriptions the server holds at most (docs/security.md, "Limits").
    """
    tune_gc()
    soft, _hard = raise_open_file_limit()
    if max_open_files is None:
        max_open_files = max(64, min(4096, soft // 4)) if soft > 0 else 1024
    limits = fit_fd_limit(limits or HttpLimits(), soft, max_open_files)
    config = AppConfig(
        long_poll_timeout=long_poll_timeout,
        max_body_bytes=max_body_bytes,
        compress_min_bytes=compress_min_bytes,
        webhook_targets=webhook_targets,
        metrics_allow=tuple(metrics_allow),
    )

    def make_broker(fs: FileSystem, root: Path) -> Broker:
        return Broker(
            root,
            fsync=fsync,
            txn_timeout=txn_timeout,
            max_streams=max_streams,
            state_limits=state_limits,
            segment_bytes=segment_bytes,
            retention_seconds=retention_seconds,
            retention_bytes=retention_bytes,
            retention_interval=retention_interval,
            fs=fs,
        )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if store is not None:
        from .leader import serve_store  # imports psycopg: only for the PostgreSQL store

        await serve_store(
            store,
            host=host,
            port=port,
            limits=limits,
            make_broker=make_broker,
            build=lambda broker: build_handler(broker, config, guard),
            stop=stop,
            advertise=advertise,
            lease_seconds=lease_seconds,
            forward=forward,
            max_body=max_body_bytes,
            long_poll_timeout=long_poll_timeout,
            store_timeouts=store_timeouts,
            cold_reads=store_cold_reads,
            guard=guard,
            forward_buffer=forward_buffer,
        )
        return
    broker = make_broker(OsFileSystem(max_open_files), data)
    broker.open()
    app, handler = build_handler(broker, config, guard)
    if http == "uvicorn":
        await _serve_uvicorn(handler, broker, host, port, log_level, stop, limits)
        return
    await broker.start()  # finishes transactions decided before a crash, before anyone connects
    app.subscriptions.start()  # resumes wakes, leases and webhook retries kept on disk
    connections: set[HttpServerProtocol] = set()
    server = await start_server(handler, host, port, limits, connections, app.metrics.http_refusals)
    bound = server.sockets[0].getsockname()
    print(f"onceflow listening on http://{host}:{bound[1]}", flush=True)
    await stop.wait()
    await shut_down(server, connections, app, broker)


GC_THRESHOLDS = (10_000, 20, 20)


def tune_gc() -> None:
    """Make the cyclic garbage collector cheaper for a server: freeze what was loaded at start (it
    stays for the process's life, so full collections need not walk it again) and collect the young
    generation every 10,000 net new objects instead of 700. A request's objects are freed by their
    reference counts; at the default thresholds collections still took ~10 % of the server's CPU
    under single-message appends (gc.callbacks: 0.89 s of 8.8 s), at these ~0.1 %."""
    gc.set_threshold(*GC_THRESHOLDS)
    gc.freeze()


def build_handler(broker: Broker, config: AppConfig, guard: GuardConfig | None) -> tuple[App, Instrumented]:
    """The app on ``broker`` and the handler that serves it: the guard (tokens and limits,
    server/guard.py) inside the instrumentation (outermost: /metrics counts the guard's refusals too)."""
    app = App(broker, config)
    guarded: App | Guard = app if guard is None else Guard(app, broker, guard)
    return app, Instrumented(guarded, app.metrics)


async def shut_down(server: asyncio.Server, connections: set[HttpServerProtocol], app: App, broker: Broker) -> None:
    """Stop accepting, end live reads, let in-flight appends become durable (a few seconds at
    most), close the connections, then flush and close every stream."""
    server.close()
    broker.begin_shutdown()
    running = [c.task for c in connections if c.busy and c.task is not None]
    if running:
        await asyncio.wait(running, timeout=3.0)
    for c in list(connections):
        if c.transport is not None:
            c.transport.close()
    await app.subscriptions.close()
    await broker.close()


FD_RESERVE = 64  # descriptors for everything but connections and log files: the listener, snapshots, logging


def fit_fd_limit(limits: HttpLimits, soft: int, files: int) -> HttpLimits:
    """Lower the connection cap to fit the open-files limit ``soft`` (already raised to the hard
    limit by :func:`raise_open_file_limit`) beside ``files`` log files (``--max-open-files``).

    Without this a cap above the process's descriptor limit would not hold: accept() would fail
    with EMFILE first, and so would opening segment files.
    """
    if soft < 0 or soft == resource.RLIM_INFINITY:
        return limits
    room = soft - files - FD_RESERVE
    if room >= limits.max_connections:
        return limits
    cap = max(1, room)
    log.warning(
        "open-files limit %d fits %d connections beside %d log files, not --max-connections %d: using %d",
        soft,
        cap,
        files,
        limits.max_connections,
        cap,
    )
    return dataclasses.replace(limits, max_connections=cap)


async def _serve_uvicorn(
    app: Instrumented, broker: Broker, host: str, port: int, log_level: str, stop: asyncio.Event, limits: HttpLimits
) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        # uvicorn re-raises a captured SIGTERM after shutting down; serve() owns the signals instead
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="none",
        http="httptools",
        lifespan="on",
        log_level=log_level,
        access_log=False,
        proxy_headers=False,
        server_header=False,
        date_header=False,
        timeout_graceful_shutdown=2,
        timeout_keep_alive=max(1, round(limits.idle_timeout)),
        limit_concurrency=limits.max_connections,
    )
    server = Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started and not task.done():  # noqa: ASYNC110 - uvicorn signals readiness only by a flag
        await asyncio.sleep(0.01)
    if not server.started:
        await task
        raise SystemExit("the server did not start")
    bound = server.servers[0].sockets[0].getsockname()
    print(f"onceflow listening on http://{host}:{bound[1]} (uvicorn)", flush=True)
    await stop.wait()
    broker.begin_shutdown()
    server.should_exit = True
    await task
