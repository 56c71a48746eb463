"""The native HTTP/1.1 server: framing, pipelining, limits, timeouts and live-read disconnects.

Timeouts are configured small here (0.5 s) and every wait has a generous upper bound (wirekit.WAIT,
10 s): a test asserts that the server *did* close or answer within the bound, never how fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.servers import ServerProcess
from helpers.wirekit import WAIT, closed_within, connect, read_response
from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig
from onceflow.server.http import HttpLimits, HttpServerProtocol, start_server

pytestmark = pytest.mark.anyio


@dataclass
class Live:
    broker: Broker
    port: int
    connections: set[HttpServerProtocol] = field(default_factory=set)  # the server's side
    clients: list[asyncio.StreamWriter] = field(default_factory=list)  # closed when the test ends

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await connect(self.port)
        self.clients.append(writer)
        return reader, writer


Serve = Callable[..., AbstractAsyncContextManager[Live]]


@pytest.fixture
def serve(tmp_path: Path) -> Serve:
    """``async with serve(max_body=..., long_poll=..., **limits) as live``: a native server on a fresh broker."""

    @contextlib.asynccontextmanager
    async def running(
        *, max_body: int = 1024, long_poll: float = 5.0, sse_max: float = 60.0, **limits: Any
    ) -> AsyncIterator[Live]:
        broker = Broker(tmp_path / f"data{len(list(tmp_path.iterdir()))}")
        broker.open()
        app = App(broker, AppConfig(long_poll_timeout=long_poll, max_body_bytes=max_body, sse_max_seconds=sse_max))
        connections: set[HttpServerProtocol] = set()
        server = await start_server(app, "127.0.0.1", 0, HttpLimits(**limits), connections)
        live = Live(broker, server.sockets[0].getsockname()[1], connections)
        try:
            yield live
        finally:
            for w in live.clients:
                w.close()
                with contextlib.suppress(ConnectionError):
                    await w.wait_closed()
            server.close()
            for c in list(connections):
                if c.transport is not None:
                    c.transport.close()
            broker.begin_shutdown()
            await broker.close()

    return running


@pytest.fixture
async def live(serve: Serve) -> AsyncIterator[Live]:
    async with serve() as srv:
        yield srv


async def exchange(port: int, raw: bytes, *, until: int = 1) -> list[tuple[int, dict[str, str], bytes]]:
    """Send raw bytes, read ``until`` responses (fixed-length or 204/304 bodies)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        out = []
        for _ in range(until):
            status_line = await reader.readline()
            if not status_line:
                break
            status = int(status_line.split()[1])
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                k, v = line.decode().split(":", 1)
                headers[k.strip().lower()] = v.strip()
            length = int(headers.get("content-length", "0"))
            body = await reader.readexactly(length) if length else b""
            out.append((status, headers, body))
        return out
    finally:
        writer.close()


