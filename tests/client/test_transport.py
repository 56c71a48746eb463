"""The asyncio client's lean HTTP/1.1 transport (client/_transport.py), against raw sockets that
misbehave on purpose. What the producers rely on: a ``ConnectError`` only when nothing was sent, an
error that says "maybe" once a request may have reached the server, bodies streamed as they come,
keep-alive connections reused and never one that the server closed."""

from __future__ import annotations

import asyncio
import socket
import struct
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


async def test_idle_connections_to_one_server_do_not_keep_another_out_of_a_full_pool(
    client: Callable[..., httpx.AsyncClient],
) -> None:
    """One pool serves every server of a failover client. A pool full of idle keep-alive
    connections to one server (the old leader, a follower that answered 503, a dead one) must
    close one of them for a request to another server, as httpx's own pool does, not time out."""
    async with RawServer(echo_forever) as a, RawServer(echo_forever) as b:
        c = client(httpx.Limits(max_connections=2, max_keepalive_connections=2), timeout=httpx.Timeout(WAIT, pool=1.0))
        held = [await c.send(c.build_request("GET", a + f"/{i}"), stream=True) for i in range(2)]
        for r in held:
            await r.aread()  # read to the end: two idle connections to a, the pool is full
        assert (await c.get(b + "/b")).content == b"GET /b HTTP/1.1|"
        assert (await c.get(a + "/a")).content == b"GET /a HTTP/1.1|"


