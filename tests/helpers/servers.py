"""The test servers: an in-process broker + ASGI client (``InProcess``, the ``onceflow`` fixture's
value) and a real ``onceflow serve`` subprocess (``ServerProcess``, from :mod:`onceflow.testing`)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig
from onceflow.storage.fs import FileSystem
from onceflow.testing import OnceflowProcess as ServerProcess
from onceflow.testing import free_port

__all__ = ["InProcess", "ServerProcess", "free_port", "served_on"]


@dataclass
class InProcess:
    broker: Broker
    app: App
    client: httpx.AsyncClient
    data: Path
    fs: FileSystem | None = None  # the store's file system; None: the local disk

    def reopen(self) -> Broker:
        """A new broker on the same store (a restart), not yet opened."""
        return Broker(self.data, fs=self.fs)


@contextlib.asynccontextmanager
async def served_on(fs: FileSystem, data: Path, *, crash: bool = False) -> AsyncIterator[httpx.AsyncClient]:
    """A server (broker and app, in-process) on ``fs`` at ``data``: recovery, serving, a clean close
    (or, with ``crash``, none: what it did not sync is lost, as in a kill -9)."""
    broker = Broker(data, fs=fs, txn_timeout=30)
    broker.open()
    await broker.start()
    app = App(broker, AppConfig(long_poll_timeout=0.2))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as client:
        yield client
    await app.subscriptions.close()
    await (broker.crash() if crash else broker.close())
