"""The test servers: an in-process broker + ASGI client (``InProcess``, the ``onceflow`` fixture's
value) and a real ``onceflow serve`` subprocess (``ServerProcess``, from :mod:`onceflow.testing`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

from onceflow.core.broker import Broker
from onceflow.server.app import App
from onceflow.storage.fs import FileSystem
from onceflow.testing import OnceflowProcess as ServerProcess
from onceflow.testing import free_port

__all__ = ["InProcess", "ServerProcess", "free_port"]


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
