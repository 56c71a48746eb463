"""An SSE read driven straight through an ASGI app, its events awaited one by one."""

from __future__ import annotations

import asyncio
from typing import Any

from helpers.txn import S
from onceflow.server.app import App

WAIT = 30.0  # upper bound for anything a test waits on; never a timing assertion


class SSERead:
    """An SSE read driven straight through the ASGI app, so its events can be awaited one by one."""

    def __init__(self, app: App, name: str, offset: str, query: str = "") -> None:
        self.events: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        self.status = 0
        self._gone = asyncio.Event()
        self._buf = b""
        scope = {
            "type": "http",
            "method": "GET",
            "path": S + name,
            "query_string": f"offset={offset}&live=sse{'&' + query if query else ''}".encode(),
            "headers": [],
            "scheme": "http",
            "server": ("testserver", 80),
        }
        self.task = asyncio.ensure_future(app(scope, self._receive, self._send))

    async def _receive(self) -> dict[str, Any]:
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, msg: Any) -> None:
        if msg["type"] == "http.response.start":
            self.status = msg["status"]
            return
        self._buf += msg.get("body", b"")
        while b"\n\n" in self._buf:
            raw, self._buf = self._buf.split(b"\n\n", 1)
            lines = raw.decode().split("\n")
            kind = lines[0].removeprefix("event: ")
            data = "\n".join(line.removeprefix("data:").removeprefix(" ") for line in lines[1:])
            self.events.put_nowait((kind, data))

    async def next(self, kind: str) -> str:
        while True:
            got, data = await asyncio.wait_for(self.events.get(), WAIT)
            if got == kind:
                return data

    async def close(self) -> None:
        self._gone.set()
        await asyncio.wait_for(self.task, WAIT)
