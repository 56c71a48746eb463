"""The asyncio client's lean HTTP/1.1 transport (client/_transport.py), against raw sockets that
misbehave on purpose. What the producers rely on: a ``ConnectError`` only when nothing was sent, an
error that says "maybe" once a request may have reached the server, bodies streamed as they come,
keep-alive connections reused and never one that the server closed."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from onceflow.client._transport import LeanAsyncTransport
from onceflow.client.lowlevel import async_http_client

pytestmark = pytest.mark.anyio
WAIT = 30.0  # upper bound for anything a test waits on; never a timing assertion

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class RawServer:
    """A loopback TCP server that runs ``handler`` per connection and counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer)
            finally:
                writer.close()

        self.server = await asyncio.start_server(run, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """The request line and headers, and a Content-Length body or a chunked one, de-chunked."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.lower().split(b"\r\n")
    length = next((int(h.split(b":")[1]) for h in lines if h.startswith(b"content-length:")), None)
    if length is not None:
        return head, await reader.readexactly(length)
    if b"transfer-encoding: chunked" in lines:
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return head, body
            body += chunk[:-2]
    return head, b""


def answer(body: bytes, *extra: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body),
        b"".join(h + b"\r\n" for h in extra),
        body,
    )


async def echo_forever(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        try:
            head, body = await read_request(reader)
        except asyncio.IncompleteReadError:
            return
        writer.write(answer(head.split(b"\r\n")[0] + b"|" + body))
        await writer.drain()


@pytest.fixture
async def client() -> AsyncIterator[Callable[..., httpx.AsyncClient]]:
    made: list[httpx.AsyncClient] = []

    def make(limits: httpx.Limits | None = None, timeout: float = WAIT) -> httpx.AsyncClient:
        c = httpx.AsyncClient(transport=LeanAsyncTransport(limits), timeout=timeout)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.aclose()


async def test_the_factory_uses_it_for_http_urls() -> None:
    async with async_http_client("http://127.0.0.1:1", timeout=5) as c:
        assert isinstance(c._transport, LeanAsyncTransport)  # noqa: SLF001
    async with async_http_client("https://127.0.0.1:1", timeout=5) as c:
        assert not isinstance(c._transport, LeanAsyncTransport)  # noqa: SLF001


async def test_requests_reuse_one_connection_and_bodies_arrive_whole(client: Callable[..., httpx.AsyncClient]) -> None:
    raw = RawServer(echo_forever)
    async with raw as url:
        c = client()
        for i in range(5):
            r = await c.post(url + f"/v1/stream/s?n={i}", content=b"x" * (i * 100_000))
            assert r.status_code == 200
            assert r.content == f"POST /v1/stream/s?n={i} HTTP/1.1|".encode() + b"x" * (i * 100_000)

        async def parts() -> AsyncIterator[bytes]:
            for part in (b"a", b"", b"bc"):
                yield part

        r = await c.post(url + "/chunked", content=parts())
        assert r.content == b"POST /chunked HTTP/1.1|abc"
        assert (await c.head(url + "/h")).status_code == 200
        assert (await c.get(url + "/after-head")).content == b"GET /after-head HTTP/1.1|"
    assert raw.connections == 2  # the HEAD's connection is not reused


async def test_a_refused_connection_is_a_connect_error(client: Callable[..., httpx.AsyncClient]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(httpx.ConnectError):
            await client().get(f"http://127.0.0.1:{port}/")


async def test_a_request_the_server_read_and_dropped_is_not_a_connect_error(
    client: Callable[..., httpx.AsyncClient],
) -> None:
    """The append may have been stored: the producers must treat it as unknown, never as unsent."""

    async def read_then_drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async def half_an_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n12345")
        await writer.drain()

    for handler, error in ((read_then_drop, httpx.RemoteProtocolError), (half_an_answer, httpx.ReadError)):
        async with RawServer(handler) as url:
            with pytest.raises(error) as caught:
                await client().post(url + "/v1/stream/s", content=b"{}")
            assert not isinstance(caught.value, httpx.ConnectError | httpx.ConnectTimeout)


async def test_a_silent_server_is_a_read_timeout(client: Callable[..., httpx.AsyncClient]) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(WAIT)

    async with RawServer(silent) as url:
        with pytest.raises(httpx.ReadTimeout):
            await client(timeout=0.2).get(url + "/")


async def test_a_body_is_streamed_as_it_arrives(client: Callable[..., httpx.AsyncClient]) -> None:
    """A live read (SSE, long-poll) gets each piece when it is sent, before the response ends."""
    go_on = asyncio.Event()

    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await go_on.wait()
        writer.write(b"4\r\nlast\r\n0\r\n\r\n")
        await writer.drain()

    async with RawServer(drip) as url:
        async with client().stream("GET", url + "/live") as r:
            pieces = r.aiter_raw()
            assert await asyncio.wait_for(pieces.__anext__(), WAIT) == b"first"
            go_on.set()
            assert [p async for p in pieces] == [b"last"]


async def test_a_connection_the_server_closed_while_idle_is_not_used_again(
    client: Callable[..., httpx.AsyncClient],
) -> None:
    async def one_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(b"ok"))  # keep-alive as far as the headers say, then closed
        await writer.drain()

    raw = RawServer(one_then_close)
    async with raw as url:
        c = client()
        for _ in range(3):
            assert (await c.get(url + "/")).content == b"ok"
            await asyncio.sleep(0.05)  # the close reaches the idle connection
    assert raw.connections == 3


async def test_the_pool_bounds_connections_and_times_out_waiting(client: Callable[..., httpx.AsyncClient]) -> None:
    raw = RawServer(echo_forever)
    async with raw as url:
        c = client(httpx.Limits(max_connections=2, max_keepalive_connections=2))
        got = await asyncio.gather(*(c.get(url + f"/{i}") for i in range(10)))
        assert [r.content for r in got] == [f"GET /{i} HTTP/1.1|".encode() for i in range(10)]
        assert raw.connections <= 2
        slow = client(httpx.Limits(max_connections=1), timeout=0.2)
        async with slow.stream("GET", url + "/held"):  # holds the only connection
            with pytest.raises(httpx.PoolTimeout):
                await slow.get(url + "/waits")
