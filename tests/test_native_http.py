"""The native HTTP/1.1 server: framing, pipelining, limits and live-read disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig
from onceflow.server.http import start_server

pytestmark = pytest.mark.anyio


@dataclass
class Live:
    broker: Broker
    port: int


@pytest.fixture
async def live(tmp_path: Path) -> AsyncIterator[Live]:
    broker = Broker(tmp_path / "data")
    broker.open()
    app = App(broker, AppConfig(long_poll_timeout=5, max_body_bytes=1024))
    server = await start_server(app, "127.0.0.1", 0, 1024)
    try:
        yield Live(broker, server.sockets[0].getsockname()[1])
    finally:
        server.close()
        broker.begin_shutdown()
        await broker.close()


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
        b"4\r\n[{\"a\r\n5\r\n\":1}]\r\n0\r\n\r\n"
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
        + b"%x\r\n%s\r\n" % (len(chunk), chunk) * 2
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


async def test_expect_100_continue(live: Live) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
    try:
        writer.write(b"PUT /v1/stream/e HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
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


async def test_sse_disconnect_releases_the_reader(live: Live) -> None:
    await exchange(live.port, b"PUT /v1/stream/s HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 1\r\n\r\na")
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
