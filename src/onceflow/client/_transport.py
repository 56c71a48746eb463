"""A lean HTTP/1.1 transport for httpx's ``AsyncClient``, on asyncio and httptools, for ``http://``.

Why: httpx's own transport (httpcore on anyio, parsing with h11) cost ~0.45 ms of CPU per request
here, two thirds of an append through ``AsyncStream`` (~0.7 ms). That is most of the client's share
of append-to-reader latency and of a producer's cost at small batches. This transport does only what
onceflow's client needs: a pool of keep-alive connections per origin, one request at a time on each,
the request written in one ``write``, the response parsed by llhttp (httptools, the server's parser
too) and its body streamed to httpx as it arrives (long-polls and SSE), with flow control.

httpx keeps everything above the transport: URLs, headers, timeouts, redirects, auth, cookies,
decoding. Its exception classes are kept too, with the meaning the producers rely on: a
``ConnectError`` or ``ConnectTimeout`` only when nothing was sent, a ``ReadError``,
``RemoteProtocolError`` or ``ReadTimeout`` once a request may have reached the server.

Not here (:func:`onceflow.client.lowlevel.async_http_client` keeps httpx's transport for them):
``https://`` and proxies. A response to ``HEAD`` closes its connection.
"""

from __future__ import annotations

import asyncio
import select
import time
from collections import deque
from collections.abc import AsyncIterator

import httptools
import httpx

__all__ = ["LeanAsyncTransport"]

_BUFFER = 1 << 20  # response bytes held before the connection stops reading
_poll = getattr(select, "poll", None)  # select.select is limited to fds below FD_SETSIZE; poll is not


