"""A lean HTTP/1.1 server (asyncio + httptools) that runs an ASGI ``http`` application.

Why not uvicorn: with one message per request, per-request Python work in the HTTP layer is what
limits a single stream's throughput (fsync is shared by group commit). This server does only what
onceflow needs: keep-alive, pipelined requests answered in order, request bodies with Content-Length
or chunked encoding, fixed-length and streamed (chunked) responses with write flow control, HEAD,
and disconnect notification for live reads. To an HTTP/1.0 request a response of unknown length
goes unframed and the connection's close ends it (RFC 9112 6.1, 6.3: a 1.0 client knows no chunked
coding); one of known length keeps a 1.0 connection open only when the client asked for that
(``Connection: keep-alive``), and says so. The app is the same ASGI app that runs under uvicorn and
in the tests. Parsing is llhttp's (through httptools), as in uvicorn.

Connection management (``HttpLimits``; docs/security.md, "HTTP layer"), all on by default:

- A request is handed to the app when its headers are complete, and its body is streamed to the
  app as it arrives. So a declared ``Content-Length`` over the app's limit is answered ``413`` at
  once, and an endless chunked body as soon as it passes the limit. A response that starts before
  its request's body has been read closes the connection (``Connection: close``): the rest of the
  body is read and thrown away for ``linger`` seconds after the response, so that the client sees
  the answer rather than a reset, then the connection is closed.
- ``100 Continue`` is sent only when the app reads a body that has not arrived yet, and only for
  the request whose response is next (a pipelined request waits for its turn), so an interim
  response never lands inside another response and a refused body is never invited.
- Body bytes that the app has not read yet are bounded per connection (``body_buffer``), and so is
  the number of pipelined requests waiting their turn: past either bound the connection stops reading
  until the app catches up (TCP pushes back on the client).
- Timeouts, checked by one sweep per server a few times per shortest timeout: the headers of a
  request must be complete ``header_timeout`` after its first byte (or after the connection opens),
  else ``408`` and close; a keep-alive connection without a request is closed after ``idle_timeout``;
  a body being read must make progress every ``body_timeout`` and average ``min_body_rate`` bytes/s
  once it has taken longer than that, else ``408`` and close (time the server itself is not reading,
  by flow control or while it waits to send ``100 Continue``, does not count); a response whose
  client stops reading is dropped after ``write_timeout``.
- At most ``max_connections`` open connections; one over the cap is answered ``503`` and closed.
- The request line and headers are limited to ``max_header_bytes`` and ``max_headers``: ``431``.

The app's own limits (body size, live-read timeouts) are the app's; this layer never answers for it
except with the statuses above, each with a JSON error body and ``Connection: close``. Each such
answer is counted in ``refusals`` (by status and code), which ``/metrics`` shows.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import sys
import termios
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import unquote_to_bytes

import httptools

__all__ = ["HttpLimits", "HttpServerProtocol", "start_server"]

log = logging.getLogger("onceflow.http")

ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]
]

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}
_MAX_QUEUED = 32  # pipelined requests waiting their turn before the connection stops reading
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_OUTQ: int | None = getattr(termios, "TIOCOUTQ", None) if sys.platform == "linux" else None  # = SIOCOUTQ


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Limits and timeouts of the native server (seconds, bytes). The defaults are safe unconfigured.

    ``onceflow serve`` exposes each as a flag; docs/security.md ("HTTP layer") explains the choices.
    """

    header_timeout: float = 10.0  # first byte of a request (or the connection's opening) -> end of its headers
    idle_timeout: float = 30.0  # a keep-alive connection with no request in progress
    body_timeout: float = 30.0  # longest pause while a request body is read; also the grace before min_body_rate
    min_body_rate: float = 1024.0  # bytes/s a body must average once it has taken body_timeout (0: no minimum)
    write_timeout: float = 60.0  # longest a response may wait for its client to read any of it
    max_connections: int = 1000
    max_header_bytes: int = 32 << 10  # request line + header names and values
    max_headers: int = 100
    body_buffer: int = 1 << 20  # body bytes received and not yet read by the app, per connection
    linger: float = 2.0  # after answering a request whose body was not read: read and discard, then close

    def __post_init__(self) -> None:
        for name in ("header_timeout", "idle_timeout", "body_timeout", "write_timeout", "linger"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.min_body_rate < 0:
            raise ValueError("min_body_rate must not be negative")
        for name in ("max_connections", "max_header_bytes", "max_headers", "body_buffer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")

    @property
    def sweep_interval(self) -> float:
        """How often the timeouts are checked: a quarter of the shortest, within [0.05, 1] s."""
        shortest = min(self.header_timeout, self.idle_timeout, self.body_timeout, self.write_timeout, self.linger)
        return max(0.05, min(1.0, shortest / 4))


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


def _error_response(status: int, code: str, message: str) -> bytes:
    body = b'{"error":{"code":"%s","message":"%s"}}' % (
        code.encode(),
        message.replace('"', "'").encode("utf-8", "replace"),
    )
    return (
        _status_line(status)
        + b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body)
        + body
    )