async def test_pipelined_requests_are_answered_in_order(live: Live) -> None:
    raw = (
        b"PUT /v1/stream/p HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 0\r\n\r\n"
        b"POST /v1/stream/p HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello"
        b"POST /v1/stream/p HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 6\r\n\r\n world"
        b"GET /v1/stream/p?offset=-1 HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    responses = await exchange(live.port, raw, until=4)
    assert [r[0] for r in responses] == [201, 204, 204, 200]
    assert responses[3][2] == b"hello world"


async def test_chunked_request_body_is_appended(live: Live) -> None:
    raw = (
        b"PUT /v1/stream/c HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 0\r\n\r\n"
        b"POST /v1/stream/c HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'4\r\n[{"a\r\n5\r\n":1}]\r\n0\r\n\r\n'
        b"GET /v1/stream/c?offset=-1 HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    responses = await exchange(live.port, raw, until=3)
    assert [r[0] for r in responses] == [201, 204, 200]
    assert responses[2][2] == b'[{"a":1}]'


async def test_chunked_body_over_the_limit_is_413_and_not_stored(live: Live) -> None:
    chunk = b"x" * 600
    raw = (
        b"PUT /v1/stream/big HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 0\r\n\r\n"
        b"POST /v1/stream/big HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%s\r\n"
        % (len(chunk), chunk)
        * 2
        + b"0\r\n\r\n"
        b"GET /v1/stream/big?offset=-1 HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    responses = await exchange(live.port, raw, until=3)
    assert [r[0] for r in responses] == [201, 413, 200]
    assert responses[2][2] == b""


async def test_malformed_http_gets_400_and_the_server_keeps_serving(live: Live) -> None:
    responses = await exchange(live.port, b"GARBAGE\x00\x01 / HTTP/9\r\n\r\n")
    assert responses[0][0] == 400
    assert responses[0][1].get("connection") == "close"
    ok = await exchange(live.port, b"GET /v1/stream/none?offset=-1 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert ok[0][0] == 404


async def test_an_upgrade_request_is_answered_as_plain_http_then_closed(live: Live) -> None:
    reader, writer = await live.connect()
    writer.write(
        b"GET /v1/stream/none HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n\x81\x85 not HTTP"
    )
    r = await read_response(reader)
    assert r is not None and r.status == 404  # Upgrade ignored (RFC 9110 7.8)
    assert await closed_within(reader) == b""  # and no second response for the bytes that followed


async def test_a_request_target_that_is_not_a_path_gets_400(live: Live) -> None:
    tunnel = b"CONNECT x:443 HTTP/1.1\r\nHost: x\r\n\r\n"
    for raw, expected in ((tunnel, [400]), (b"GET /v1/stream/none HTTP/1.1\r\nHost: x\r\n\r\n" + tunnel, [404, 400])):
        reader, writer = await live.connect()
        writer.write(raw)
        statuses = []
        while (r := await read_response(reader)) is not None:
            statuses.append(r.status)
        assert statuses == expected  # the 400 in its turn, after the answer to the request before it
    ok = await exchange(live.port, b"GET /v1/stream/none?offset=-1 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert ok[0][0] == 404


async def test_expect_100_continue(live: Live) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
    try:
        writer.write(
            b"PUT /v1/stream/e HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"
        )
        await writer.drain()
        assert (await reader.readline()).startswith(b"HTTP/1.1 100")
        assert await reader.readline() == b"\r\n"
        writer.write(b"hi")
        assert (await reader.readline()).startswith(b"HTTP/1.1 201")
    finally:
        writer.close()


async def test_http10_and_connection_close_are_honoured(live: Live) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
    try:
        writer.write(b"HEAD /v1/stream/none HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 5)  # returns only once the server closes
        assert data.startswith(b"HTTP/1.1 404")
        assert data.endswith(b"\r\n\r\n")  # HEAD: no body
    finally:
        writer.close()


async def test_an_http10_client_gets_no_chunked_answer(serve: Serve) -> None:
    """Issue 28, item 8: a live SSE read from an HTTP/1.0 client was answered with
    ``Transfer-Encoding: chunked``, which RFC 9112 (6.1) forbids to a 1.0 client: it takes the chunk
    sizes for data. An answer of unknown length goes to it unframed, and the connection's close
    ends it (6.3). An answer of known length keeps the 1.0 connection open when the client asked
    for that (``Connection: keep-alive``), and says so."""
    async with serve(long_poll=0.2, sse_max=1.0) as srv:
        put = b"PUT /v1/stream/s HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nhi"
        assert [r[0] for r in await exchange(srv.port, put)] == [201]
        reader, writer = await srv.connect()
        writer.write(b"GET /v1/stream/s?offset=-1&live=sse HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT)
        assert head.startswith(b"HTTP/1.1 200 ")
        assert b"transfer-encoding" not in head.lower() and b"content-length" not in head.lower()
        assert b"\r\nconnection: close" in head.lower()
        body = await asyncio.wait_for(reader.read(), WAIT)  # to the end: the server closes after sse_max
        assert body.startswith(b"event: data\ndata:hi\n"), body[:100]
        assert not body.endswith(b"0\r\n\r\n")
        reader, writer = await srv.connect()
        writer.write(b"GET /v1/stream/s?offset=-1 HTTP/1.0\r\nHost: x\r\nConnection: keep-alive\r\n\r\n" * 2)
        for _ in range(2):
            r = await read_response(reader)
            assert r is not None and (r.status, r.body, r.header("connection")) == (200, b"hi", "keep-alive")
        writer.write(b"GET /v1/stream/s?offset=-1 HTTP/1.0\r\nHost: x\r\n\r\n")
        r = await read_response(reader)
        assert r is not None and (r.status, r.body, r.closes) == (200, b"hi", True)
        assert await closed_within(reader) == b""


async def test_sse_disconnect_releases_the_reader(live: Live) -> None:
    await exchange(
        live.port, b"PUT /v1/stream/s HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 1\r\n\r\na"
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
    writer.write(b"GET /v1/stream/s?offset=-1&live=sse HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    seen = b""
    while b"event: control" not in seen:
        seen += await asyncio.wait_for(reader.read(4096), 5)
    assert b"transfer-encoding: chunked" in seen
    stream = live.broker.get("s")
    assert stream is not None
    for _ in range(100):
        if stream.waiters:
            break
        await asyncio.sleep(0.01)
    assert len(stream.waiters) == 1  # the SSE reader is waiting for data
    writer.close()
    for _ in range(200):
        if not stream.waiters:
            break
        await asyncio.sleep(0.01)
    assert not stream.waiters, "a disconnected SSE client still holds a waiter"


# ------------------------------------------------------------------ issue 15, item 9: timeouts and a connection cap

CREATE = b"PUT /v1/stream/s HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 0\r\n\r\n"


async def test_an_idle_keep_alive_connection_is_closed(serve: Serve) -> None:
    async with serve(idle_timeout=0.5) as srv:
        reader, writer = await srv.connect()
        writer.write(CREATE)
        r = await read_response(reader)
        assert r is not None and r.status == 201 and not r.closes
        assert await closed_within(reader) == b""  # closed quietly, no response to a request never sent
        writer.close()


async def test_half_sent_headers_get_408_even_when_trickled(serve: Serve) -> None:
    """The header timeout counts from the request's first byte: more header bytes do not extend it."""
    async with serve(header_timeout=0.5) as srv:
        reader, writer = await srv.connect()
        writer.write(b"POST /v1/stream/s HTTP/1.1\r\nHost: x\r\n")

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError):
                for _ in range(int(WAIT * 10)):
                    writer.write(b"X-Slow: 1\r\n")
                    await asyncio.sleep(0.1)

        task = asyncio.ensure_future(trickle())
        try:
            data = await closed_within(reader)
        finally:
            task.cancel()
            writer.close()
        assert data.startswith(b"HTTP/1.1 408 "), data[:200]


async def test_a_connection_that_never_sends_is_closed(serve: Serve) -> None:
    async with serve(header_timeout=0.5) as srv:
        reader, writer = await srv.connect()
        await closed_within(reader)
        writer.close()


async def test_a_body_trickled_at_a_few_bytes_per_second_is_cut_off(serve: Serve) -> None:
    """Bytes keep coming (so an inactivity timeout alone never fires), but far below the minimum rate."""
    async with serve(body_timeout=0.5, min_body_rate=1000) as srv:
        reader, writer = await srv.connect()
        writer.write(
            CREATE
            + b"POST /v1/stream/s HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 1000\r\n\r\n"
        )
        created = await read_response(reader)
        assert created is not None and created.status == 201

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError):
                for _ in range(int(WAIT * 10)):
                    writer.write(b"x")
                    await asyncio.sleep(0.1)

        task = asyncio.ensure_future(trickle())
        try:
            data = await closed_within(reader)
        finally:
            task.cancel()
            writer.close()
        assert data.startswith(b"HTTP/1.1 408 "), data[:200]
        stream = srv.broker.get("s")
        assert stream is not None and stream.tail.offset == 0  # nothing of the cut-off body was stored


async def test_connections_over_the_cap_get_503_and_a_freed_slot_is_reused(serve: Serve) -> None:
    async with serve(max_connections=20, header_timeout=60, idle_timeout=60) as srv:
        held = [await srv.connect() for _ in range(20)]
        reader, writer = await srv.connect()
        data = await closed_within(reader)
        writer.close()
        assert data.startswith(b"HTTP/1.1 503 "), data[:200]
        held.pop()[1].close()
        for _ in range(int(WAIT * 20)):  # until the server has seen the close
            reader, writer = await srv.connect()
            writer.write(b"GET /v1/stream/none HTTP/1.1\r\nHost: x\r\n\r\n")
            r = await read_response(reader)
            writer.close()
            if r is not None and r.status == 404:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("no connection was accepted after one of the held ones closed")
        for _, w in held:
            w.close()


async def test_three_hundred_idle_sockets_are_all_closed(serve: Serve) -> None:
    async with serve(header_timeout=0.5, idle_timeout=0.5) as srv:
        socks = [await srv.connect() for _ in range(300)]
        for i, (_, w) in enumerate(socks):
            if i % 2:
                w.write(CREATE.replace(b"/s ", b"/s%d " % i))  # half of them after one request
        await asyncio.gather(*(closed_within(r) for r, _ in socks))
        for _, w in socks:
            w.close()


async def test_a_client_that_does_not_read_its_response_is_dropped(serve: Serve) -> None:
    """A reader that stops reading (its window fills) must not hold a connection and a response for good."""
    async with serve(max_body=1 << 20, write_timeout=0.5) as srv:
        reader, writer = await srv.connect()
        body = b"x" * (1 << 20)
        writer.write(
            CREATE + b"POST /v1/stream/s HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert (r := await read_response(reader)) is not None and r.status == 201
        assert (r := await read_response(reader)) is not None and r.status == 204
        for _ in range(32):  # 32 MiB of responses asked for and not read
            writer.write(b"GET /v1/stream/s?offset=-1 HTTP/1.1\r\nHost: x\r\n\r\n")
        for _ in range(int(WAIT * 20)):
            if not srv.connections:
                break
            await asyncio.sleep(0.05)
        assert not srv.connections, "the server still holds the connection of a client that stopped reading"
        writer.close()


async def test_a_slow_reader_that_keeps_reading_is_not_dropped(serve: Serve) -> None:
    """The write timeout is about a client that reads nothing, not one that reads slowly."""
    async with serve(max_body=1 << 20, write_timeout=2.0) as srv:
        body = b"x" * (1 << 20)
        append = (
            b"POST /v1/stream/s HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        await exchange(srv.port, CREATE + append * 4, until=5)
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)  # so that the server's side fills up
        sock.connect(("127.0.0.1", srv.port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=1 << 16)
        srv.clients.append(writer)
        writer.write(b"GET /v1/stream/s?offset=-1 HTTP/1.1\r\nHost: x\r\n\r\n")
        got = b""
        while b"\r\n\r\n" not in got or len(got) < got.index(b"\r\n\r\n") + 4 + len(body) * 4:
            chunk = await asyncio.wait_for(reader.read(16384), WAIT)
            assert chunk, f"the server dropped a slow reader after {len(got)} bytes"
            got += chunk
            await asyncio.sleep(0.02)  # under 1 MiB/s: seconds for the 4 MiB, much longer than the write timeout
        assert got.startswith(b"HTTP/1.1 200 ")


async def test_an_oversized_header_block_gets_431(serve: Serve) -> None:
    async with serve(max_header_bytes=8192) as srv:
        reader, writer = await srv.connect()
        writer.write(b"GET /v1/stream/none HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 10000 + b"\r\n\r\n")
        data = await closed_within(reader)
        writer.close()
        assert data.startswith(b"HTTP/1.1 431 "), data[:200]


async def test_a_header_that_never_ends_gets_431_before_it_is_all_sent(serve: Serve) -> None:
    async with serve(max_header_bytes=8192, header_timeout=60) as srv:
        reader, writer = await srv.connect()
        writer.write(b"GET /v1/stream/none HTTP/1.1\r\nHost: x\r\nX-Endless: ")

        async def pump() -> None:
            with contextlib.suppress(ConnectionError):
                for _ in range(1024):  # up to 64 MiB, never a CRLF
                    writer.write(b"a" * 65536)
                    await writer.drain()

        task = asyncio.ensure_future(pump())
        try:
            data = await closed_within(reader)
        finally:
            task.cancel()
            writer.close()
        assert data.startswith(b"HTTP/1.1 431 "), data[:200]


async def test_too_many_headers_get_431(serve: Serve) -> None:
    async with serve(max_headers=20) as srv:
        reader, writer = await srv.connect()
        writer.write(
            b"GET /v1/stream/none HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: 1\r\n" % i for i in range(30)) + b"\r\n"
        )
        data = await closed_within(reader)
        writer.close()
        assert data.startswith(b"HTTP/1.1 431 "), data[:200]


# ------------------------------------------------------------------ issue 15, item 10: an early 413


async def test_a_declared_length_over_the_limit_is_refused_before_the_body(serve: Serve) -> None:
    async with serve(max_body=1 << 20) as srv:
        reader, writer = await srv.connect()
        writer.write(
            CREATE + b"POST /v1/stream/s HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
            b"Content-Length: %d\r\n\r\n" % (64 << 20)
        )
        assert (r := await read_response(reader)) is not None and r.status == 201
        r = await read_response(reader)  # no byte of the body sent
        writer.close()
        assert r is not None and r.status == 413 and r.closes
        assert b"limit" in r.body


async def test_an_endless_chunked_body_is_refused_once_over_the_limit(serve: Serve) -> None:
    async with serve(max_body=1 << 20) as srv:
        reader, writer = await srv.connect()
        writer.write(
            CREATE + b"POST /v1/stream/s HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        assert (r := await read_response(reader)) is not None and r.status == 201
        chunk = b"%x\r\n%s\r\n" % (65536, b"x" * 65536)

        async def pump() -> None:
            with contextlib.suppress(ConnectionError):
                for _ in range(1024):  # up to 64 MiB; never the last chunk
                    writer.write(chunk)
                    await writer.drain()

        task = asyncio.ensure_future(pump())
        try:
            r = await read_response(reader)
        finally:
            task.cancel()
            writer.close()
        assert r is not None and r.status == 413 and r.closes
        stream = srv.broker.get("s")
        assert stream is not None and stream.tail.offset == 0


async def test_expect_100_continue_with_a_length_over_the_limit_gets_413_not_100(serve: Serve) -> None:
    async with serve(max_body=1 << 20) as srv:
        reader, writer = await srv.connect()
        writer.write(
            CREATE + b"POST /v1/stream/s HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
            b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % (64 << 20)
        )
        assert (r := await read_response(reader)) is not None and r.status == 201
        r = await read_response(reader)
        writer.close()
        assert r is not None and r.interim == [] and r.status == 413


# ------------------------------------------------------------------ issue 15, item 11: flow control of pipelined bodies


async def read_all(port: int, name: str) -> bytes:
    """The whole stream, read over HTTP from its start to its tail."""
    out, offset = b"", "-1"
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=WAIT) as client:
        while True:
            r = await client.get(f"/v1/stream/{name}", params={"offset": offset})
            assert r.status_code == 200, r.text
            out += r.content
            if r.headers.get("stream-up-to-date") == "true" or r.headers["stream-next-offset"] == offset:
                return out
            offset = r.headers["stream-next-offset"]


def buffered_body_bytes(conn: HttpServerProtocol) -> int:
    """Request body bytes the connection holds that no application has taken yet."""
    reqs = {id(r): r for r in [*conn.queue, *([conn.current] if conn.current is not None else [])]}
    return sum(len(chunk) for req in reqs.values() for chunk in req.body)


async def test_pipelined_bodies_behind_a_slow_request_are_bounded(serve: Serve) -> None:
    """Twenty 512 KiB appends pipelined behind a long-poll: the server stops reading instead of buffering them."""
    bound = 256 << 10
    async with serve(max_body=1 << 20, long_poll=1.0, body_buffer=bound) as srv:
        reader, writer = await srv.connect()
        writer.write(CREATE)
        assert (r := await read_response(reader)) is not None and r.status == 201
        body = b"y" * (512 << 10)
        append = (
            b"POST /v1/stream/s HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body)
        )
        writer.write(b"GET /v1/stream/s?offset=now&live=long-poll HTTP/1.1\r\nHost: x\r\n\r\n")
        sending = asyncio.ensure_future(writer.drain())
        for _ in range(20):
            writer.write(append)
        sending = asyncio.ensure_future(writer.drain())
        peak = 0
        for _ in range(40):  # watch the server while the long-poll holds the line (about 1 s)
            peak = max(peak, sum(buffered_body_bytes(c) for c in srv.connections))
            await asyncio.sleep(0.02)
        # at most the bound plus one read of the socket
        assert peak <= bound + (256 << 10), f"the server buffered {peak} bytes of pipelined bodies"
        statuses = [(r.status if (r := await read_response(reader)) is not None else None) for _ in range(21)]
        await sending
        writer.close()
        assert statuses == [204] + [204] * 20  # the long-poll timed out (204), then every append
        assert await read_all(srv.port, "s") == body * 20


# ------------------------------------------------------------------ issue 15, item 12: interim responses


async def test_a_pipelined_expect_100_continue_waits_for_its_turn(serve: Serve) -> None:
    async with serve(long_poll=0.2, sse_max=1.0) as srv:
        await exchange(
            srv.port, b"PUT /v1/stream/s HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 1\r\n\r\na"
        )
        reader, writer = await srv.connect()
        writer.write(
            b"GET /v1/stream/s?offset=-1&live=sse HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /v1/stream/s HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n"
            b"Expect: 100-continue\r\n\r\n"
        )
        sse = await read_response(reader)  # the whole SSE response, ended by sse_max
        assert sse is not None and sse.status == 200 and sse.interim == []
        assert b"event: control" in sse.body and b"HTTP/1.1" not in sse.body
        line = await asyncio.wait_for(reader.readline(), WAIT)
        assert line.startswith(b"HTTP/1.1 100 "), line  # only now, when the POST's body is read
        assert await reader.readline() == b"\r\n"
        writer.write(b"hi")
        r = await read_response(reader)
        writer.close()
        assert r is not None and r.status == 204


# ------------------------------------------------------------------ onceflow serve's flags


def test_serve_flags_reach_the_http_layer(tmp_path: Path) -> None:
    """``onceflow serve --idle-timeout 0.5 --max-connections 2``: both hold on a real server process."""
    srv = ServerProcess(tmp_path / "data", "--idle-timeout", "0.5", "--max-connections", "2")
    srv.start()
    try:
        held = [socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT) for _ in range(2)]
        with socket.create_connection(("127.0.0.1", srv.port), timeout=WAIT) as third:
            assert third.recv(4096).startswith(b"HTTP/1.1 503 ")
        for s in held:
            s.sendall(b"GET /v1/stream/none HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):  # the 404, then the close after 0.5 s idle
                data += chunk
            assert data.startswith(b"HTTP/1.1 404 "), data[:100]
            s.close()
    finally:
        srv.kill()


def test_serve_refuses_a_bad_limit(tmp_path: Path) -> None:
    from onceflow.cli import main

    assert main(["serve", "--data", str(tmp_path / "d"), "--header-timeout", "0"]) == 2
    # a follower that could not pass the largest body on
    assert main(["serve", "--data", str(tmp_path / "d"), "--max-body", "2MiB", "--forward-buffer", "1MiB"]) == 2
