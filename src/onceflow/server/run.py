"""Running the app under uvicorn: ready line, signals, clean shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from ..core.broker import Broker
from ..storage.log import FsyncPolicy
from .app import App, AppConfig

__all__ = ["serve"]


class _Server(uvicorn.Server):
    """uvicorn's server without its signal capture: it re-raises SIGTERM after a clean shutdown,
    which would make a graceful stop exit with -15. :func:`serve` handles the signals instead."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve(
    *,
    data: Path,
    host: str = "127.0.0.1",
    port: int = 4437,
    fsync: FsyncPolicy = "always",
    long_poll_timeout: float = 20.0,
    max_body_bytes: int = 64 << 20,
    log_level: str = "warning",
) -> None:
    """Recover the data directory, serve until SIGTERM / SIGINT, then flush and close."""
    broker = Broker(data, fsync=fsync)
    broker.open()
    app = App(broker, AppConfig(long_poll_timeout=long_poll_timeout, max_body_bytes=max_body_bytes))
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="none",
        http="httptools",
        lifespan="on",
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=2,
        timeout_keep_alive=30,
    )
    server = _Server(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    task = asyncio.ensure_future(server.serve())
    while not server.started and not task.done():  # noqa: ASYNC110 - uvicorn signals readiness only by a flag
        await asyncio.sleep(0.01)
    if server.started:
        bound = server.servers[0].sockets[0].getsockname()
        print(f"onceflow listening on http://{host}:{bound[1]}", flush=True)
    await task
    if not server.started:
        logging.getLogger("onceflow").error("the server did not start")
        sys.exit(1)