class _Connection(asyncio.Protocol):
    """One connection: its response parser, the body received and not yet taken, one waiter."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.sending: asyncio.Future[None] | None = None  # while more is buffered to send than asyncio's mark
        self.idle_since = 0.0
        self.reset()

    def reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = httpx.RemoteProtocolError(f"malformed HTTP response: {exc}")
            self._close()
        if self.buffered > _BUFFER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool | None:
        return None  # the transport closes itself

    def pause_writing(self) -> None:
        self.sending = self.loop.create_future()

    def resume_writing(self) -> None:
        sending, self.sending = self.sending, None
        if sending is not None and not sending.done():
            sending.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.resume_writing()
        if (
            exc is None  # closed, not reset: a reset cuts such a body off
            and self.head_done
            and not self.complete
            and not any(name.lower() in (b"content-length", b"transfer-encoding") for name, _ in self.headers)
        ):
            self.complete = True  # a body that ends with the connection (HTTP/1.0 style)
        self._wake()

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:  # a second response where one was asked for: stop at the first
            raise httpx.RemoteProtocolError("the server sent more than the response")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim response (100 Continue): its message ends at once
            self.headers = []
            return
        self.status = status
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        if self.head_done:
            self.complete = True
            self.keep_alive = self.parser.should_keep_alive()

    # -- waiting

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def sent(self, timeout: float | None) -> None:
        """Until what was written is (nearly) all handed to the kernel: a body's upload is not the
        server's silence (the read timeout starts after it); ``httpx.WriteTimeout`` when the server
        takes nothing for ``timeout`` seconds (per stall, as httpx's own transport counts it)."""
        while (sending := self.sending) is not None and not self.closed:
            timer = None if timeout is None else self.loop.call_later(timeout, _write_time_out, sending)
            try:
                await sending
            finally:
                if timer is not None:
                    timer.cancel()

    async def wait(self, timeout: float | None) -> None:
        """Until something arrives (or the connection ends); ``httpx.ReadTimeout`` after ``timeout``."""
        waiter = self.waiter = self.loop.create_future()
        timer = None if timeout is None else self.loop.call_later(timeout, _time_out, waiter)
        try:
            await waiter
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()

    def take(self) -> bytes:
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data

    def readable(self) -> bool:
        """Whether the socket holds something the event loop has not seen yet: on an idle
        connection, the server's close (or bytes no request asked for), so it is not to be used."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return True
        if _poll is None:
            return bool(select.select([sock], [], [], 0)[0])
        poller = _poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))

    def broken(self) -> Exception:
        if self.error is not None:
            return self.error
        if not self.head_done:
            return httpx.RemoteProtocolError("the server closed the connection without sending a response")
        return httpx.ReadError("the server closed the connection before the end of the response")

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(httpx.ReadTimeout("timed out waiting for the server's response"))


def _write_time_out(sending: asyncio.Future[None]) -> None:
    if not sending.done():
        sending.set_exception(httpx.WriteTimeout("timed out sending the request to the server"))


def _pool_time_out(slot: asyncio.Future[None]) -> None:
    if not slot.done():
        slot.set_exception(httpx.PoolTimeout("timed out waiting for a connection from the pool"))


class _Body(httpx.AsyncByteStream):
    """A response's body as it arrives; closing it returns a finished connection to the pool."""

    def __init__(
        self, pool: LeanAsyncTransport, key: tuple[str, int], conn: _Connection, timeout: float | None
    ) -> None:
        self.pool, self.key, self.conn, self.timeout = pool, key, conn, timeout
        self.done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self.conn
        while True:
            if conn.chunks:
                yield conn.take()
            elif conn.complete:
                return
            elif conn.closed or conn.error is not None:
                raise conn.broken()
            else:
                try:
                    await conn.wait(self.timeout)
                except BaseException:
                    conn.abort()
                    raise

    async def aclose(self) -> None:
        if self.done:
            return
        self.done = True
        self.pool._release(self.key, self.conn)


class LeanAsyncTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over asyncio for ``http://`` URLs (see the module's text). ``limits`` as httpx's:
    at most ``max_connections`` open per transport (more wait, up to the pool timeout), at most
    ``max_keepalive_connections`` idle, each for ``keepalive_expiry`` seconds."""

    def __init__(self, limits: httpx.Limits | None = None) -> None:
        limits = limits or httpx.Limits(max_connections=100, max_keepalive_connections=20)
        self.max_connections = limits.max_connections if limits.max_connections is not None else 1 << 30
        self.max_idle = limits.max_keepalive_connections if limits.max_keepalive_connections is not None else 1 << 30
        self.expiry = limits.keepalive_expiry if limits.keepalive_expiry is not None else 5.0
        self.idle: dict[tuple[str, int], deque[_Connection]] = {}
        self.idle_count = 0
        self.open = 0
        self.queue: deque[asyncio.Future[None]] = deque()  # requests waiting for a connection slot
        self.closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"the lean transport speaks plain http, not {url.scheme!r}")
        key = (url.host, url.port or 80)
        timeouts = request.extensions.get("timeout", {})
        lines = [b"%s %s HTTP/1.1\r\n" % (request.method.encode("ascii"), url.raw_path)]
        lines.extend(b"%s: %s\r\n" % pair for pair in request.headers.raw)
        lines.append(b"\r\n")
        head = b"".join(lines)
        if head.count(b"\n") != len(lines) or head.count(b"\r") != len(lines):
            # httpx leaves header values unchecked (h11 checks them in its own transport)
            raise httpx.LocalProtocolError("a line break in a header name or value (nothing was sent)")
        conn = await self._acquire(key, timeouts.get("pool"), timeouts.get("connect"))
        try:
            try:
                body = request.content
            except httpx.RequestNotRead:
                body = None
            assert conn.transport is not None
            chunked = (
                "transfer-encoding" in request.headers and request.headers["transfer-encoding"].lower() == "chunked"
            )
            if body is not None and chunked:  # a streamed body read before (an auth flow, a retry)
                body = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
            write_timeout = timeouts.get("write")
            if body is not None:
                conn.transport.write(head + body)
            else:  # a streamed body: httpx has set Content-Length or Transfer-Encoding: chunked
                conn.transport.write(head)
                assert isinstance(request.stream, httpx.AsyncByteStream)
                async for chunk in request.stream:
                    if chunk:
                        conn.transport.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)
                        await conn.sent(write_timeout)  # take no more of the stream than the link does
                if chunked:
                    conn.transport.write(b"0\r\n\r\n")
            await conn.sent(write_timeout)
            read_timeout = timeouts.get("read")
            while not conn.head_done:
                if conn.closed or conn.error is not None:
                    raise conn.broken()
                await conn.wait(read_timeout)
        except BaseException:
            conn.abort()
            self._release(key, conn)
            raise
        if request.method == "HEAD":
            conn.complete, conn.keep_alive = True, False  # its body never comes; the parser would wait for it
        return httpx.Response(
            conn.status,
            headers=conn.headers,
            stream=_Body(self, key, conn, read_timeout),
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def _acquire(
        self, key: tuple[str, int], pool_timeout: float | None, connect_timeout: float | None
    ) -> _Connection:
        idle = self.idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            self.idle_count -= 1
            if (
                not conn.closed
                and not conn.head_done
                and not conn.chunks
                and now - conn.idle_since < self.expiry
                and not conn.readable()
            ):
                return conn  # (an idle connection that received anything, a close too, is not reused)
            self.open -= 1
            conn.abort()
        loop = asyncio.get_running_loop()
        if self.open >= self.max_connections and self.idle_count:
            self._close_oldest_idle()  # another server's (ours were taken above): make room
        if self.open >= self.max_connections:
            slot: asyncio.Future[None] = loop.create_future()
            self.queue.append(slot)
            timer = None if pool_timeout is None else loop.call_later(pool_timeout, _pool_time_out, slot)
            try:
                await slot
            except BaseException:
                if slot.done() and not slot.cancelled() and slot.exception() is None:
                    self._wake_one()  # woken, then cancelled: the free connection goes to the next
                raise
            finally:
                if timer is not None:
                    timer.cancel()
                if slot in self.queue:
                    self.queue.remove(slot)
            return await self._acquire(key, pool_timeout, connect_timeout)
        self.open += 1
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(loop), key[0], key[1]), connect_timeout
            )
        except TimeoutError:
            self._gone()
            raise httpx.ConnectTimeout(f"timed out connecting to {key[0]}:{key[1]}") from None
        except OSError as exc:
            self._gone()
            raise httpx.ConnectError(f"could not connect to {key[0]}:{key[1]}: {exc}") from None
        except BaseException:
            self._gone()
            raise
        return conn

    def _close_oldest_idle(self) -> None:
        """Close the connection idle the longest, whichever server it is to (one pool serves every
        server of a failover client: idle connections to one must not keep the others out)."""
        oldest: deque[_Connection] | None = None
        for idle in self.idle.values():
            if idle and (oldest is None or idle[0].idle_since < oldest[0].idle_since):
                oldest = idle
        if oldest is not None:
            oldest.popleft().abort()
            self.idle_count -= 1
            self.open -= 1

    def _release(self, key: tuple[str, int], conn: _Connection) -> None:
        """Back to the pool when its response was read to the end and may be followed by another."""
        if conn.complete and conn.keep_alive and not conn.closed and conn.error is None and not conn.chunks:
            if not self.closed and self.idle_count < self.max_idle:
                conn.reset()
                conn.idle_since = time.monotonic()
                self.idle.setdefault(key, deque()).append(conn)
                self.idle_count += 1
                self._wake_one()
                return
        conn.abort()
        self._gone()

    def _gone(self) -> None:
        self.open -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self.queue:
            slot = self.queue.popleft()
            if not slot.done():
                slot.set_result(None)
                return

    async def aclose(self) -> None:
        self.closed = True
        for idle in self.idle.values():
            for conn in idle:
                conn.abort()
                self.open -= 1
        self.idle.clear()
        self.idle_count = 0
