"""A lean HTTP/1.1 server (asyncio + httptools) that runs an ASGI ``http`` application.

Why not uvicorn: with one message per request, per-request Python work in the HTTP layer is what
limits a single stream's throughput (fsync is shared by group commit). This server does only what
onceflow needs: keep-alive, pipelined requests answered in order, request bodies with Content-Length
or chunked encoding (buffered whole, capped at the app's limit), fixed-length and streamed (chunked)
responses with write flow control, HEAD, and disconnect notification for live reads. The app is the
same ASGI app that runs under uvicorn and in the tests.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import unquote_to_bytes

import httptools

__all__ = ["HttpServerProtocol", "start_server"]

log = logging.getLogger("onceflow.http")

ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}


# Rendered "name: value\r\n" lines of headers the app sends again and again (CORS, security).
# Bounded: varying headers (offsets, ETags) stop being cached once it is full.
_LINES: dict[tuple[bytes, bytes], bytes] = {}
_LINES_MAX = 512


def _header_line(pair: tuple[bytes, bytes]) -> bytes:
    line = _LINES.get(pair)
    if line is None:
        line = b"%s: %s\r\n" % pair
        if len(_LINES) < _LINES_MAX:
            _LINES[pair] = line
    return line


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
        _STATUS_LINES[status] = line
    return line


class _Request:
    __slots__ = ("body", "headers", "keep_alive", "method", "overflow", "path", "query", "raw_path")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.method = b""
        self.path = ""
        self.raw_path = b""
        self.query = b""
        self.keep_alive = True
        self.overflow = False


class HttpServerProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, app: ASGIApp, max_body: int, server_addr: tuple[str, int]) -> None:
        self.app = app
        self.max_body = max_body
        self.server_addr = server_addr
        self.loop = asyncio.get_event_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: tuple[str, int] | None = None
        self.url = b""
        self.current: _Request | None = None
        self.body_size = 0
        self.queue: deque[_Request] = deque()
        self.busy = False
        self.task: asyncio.Task[None] | None = None  # the request cycle running now, if any
        self.closed = False
        self.disconnected: asyncio.Future[None] = self.loop.create_future()
        self.writable: asyncio.Future[None] | None = None

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        peer = transport.get_extra_info("peername")
        self.client = (peer[0], peer[1]) if isinstance(peer, tuple) else None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.disconnected.done():
            self.disconnected.set_result(None)
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, b"protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._reject(400, f"malformed HTTP request: {exc}".encode())

    def pause_writing(self) -> None:
        if self.writable is None or self.writable.done():
            self.writable = self.loop.create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        self.url = b""
        self.current = _Request()
        self.body_size = 0

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.current is not None
        self.current.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        req = self.current
        assert req is not None and self.transport is not None
        req.method = self.parser.get_method()
        req.keep_alive = self.parser.should_keep_alive()
        parsed = httptools.parse_url(self.url)
        req.raw_path = parsed.path
        req.query = parsed.query or b""
        try:
            req.path = unquote_to_bytes(parsed.path).decode("utf-8", "surrogateescape")
        except ValueError:
            req.path = parsed.path.decode("latin-1")
        for name, value in req.headers:
            if name == b"expect" and value.lower() == b"100-continue":
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        req = self.current
        assert req is not None
        if req.overflow:
            return
        self.body_size += len(body)
        if self.body_size > self.max_body:
            # keep exactly limit + 1 bytes: enough for the app to answer 413, no more in memory
            keep = len(body) - (self.body_size - self.max_body - 1)
            req.body.append(body[:keep])
            req.overflow = True
            return
        req.body.append(body)

    def on_message_complete(self) -> None:
        req = self.current
        assert req is not None
        self.current = None
        if self.busy:
            self.queue.append(req)
            if len(self.queue) > 32 and self.transport is not None:
                self.transport.pause_reading()
            return
        self.busy = True
        self.task = self.loop.create_task(self._run(req))

    # -- request cycle

    def _reject(self, status: int, message: bytes) -> None:
        if self.transport is None or self.closed:
            return
        body = b'{"error":{"code":"bad_request","message":"%s"}}' % message.replace(b'"', b"'")
        self.transport.write(
            _status_line(status)
            + b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            + body
        )
        self.transport.close()
        self.closed = True

    async def _run(self, req: _Request) -> None:
        while True:
            await self._cycle(req)
            if self.closed or not self.queue:
                break
            req = self.queue.popleft()
            if self.transport is not None and len(self.queue) <= 8:
                self.transport.resume_reading()
        self.busy = False

    async def _cycle(self, req: _Request) -> None:
        transport = self.transport
        assert transport is not None
        method = req.method.decode("ascii")
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": req.path,
            "raw_path": req.raw_path,
            "query_string": req.query,
            "root_path": "",
            "headers": req.headers,
            "client": self.client,
            "server": self.server_addr,
        }
        body = b"".join(req.body) if len(req.body) != 1 else req.body[0]
        delivered = False
        started = False
        chunked = False
        finished = False
        head = method == "HEAD"
        keep_alive = req.keep_alive

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await self.disconnected
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            nonlocal started, chunked, finished
            if self.closed or finished:
                return
            if not started:
                started = True
                status = message["status"]
                out = [_status_line(status)]
                has_length = False
                for pair in message.get("headers", ()):
                    if pair[0] == b"content-length":
                        has_length = True
                    out.append(_header_line(pair))
                if not has_length and status not in (204, 304) and not head:
                    chunked = True
                    out.append(b"transfer-encoding: chunked\r\n")
                if not keep_alive:
                    out.append(b"connection: close\r\n")
                out.append(b"\r\n")
                transport.write(b"".join(out))
                return
            data = message.get("body", b"")
            more = message.get("more_body", False)
            if data and not head:
                transport.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            if not more:
                finished = True
                if chunked and not head:
                    transport.write(b"0\r\n\r\n")
            if self.writable is not None and not self.writable.done():
                await self.writable

        try:
            await self.app(scope, receive, send)
        except Exception:
            log.exception("application error for %s %s", method, req.path)
            if not started:
                await send({"type": "http.response.start", "status": 500, "headers": [(b"content-length", b"0")]})
                finished = True
            else:
                keep_alive = False
        if not finished and not self.closed:
            keep_alive = False  # the response is incomplete; the connection cannot be reused
        if not keep_alive and not self.closed:
            transport.close()
            self.closed = True


async def start_server(
    app: ASGIApp, host: str, port: int, max_body: int, connections: set[HttpServerProtocol] | None = None
) -> asyncio.Server:
    """Listen on ``host:port``; ``connections``, if given, tracks the open connections."""
    loop = asyncio.get_running_loop()
    addr: list[tuple[str, int]] = [(host, port)]

    def factory() -> HttpServerProtocol:
        proto = HttpServerProtocol(app, max_body, addr[0])
        if connections is not None:
            connections.add(proto)
            proto.disconnected.add_done_callback(lambda _: connections.discard(proto))
        return proto

    server = await loop.create_server(factory, host, port, backlog=2048, reuse_address=True)
    bound = server.sockets[0].getsockname()
    addr[0] = (host, int(bound[1]))
    return server