def _response_head(
    status: int, headers: Iterable[tuple[bytes, bytes]], *, body: bool, http10: bool, keep_alive: bool
) -> tuple[bytes, bool, bool]:
    """The status line and headers of a response, and how its body goes: (head, chunked, keep
    alive). ``body``: a body follows (not a HEAD's, a 204's or a 304's). One of unknown length is
    chunked; to an HTTP/1.0 client, which knows no chunked coding (RFC 9112 6.1), it goes unframed
    and the connection's close ends it (6.3). A 1.0 client keeps the connection only when told."""
    out = [_status_line(status)]
    has_length = False
    for pair in headers:
        if pair[0] == b"content-length":
            has_length = True
        out.append(_header_line(pair))
    chunked = False
    if body and not has_length:
        if http10:
            keep_alive = False
        else:
            chunked = True
            out.append(b"transfer-encoding: chunked\r\n")
    if not keep_alive:
        out.append(b"connection: close\r\n")
    elif http10:
        out.append(b"connection: keep-alive\r\n")
    out.append(b"\r\n")
    return b"".join(out), chunked, keep_alive


class _Refuse(Exception):
    """Raised inside a parser callback to stop parsing and answer with ``status``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class _Stop(Exception):
    """Raised inside a parser callback to stop parsing: the connection is closing."""


class _Request:
    """One request, from its first byte until its response is complete.

    ``body`` holds the chunks received and not yet given to the app; ``complete`` says the parser
    has seen the end of the message. The clock fields are maintained by the sweep, not per byte.
    """

    __slots__ = (
        "body",
        "complete",
        "continued",
        "ended",
        "expect_continue",
        "headers",
        "headers_done",
        "http10",
        "keep_alive",
        "mark_at",
        "mark_bytes",
        "method",
        "path",
        "progress_at",
        "progress_bytes",
        "query",
        "raw_path",
        "received",
        "started",
        "waiter",
    )

    method: bytes  # these six are set when the headers are complete
    path: str
    raw_path: bytes
    query: bytes
    keep_alive: bool
    http10: bool  # an HTTP/1.0 request: no chunked answer, no 100 Continue

    def __init__(self, now: float) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.headers_done = False
        self.complete = False
        self.ended = False  # the app was given more_body=False
        self.expect_continue = False
        self.continued = False  # 100 Continue sent
        self.received = 0  # body bytes received
        self.waiter: asyncio.Future[None] | None = None  # the app waits for more body
        self.started = self.progress_at = self.mark_at = now  # progress_at: last sweep that saw body bytes
        self.progress_bytes = self.mark_bytes = 0  # mark_*: start of the current min_body_rate measurement


class HttpServerProtocol(asyncio.Protocol):
    """One client connection.

    Requests are answered in the order they arrive; at most one runs at a time (``running``), the
    others wait in ``queue`` with their bodies. ``current`` is the request being parsed.
    """

    def __init__(
        self,
        app: ASGIApp,
        limits: HttpLimits,
        server_addr: tuple[str, int],
        *,
        refuse: bool = False,
        refusals: Counter[tuple[int, str]] | None = None,
    ) -> None:
        self.app = app
        self.refusals = refusals  # the answers this layer gives itself, by (status, code)
        self.limits = limits
        self.server_addr = server_addr
        self.refuse = refuse  # over the connection cap: answer 503 and close
        self.loop = asyncio.get_event_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: tuple[str, int] | None = None
        self.url = b""
        self.current: _Request | None = None
        self.running: _Request | None = None
        self.queue: deque[_Request] = deque()
        self.buffered = 0  # body bytes held for the running and queued requests
        self.paused = False  # reading paused by flow control
        self.head_size = 0  # of the request being parsed: URL + header names and values
        self.head_count = 0
        self.head_raw = 0  # bytes received while headers were incomplete (a guard against a header that never ends)
        self.busy = False
        self.task: asyncio.Task[None] | None = None  # the request cycle running now, if any
        self.responding = False  # the running request's response has started
        self.closed = False
        self.fresh = True  # no request received yet
        self.idle_since = self.loop.time()
        self.draining_until: float | None = None  # lingering close: discard input until then
        self.pending: bytes | None = None  # an error answer due after the requests before it; input stopped
        self.halted = refuse  # no more requests are read: closed, closing, over the cap, or an error pending
        self.body_buffer = limits.body_buffer
        self.max_header_bytes = limits.max_header_bytes
        self.max_headers = limits.max_headers
        self.write_blocked_at: float | None = None  # writing paused since (reset while the client reads some)
        self.write_left = 0  # bytes waiting to be sent when the client last read some
        self.disconnected: asyncio.Future[None] = self.loop.create_future()
        self.writable: asyncio.Future[None] | None = None

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        peer = transport.get_extra_info("peername")
        self.client = (peer[0], peer[1]) if isinstance(peer, tuple) else None
        if self.refuse:  # not tracked by the server, so it closes itself
            if self.refusals is not None:
                self.refusals[(503, "too_many_connections")] += 1
            self.transport.write(_error_response(503, "too_many_connections", "too many open connections; retry later"))
            self.draining_until = self.loop.time() + self.limits.linger
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(self.limits.linger, self._close)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = self.halted = True
        if not self.disconnected.done():
            self.disconnected.set_result(None)
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        running = self.running
        if running is not None and running.waiter is not None and not running.waiter.done():
            running.waiter.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.halted:
            return  # closing: what the client still sends is discarded
        cur = self.current
        if cur is None or not cur.headers_done:
            self.head_raw += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # the request was answered as plain HTTP (Upgrade ignored); what follows is another protocol
            self._refuse(400, "bad_request", "protocol upgrades are not supported", quiet=True)
            return
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _Refuse):
                self._refuse(cause.status, cause.code, str(cause))
            elif not isinstance(cause, _Stop):
                self._refuse(400, "bad_request", f"malformed HTTP request: {exc}")
            return
        cur = self.current
        if (cur is None or not cur.headers_done) and self.head_raw > 2 * self.max_header_bytes:
            self._refuse(431, "headers_too_large", f"request headers are larger than {self.max_header_bytes} bytes")
            return
        if self.paused or self.buffered > self.body_buffer or len(self.queue) >= _MAX_QUEUED:
            self._flow()

    def pause_writing(self) -> None:
        if self.writable is None or self.writable.done():
            self.writable = self.loop.create_future()
        self.write_blocked_at = self.loop.time()
        self.write_left = self._unsent()

    def resume_writing(self) -> None:
        self.write_blocked_at = None
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        if self.halted:
            raise _Stop
        self.url = b""
        self.current = _Request(self.loop.time())
        self.head_size = 0
        self.head_count = 0
        self.fresh = False

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.head_size += len(url)
        if self.head_size > self.max_header_bytes:
            raise _Refuse(414, "uri_too_long", f"request line is longer than {self.max_header_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.current is not None
        self.current.headers.append((name.lower(), value))
        self.head_size += len(name) + len(value)
        self.head_count += 1
        if self.head_size > self.max_header_bytes:
            raise _Refuse(431, "headers_too_large", f"request headers are larger than {self.max_header_bytes} bytes")
        if self.head_count > self.max_headers:
            raise _Refuse(431, "too_many_headers", f"more than {self.max_headers} request headers")

    def on_headers_complete(self) -> None:
        req = self.current
        assert req is not None and self.transport is not None
        if self.halted:
            raise _Stop
        self.head_raw = 0
        req.method = self.parser.get_method()
        req.keep_alive = self.parser.should_keep_alive()
        req.http10 = self.parser.get_http_version() == "1.0"
        parsed = httptools.parse_url(self.url)
        req.raw_path = parsed.path
        req.query = parsed.query or b""
        try:
            req.path = unquote_to_bytes(parsed.path).decode("utf-8", "surrogateescape")
        except ValueError:
            req.path = parsed.path.decode("latin-1")
        for name, value in req.headers:
            if name == b"expect" and value.lower() == b"100-continue" and not req.http10:
                req.expect_continue = True
        req.headers_done = True
        if self.busy:
            self.queue.append(req)
            return
        self.busy = True
        self.running = req
        self.task = self.loop.create_task(self._run(req))

    def on_body(self, body: bytes) -> None:
        req = self.current
        assert req is not None
        req.body.append(body)
        req.received += len(body)
        self.buffered += len(body)
        if req.waiter is not None and not req.waiter.done():
            req.waiter.set_result(None)

    def on_message_complete(self) -> None:
        req = self.current
        assert req is not None
        self.current = None
        req.complete = True
        if req.waiter is not None and not req.waiter.done():
            req.waiter.set_result(None)

    # -- flow control, timeouts, refusals

    def _flow(self) -> None:
        """Pause reading while too much is held for the app; resume once it is not."""
        transport = self.transport
        if transport is None or self.closed or self.pending is not None:
            return
        hold = self.buffered > self.body_buffer or len(self.queue) >= _MAX_QUEUED
        if hold and not self.paused:
            self.paused = True
            transport.pause_reading()
        elif not hold and self.paused:
            self.paused = False
            transport.resume_reading()

    def _refuse(self, status: int, code: str, message: str, *, quiet: bool = False) -> None:
        """Answer the request being parsed with an error, in its turn, and close the connection.

        Requests before it are answered first (their responses are well under way or queued): input
        stops, and the error is written when the last of them is done. A request whose body broke
        while the app reads it is answered at once (the app sees a disconnect). ``quiet``: the input
        that cannot be parsed follows complete requests (a protocol upgrade); answer those, then close.
        """
        if self.transport is None or self.closed or self.draining_until is not None or self.pending is not None:
            return
        if self.refusals is not None and not quiet:  # quiet: the requests were answered; nothing refused
            self.refusals[(status, code)] += 1
        cur = self.current
        self.current = None
        if cur is not None and cur.headers_done:
            if cur is self.running:
                self._fail(status, code, message)
                if cur.waiter is not None and not cur.waiter.done():
                    cur.waiter.set_result(None)
                return
            if cur in self.queue:
                self.queue.remove(cur)  # queued, not started: dropped in favour of the error
                self.buffered -= sum(len(c) for c in cur.body)
        if not self.busy:
            self._fail(status, code, message)
            return
        self.pending = b"" if quiet else _error_response(status, code, message)
        self.halted = True
        if not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def _fail(self, status: int, code: str, message: str) -> None:
        """Answer ``status`` (unless a response is under way) and close."""
        if self.transport is None or self.closed or self.draining_until is not None:
            return
        if not self.responding:
            self.transport.write(_error_response(status, code, message))
        self._linger()

    def _linger(self) -> None:
        """Close without losing what was written: stop writing, discard input for a while, then close.

        Closing a socket with unread input makes the kernel send a reset, which can destroy a
        response the client has not read yet; so the write side is shut first and the read side
        drained until the client closes or ``linger`` passes.
        """
        transport = self.transport
        if transport is None or self.closed or self.draining_until is not None:
            return
        self.draining_until = self.loop.time() + self.limits.linger
        self.halted = True
        if self.paused:
            self.paused = False
            transport.resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
        else:
            self._close()

    def _close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = self.halted = True

    def _unsent(self) -> int:
        """Response bytes not yet taken by the client: in the transport, plus (Linux) in the kernel.

        The kernel's share matters: it takes new data only when a third of its (auto-tuned, up to
        megabytes) send buffer is free, so the transport's own buffer alone can stand still for
        seconds while a slow client is reading.
        """
        transport = self.transport
        if transport is None:
            return 0
        left = transport.get_write_buffer_size()
        sock = transport.get_extra_info("socket")
        if _OUTQ is not None and sock is not None:
            try:
                left += int.from_bytes(fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"), sys.byteorder, signed=True)
            except OSError:
                pass
        return left

    def eof_received(self) -> bool | None:
        if self.draining_until is not None:
            self._close()
        return None  # the transport closes itself

    def check(self, now: float) -> None:
        """Enforce the timeouts (called by the server's sweep)."""
        if self.closed or self.transport is None:
            return
        limits = self.limits
        if self.draining_until is not None:
            if now >= self.draining_until:
                self._close()
            return
        if self.write_blocked_at is not None:
            left = self._unsent()
            if left < self.write_left:  # the client read some: a slow reader, not a stalled one
                self.write_left = left
                self.write_blocked_at = now
            elif now - self.write_blocked_at > limits.write_timeout:
                log.info("dropping a connection whose client stopped reading (%s)", self.client)
                self.transport.abort()  # close() would wait for the client to read what is buffered
                self.closed = self.halted = True
                return
        cur = self.current
        if cur is not None and not cur.headers_done:
            if now - cur.started > limits.header_timeout:
                self._refuse(408, "request_timeout", f"request headers not received within {limits.header_timeout:g} s")
            return
        if cur is not None and cur is self.running:
            if self.paused or (cur.expect_continue and not cur.continued):
                cur.progress_at = cur.mark_at = now  # the server is not reading: the client is not to blame
                cur.progress_bytes = cur.mark_bytes = cur.received
                return
            if cur.received != cur.progress_bytes:
                cur.progress_bytes = cur.received
                cur.progress_at = now
            elapsed = now - cur.mark_at
            if now - cur.progress_at > limits.body_timeout or (
                elapsed > limits.body_timeout and cur.received - cur.mark_bytes < limits.min_body_rate * elapsed
            ):
                self._refuse(
                    408,
                    "request_timeout",
                    f"request body too slow: it must keep coming at {limits.min_body_rate:g} bytes/s or more",
                )
            return
        if cur is None and not self.busy:
            wait = limits.header_timeout if self.fresh else limits.idle_timeout
            if now - self.idle_since > wait:
                self._close()

    # -- request cycle

    async def _run(self, req: _Request) -> None:
        while True:
            await self._cycle(req)
            if self.closed or self.draining_until is not None or not self.queue:
                break
            req = self.running = self.queue.popleft()
            if self.paused:
                self._flow()
        self.running = None
        self.busy = False
        self.idle_since = self.loop.time()
        if self.pending is not None and self.transport is not None and not self.closed and self.draining_until is None:
            self.transport.write(self.pending)
            self._linger()

    async def _cycle(self, req: _Request) -> None:
        transport = self.transport
        assert transport is not None
        method = req.method.decode("ascii")
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.0" if req.http10 else "1.1",
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
        started = False
        chunked = False
        finished = False
        head = method == "HEAD"
        keep_alive = req.keep_alive
        self.responding = False

        async def receive() -> dict[str, Any]:
            while True:
                chunks = req.body
                if chunks:
                    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                    req.body = []
                    self.buffered -= len(data)
                    if self.paused:
                        self._flow()
                    req.ended = req.complete
                    return {"type": "http.request", "body": data, "more_body": not req.complete}
                if req.complete and not req.ended:
                    req.ended = True
                    return {"type": "http.request", "body": b"", "more_body": False}
                if req.ended or self.closed or self.draining_until is not None:
                    await self.disconnected
                    return {"type": "http.disconnect"}
                # the body has not all arrived: invite it if the client waits for that, then wait
                if req.expect_continue and not req.continued and not started and self.draining_until is None:
                    req.continued = True
                    transport.write(_CONTINUE)
                if self.paused:
                    self._flow()
                req.waiter = self.loop.create_future()
                await req.waiter
                req.waiter = None

        async def send(message: MutableMapping[str, Any]) -> None:
            nonlocal started, chunked, finished, keep_alive
            if self.closed or finished or self.draining_until is not None:
                return
            if not started:
                status = message["status"]
                if status < 200:
                    return  # interim responses are this layer's (100 Continue) and nobody else's
                started = True
                self.responding = True
                if not req.complete:
                    keep_alive = False  # answered before its body was read: the rest cannot be parsed as a request
                rendered, chunked, keep_alive = _response_head(
                    status,
                    message.get("headers", ()),
                    body=status not in (204, 304) and not head,
                    http10=req.http10,
                    keep_alive=keep_alive,
                )
                transport.write(rendered)
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
        if req.body:  # what the app left unread is dropped with the request
            self.buffered -= sum(len(c) for c in req.body)
            req.body = []
        if not finished and not self.closed:
            keep_alive = False  # the response is incomplete; the connection cannot be reused
        if not keep_alive and not self.closed:
            if req.complete and self.current is None and not self.queue:
                self._close()
            else:
                self._linger()  # input is left unread: the rest of this body or pipelined requests
        self.responding = False


async def start_server(
    app: ASGIApp,
    host: str,
    port: int,
    limits: HttpLimits | None = None,
    connections: set[HttpServerProtocol] | None = None,
    refusals: Counter[tuple[int, str]] | None = None,
) -> asyncio.Server:
    """Listen on ``host:port``; ``connections``, if given, is kept as the set of open connections,
    and ``refusals`` counts the answers this layer gives itself, by (status, code).

    Also starts the sweep that enforces the timeouts of ``limits``; it ends when the server is
    closed and its last connection is gone.
    """
    loop = asyncio.get_running_loop()
    limits = limits or HttpLimits()
    addr: list[tuple[str, int]] = [(host, port)]
    conns: set[HttpServerProtocol] = connections if connections is not None else set()

    def factory() -> HttpServerProtocol:
        if len(conns) >= limits.max_connections:
            return HttpServerProtocol(app, limits, addr[0], refuse=True, refusals=refusals)
        proto = HttpServerProtocol(app, limits, addr[0], refusals=refusals)
        conns.add(proto)
        proto.disconnected.add_done_callback(lambda _: conns.discard(proto))
        return proto

    server = await loop.create_server(factory, host, port, backlog=2048, reuse_address=True)
    bound = server.sockets[0].getsockname()
    addr[0] = (host, int(bound[1]))
    interval = limits.sweep_interval

    def sweep() -> None:
        now = loop.time()
        try:
            for conn in list(conns):
                try:
                    conn.check(now)
                except Exception:  # one broken connection must not stop the timeouts of all others
                    log.exception("checking the timeouts of a connection failed; closing it")
                    conn._close()
        finally:
            if server.is_serving() or conns:
                loop.call_later(interval, sweep)

    loop.call_later(interval, sweep)
    return server