async def test_a_failover_client_whose_pool_a_follower_filled_reaches_the_leader() -> None:
    """Requests that a follower answered with 503 not_leader leave their connections to it idle;
    sent on to the leader, they must get connections there (a producer's pool is max_in_flight + 2
    for both, idle and open)."""

    async def follower(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            body = b'{"error":{"code":"not_leader","message":"a follower"}}'
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    gate = asyncio.Event()

    async def leader(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head, body = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            await gate.wait()  # every request is in flight at once
            writer.write(answer(head.split(b"\r\n")[0]))
            await writer.drain()

    async with RawServer(follower) as f, RawServer(leader) as lead:
        url = f + "," + lead.removeprefix("http://")
        limits = httpx.Limits(max_connections=3, max_keepalive_connections=3)
        async with async_http_client(url, timeout=httpx.Timeout(WAIT, pool=2.0), limits=limits) as c:
            target = f + "/v1/stream/s"
            sends = [asyncio.ensure_future(c.post(target, content=b"[1]")) for _ in range(3)]
            await asyncio.sleep(0.2)
            gate.set()
            got = await asyncio.wait_for(asyncio.gather(*sends), WAIT)
            assert [r.status_code for r in got] == [200] * 3


async def test_a_request_cancelled_as_its_pool_slot_came_passes_the_slot_on(
    client: Callable[..., httpx.AsyncClient],
) -> None:
    """Waiters for a full pool are woken one per connection freed. One cancelled (a reader's task,
    a wait_for around a request) just as it was woken must hand the wake on: the next waiter would
    otherwise wait for a connection that is free (forever without a pool timeout)."""
    async with RawServer(echo_forever) as url:
        c = client(httpx.Limits(max_connections=1), timeout=httpx.Timeout(WAIT, pool=None))
        held = await c.send(c.build_request("GET", url + "/held"), stream=True)
        first = asyncio.ensure_future(c.get(url + "/first"))
        second = asyncio.ensure_future(c.get(url + "/second"))
        await asyncio.sleep(0.1)  # both wait for the pool
        await held.aclose()  # wakes the first ...
        first.cancel()  # ... which is cancelled before it runs
        assert (await asyncio.wait_for(second, WAIT)).content == b"GET /second HTTP/1.1|"
        with pytest.raises(asyncio.CancelledError):
            await first


async def test_a_body_without_length_cut_off_by_a_reset_is_an_error(client: Callable[..., httpx.AsyncClient]) -> None:
    """A body that ends with the connection (no Content-Length, not chunked) is whole only when the
    server closed the connection; a reset cuts it off, and the reader must not take it as whole."""

    async def reset_midway(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\npartial")
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        writer.transport.abort()

    async def close_at_end(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nwhole")
        await writer.drain()

    async with RawServer(close_at_end) as url:
        assert (await client().get(url + "/")).content == b"whole"
    async with RawServer(reset_midway) as url:
        with pytest.raises(httpx.ReadError):
            await client().get(url + "/")


async def test_a_connection_the_server_closed_right_after_its_answer_is_not_used_again(
    client: Callable[..., httpx.AsyncClient],
) -> None:
    """A server that closes a keep-alive connection just after answering (shutting down, a proxy's
    limit): the close may sit in the socket, not yet seen by the event loop, when the next request
    takes the connection. Sent there it is lost and reported as "maybe sent" (a producer then
    counts it as maybe stored; a failover client gives up on a server that would have refused at
    once). httpx's own pool looks at the socket first; so must this one."""

    async def one_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(b"ok"))  # keep-alive as far as the headers say, then closed at once
        await writer.drain()

    raw = RawServer(one_then_close)
    async with raw as url:
        c = client()
        for _ in range(20):
            assert (await c.get(url + "/")).content == b"ok"
    assert raw.connections == 20


async def test_a_streamed_body_read_before_it_is_sent_is_still_sent_chunked(
    client: Callable[..., httpx.AsyncClient],
) -> None:
    """A request made from an iterator says ``Transfer-Encoding: chunked``; once read (an auth flow
    or a retry reads it), its content is there as bytes, and must still go in chunks."""

    async def parts() -> AsyncIterator[bytes]:
        yield b"ab"
        yield b"c"

    async with RawServer(echo_forever) as url:
        c = client()
        request = c.build_request("POST", url + "/read-first", content=parts())
        await request.aread()
        assert (await c.send(request)).content == b"POST /read-first HTTP/1.1|abc"
        assert (await c.get(url + "/next")).content == b"GET /next HTTP/1.1|"


async def test_bytes_after_a_response_are_not_part_of_it_nor_of_the_next(
    client: Callable[..., httpx.AsyncClient],
) -> None:
    """A server that sends more than the response asked for (a second response, in the same
    packet): the response read is the first one, whole and only it, and the connection is not
    used again (its next response would be that stray one)."""
    sent = 0

    async def two_answers(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        while True:
            try:
                head, _ = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            sent += 1
            writer.write(answer(b"first") + answer(b"STRAY") if sent == 1 else answer(head.split(b"\r\n")[0]))
            await writer.drain()

    async with RawServer(two_answers) as url:
        c = client()
        assert (await c.get(url + "/one")).content == b"first"
        assert (await c.get(url + "/two")).content == b"GET /two HTTP/1.1"


async def test_interim_responses_are_skipped(client: Callable[..., httpx.AsyncClient]) -> None:
    """1xx responses (100 Continue, 103 Early Hints) come before the response; the connection
    stays usable after them."""

    async def interim_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head, _ = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n")
            writer.write(answer(head.split(b"\r\n")[0]))
            await writer.drain()

    raw = RawServer(interim_first)
    async with raw as url:
        c = client()
        for i in range(3):
            r = await c.get(url + f"/{i}")
            assert (r.status_code, r.content, "link" in r.headers) == (200, f"GET /{i} HTTP/1.1".encode(), False)
    assert raw.connections == 1


async def test_a_line_break_in_a_header_is_refused_before_anything_is_sent(
    client: Callable[..., httpx.AsyncClient],
) -> None:
    """httpx does not check header values; h11 (its own transport) refuses a line break in one. So
    must this transport: written as it is, it would make a header, or a second request, of its own
    (whose answer would then be taken for the next request's)."""
    heads: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head, _ = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            heads.append(head)
            writer.write(answer(b"ok"))
            await writer.drain()

    async with RawServer(record) as url:
        c = client()
        for bad in ("a\r\nx-injected: 1", "a\nx-injected: 1", "a\r\n\r\nGET /smuggled HTTP/1.1\r\nhost: x\r\n"):
            with pytest.raises(httpx.LocalProtocolError):
                await c.post(url + "/v1/stream/s", content=b"{}", headers={"producer-id": bad})
        assert (await c.get(url + "/fine")).content == b"ok"
    assert [h.split(b"\r\n")[0] for h in heads] == [b"GET /fine HTTP/1.1"]


async def _reads_slowly(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A healthy server on a slow link: takes the body at about 6 MiB/s, then answers at once."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    got = 0
    while got < length:
        got += len(await reader.read(min(64 << 10, length - got)))
        await asyncio.sleep(0.01)
    writer.write(b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n")
    await writer.drain()
    writer.close()


@pytest.mark.anyio
async def test_the_read_timeout_counts_from_the_end_of_the_upload() -> None:
    """Found by review: the lean transport handed the whole body to asyncio and started the read
    timer at once, so a body that took longer to send than the read timeout (a big append on a slow
    link; through several servers the read timeout is at most SILENT_SERVER, 10 s) failed with a
    read timeout from a healthy server, every time it was sent again. The upload is bounded by the
    write timeout, per stall, as httpx's own transport does; the read timeout starts after it."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 128 << 10)  # no 32 MiB autotuned buffer to fill
    listener.bind(("127.0.0.1", 0))
    server = await asyncio.start_server(_reads_slowly, sock=listener)
    port = server.sockets[0].getsockname()[1]
    # the kernel still takes up to 4 MiB (tcp_wmem) at once: those count as waiting for the answer
    client = async_http_client(f"http://127.0.0.1:{port}", timeout=httpx.Timeout(5.0, read=2.0))
    try:
        r = await client.post(f"http://127.0.0.1:{port}/v1/stream/x", content=b"x" * (24 << 20))  # ~4 s to send
        assert r.status_code == 204
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()
