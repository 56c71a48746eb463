"""The test servers: an in-process broker + ASGI client (``InProcess``, the ``onceflow`` fixture's
value) and a real ``onceflow serve`` subprocess (``ServerProcess``, from :mod:`onceflow.testing`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

from onceflow.core.broker import Broker
from onceflow.server.app import App
from onceflow.testing import OnceflowProcess as ServerProcess
from onceflow.testing import free_port

__all__ = ["InProcess", "ServerProcess", "free_port"]


@dataclass
class InProcess:
    broker: Broker
    app: App
    client: httpx.AsyncClient
    data: Path
