"""Several servers behind one client URL (``http://a:4437,b:4437``): the URL's parsing, the failover
transports' hops (refused connection, 503 ``not_leader``), the rule that an error after the request
was sent is raised unchanged and moves only the next request, and a real server behind a dead port,
a follower and a proxy that loses acknowledgements, where an idempotent producer's appends land
exactly once.

The transport tests put stand-in servers behind a stand-in inner transport (no sockets): each is
a function of the request, by ``host:port``. Leader election is not written yet, so the follower in
the real-server test is a small stand-in HTTP server too.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

import httpx
import pytest

from helpers.servers import ServerProcess, free_port
from onceflow.admin import AdminClient
from onceflow.client import Consumer, IdempotentProducer, OnceflowError, Stream, TransactionalProducer, TransportError
from onceflow.client._failover import (
    SILENT_SERVER,
    AsyncFailoverTransport,
    FailoverTransport,
    Servers,
    parse_servers,
)
from onceflow.client.lowlevel import (
    NoServerError,
    async_http_client,
    http_client,
    request_url,
    server_url,
)
from onceflow.client.transactions import AsyncTransactionalProducer
from onceflow.testing import FaultProxy

Handler = Callable[[httpx.Request], httpx.Response]
Kind = Literal["sync", "async"]


# ---------------------------------------------------------------------- the URL


def test_one_server_is_left_as_it_is() -> None:
    for url in ("http://a:4437", "https://a", "http://a:4437/v1/stream/x,y", "http://a:4437/"):
        assert parse_servers(url) is None
        assert request_url(url) == url
        assert server_url(url) == url


def test_several_servers_after_one_scheme() -> None:
    servers = parse_servers("http://a:4437, b:4437,[::1]:4438/v1/stream/orders/")
    assert servers == Servers("http", ("a:4437", "b:4437", "[::1]:4438"), "/v1/stream/orders")
    assert str(servers) == "http://a:4437,b:4437,[::1]:4438/v1/stream/orders"
    assert servers.first_url == "http://a:4437/v1/stream/orders"
    assert request_url("http://a:4437,b:4437/v1/stream/x,y") == "http://a:4437/v1/stream/x,y"
    assert parse_servers("http://a,b:1/") == Servers("http", ("a", "b:1"), "")


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://a:1,,b:2", "empty server"),
        ("http://a:1,http://b:2", "after one scheme"),
        ("http://a:1,u@b:2", "after one scheme"),
        ("http://a:1,a:1", "named twice"),
        ("http://a,a:80", "named twice"),
        ("a:1,b:2", "name the scheme once"),
        ("ftp://a:1,b:2", "http or https"),
        ("http://a:1,b:x", "not a host:port"),
    ],
)
def test_a_malformed_list_of_servers_is_refused(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_servers(url)


def test_a_list_of_urls_is_the_same_as_the_comma_form() -> None:
    assert server_url(["http://a:1", "http://b:2/"]) == "http://a:1,b:2"
    assert server_url(("http://a:1/v1/stream/s", "http://b:2/v1/stream/s")) == "http://a:1,b:2/v1/stream/s"
    assert server_url(["http://a:1"]) == "http://a:1"
    for bad in (["http://a:1", "https://b:2"], ["http://a:1/x", "http://b:2/y"], [], ["http://a:1,b:2", "http://c:3"]):
        with pytest.raises(ValueError):
            server_url(bad)


def test_handles_keep_every_server_in_their_url() -> None:
    with Stream.connect(["http://a:1", "http://b:2"], "orders") as s:
        assert s.url == "http://a:1,b:2/v1/stream/orders"
        assert s.name == "orders"
    with Stream("http://a:1,b:2/v1/stream/orders") as s:
        assert repr(s) == "Stream('http://a:1,b:2/v1/stream/orders')"


# ---------------------------------------------------------------------- stand-in servers


def ok(name: str) -> Handler:
    return lambda request: httpx.Response(200, json={"server": name})


def follower(leader: str | None) -> Handler:
    def answer(request: httpx.Request) -> httpx.Response:
        body = {"error": {"code": "not_leader", "message": "this server is not the leader", "leader": leader}}
        headers = {"onceflow-leader": leader} if leader else {}
        return httpx.Response(503, json=body, headers=headers)

    return answer


def dead(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("[Errno 111] Connection refused", request=request)


class Fleet(httpx.BaseTransport, httpx.AsyncBaseTransport):
    """Stand-in servers by ``host:port`` behind one inner transport, and the requests they saw
    (``calls``: ``host:port``, in order). Like a real transport, it consumes the request's body
    (unlike ``httpx.MockTransport``, which reads it into memory first)."""

    def __init__(self, **servers: Handler) -> None:
        self.servers = {name.replace("_", ":"): h for name, h in servers.items()}
        self.calls: list[str] = []
        self.host_headers: list[str] = []

    def _answer(self, request: httpx.Request) -> httpx.Response:
        key = f"{request.url.host}:{request.url.port}"
        self.calls.append(key)
        self.host_headers.append(request.headers["host"])
        return self.servers[key](request)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        answer = self._answer(request)
        assert isinstance(request.stream, httpx.SyncByteStream)
        b"".join(request.stream)
        return answer

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        answer = self._answer(request)
        assert isinstance(request.stream, httpx.AsyncByteStream)
        b"".join([chunk async for chunk in request.stream])
        return answer


class Client:
    """A blocking or an asyncio client over a failover transport over the fleet, used alike."""

    def __init__(self, kind: Kind, url: str, fleet: Fleet) -> None:
        servers = parse_servers(url)
        assert servers is not None
        self.kind = kind
        self.url = request_url(url)
        self.transport: FailoverTransport | AsyncFailoverTransport
        if kind == "sync":
            self.transport = FailoverTransport(servers, fleet)
            self._sync = httpx.Client(transport=self.transport)
        else:
            self.transport = AsyncFailoverTransport(servers, fleet)
            self._async = httpx.AsyncClient(transport=self.transport)
            self._loop = asyncio.new_event_loop()

    def request(self, method: str = "POST", url: str | None = None, **kw: Any) -> httpx.Response:
        if self.kind == "sync":
            return self._sync.request(method, url or self.url, **kw)
        return self._loop.run_until_complete(self._async.request(method, url or self.url, **kw))

    def close(self) -> None:
        if self.kind == "sync":
            self._sync.close()
        else:
            self._loop.run_until_complete(self._async.aclose())
            self._loop.close()


@pytest.fixture(params=["sync", "async"])
def kind(request: pytest.FixtureRequest) -> Kind:
    k: Kind = request.param
    return k


@pytest.fixture
def connect(kind: Kind) -> Iterator[Callable[[str, Fleet], Client]]:
    made: list[Client] = []

    def make(url: str, fleet: Fleet) -> Client:
        made.append(Client(kind, url, fleet))
        return made[-1]

    yield make
    for c in made:
        c.close()


# ---------------------------------------------------------------------- the hops


def test_a_refused_connection_goes_at_once_to_the_next_server(connect: Callable[[str, Fleet], Client]) -> None:
    fleet = Fleet(a_1=dead, b_2=ok("b"))
    client = connect("http://a:1,b:2/v1/stream/s", fleet)
    resp = client.request(content=b"[1]")
    assert (resp.status_code, resp.json()) == (200, {"server": "b"})
    assert resp.request.url == "http://b:2/v1/stream/s"
    assert fleet.calls == ["a:1", "b:2"]
    assert fleet.host_headers[-1] == "b:2"
    client.request(content=b"[2]")
    assert fleet.calls == ["a:1", "b:2", "b:2"]  # the next request starts where the last was served
    assert client.transport.current == "http://b:2"


def test_a_follower_sends_the_request_to_the_leader_it_names(connect: Callable[[str, Fleet], Client]) -> None:
    fleet = Fleet(a_1=follower("http://c:3"), b_2=ok("b"), c_3=ok("c"))
    client = connect("http://a:1,b:2,c:3", fleet)
    resp = client.request(content=b"[1]")
    assert resp.json() == {"server": "c"}
    assert fleet.calls == ["a:1", "c:3"]
    assert client.transport.current == "http://c:3"


@pytest.mark.parametrize("leader", [None, "http://elsewhere:9"])
def test_a_follower_that_names_no_known_leader_sends_to_the_next(
    connect: Callable[[str, Fleet], Client], leader: str | None
) -> None:
    fleet = Fleet(a_1=follower(leader), b_2=follower(None), c_3=ok("c"))
    client = connect("http://a:1,b:2,c:3", fleet)
    assert client.request(content=b"[1]").json() == {"server": "c"}
    assert fleet.calls == ["a:1", "b:2", "c:3"]


def test_a_head_is_known_as_a_followers_by_its_header(connect: Callable[[str, Fleet], Client]) -> None:
    def head_follower(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, headers={"onceflow-leader": ""})  # a HEAD's answer has no body

    fleet = Fleet(a_1=head_follower, b_2=ok("b"))
    client = connect("http://a:1,b:2", fleet)
    assert client.request("HEAD").status_code == 200
    assert fleet.calls == ["a:1", "b:2"]


def test_another_503_is_the_answer(connect: Callable[[str, Fleet], Client]) -> None:
    def busy(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"code": "overloaded", "message": "try later"}})

    fleet = Fleet(a_1=busy, b_2=ok("b"))
    client = connect("http://a:1,b:2", fleet)
    resp = client.request(content=b"[1]")
    assert (resp.status_code, resp.json()["error"]["code"]) == (503, "overloaded")
    assert fleet.calls == ["a:1"]
    assert client.transport.current == "http://a:1"


@pytest.mark.parametrize("error", [httpx.ReadTimeout, httpx.RemoteProtocolError, httpx.ReadError])
def test_an_error_after_sending_is_raised_and_the_next_request_goes_on(
    connect: Callable[[str, Fleet], Client], error: type[httpx.TransportError]
) -> None:
    raised = error("the server went quiet")

    def hangs(request: httpx.Request) -> httpx.Response:
        raise raised

    fleet = Fleet(a_1=hangs, b_2=ok("b"))
    client = connect("http://a:1,b:2", fleet)
    with pytest.raises(error) as caught:
        client.request(content=b"[1]")
    assert caught.value is raised  # unchanged, for the caller's own retry rules
    assert fleet.calls == ["a:1"]  # not sent again by the transport
    assert client.transport.current == "http://b:2"
    assert client.request(content=b"[1]").json() == {"server": "b"}
    assert fleet.calls == ["a:1", "b:2"]


class _BreaksOff(httpx.SyncByteStream, httpx.AsyncByteStream):
    def __iter__(self) -> Iterator[bytes]:
        yield b'{"server": '
        raise httpx.ReadError("connection reset by peer")

    async def __aiter__(self) -> Any:
        yield b'{"server": '
        raise httpx.ReadError("connection reset by peer")


def test_a_body_that_breaks_off_moves_the_next_request_on(connect: Callable[[str, Fleet], Client]) -> None:
    fleet = Fleet(a_1=lambda request: httpx.Response(200, stream=_BreaksOff()), b_2=ok("b"))
    client = connect("http://a:1,b:2", fleet)
    with pytest.raises(httpx.ReadError):
        client.request("GET")
    assert client.request("GET").json() == {"server": "b"}
    assert fleet.calls == ["a:1", "b:2"]


def test_every_server_down_is_one_error_naming_them(connect: Callable[[str, Fleet], Client]) -> None:
    fleet = Fleet(a_1=dead, b_2=follower(None), c_3=dead)
    client = connect("http://a:1,b:2,c:3", fleet)
    with pytest.raises(NoServerError) as caught:
        client.request(content=b"[1]")
    assert isinstance(caught.value, httpx.ConnectError)  # the producers: stored by none, safe to resend
    message = str(caught.value)
    assert "http://a:1: ConnectError" in message
    assert "http://b:2: not the leader (it knows no leader)" in message
    assert "http://c:3: ConnectError" in message
    assert fleet.calls == ["a:1", "b:2", "c:3"]  # each once


def test_requests_to_other_urls_pass_untouched(connect: Callable[[str, Fleet], Client]) -> None:
    fleet = Fleet(a_1=dead, b_2=ok("b"), other_9=ok("other"))
    client = connect("http://a:1,b:2", fleet)
    assert client.request("GET", "http://other:9/hook").json() == {"server": "other"}
    assert fleet.calls == ["other:9"]


def test_a_silent_server_is_given_up_on_in_a_few_terms_not_a_minute(connect: Callable[[str, Fleet], Client]) -> None:
    """Issue 30, item 7: a frozen leader (SIGSTOP, a paused VM) takes the connection (its kernel
    does) and answers nothing; a client given several servers waited its whole read timeout
    (``Stream``'s 60 s) before moving on. Its waits for a server are now at most
    ``SILENT_SERVER`` seconds, a few lease terms (another server leads by then), unless the caller
    asked for less; a live read (long-poll, SSE) waits by design and keeps its own."""
    seen: list[tuple[str, dict[str, float | None]]] = []

    def record(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.params.get("live", ""), dict(request.extensions["timeout"])))
        return httpx.Response(200, json={})

    fleet = Fleet(a_1=record, b_2=record)
    client = connect("http://a:1,b:2/v1/stream/s", fleet)
    client.request("POST", content=b"[1]", timeout=httpx.Timeout(30.0, read=60.0))
    client.request("GET", params={"offset": "-1"}, timeout=httpx.Timeout(5.0, read=2.0))
    client.request("GET", params={"offset": "-1", "live": "long-poll"}, timeout=httpx.Timeout(30.0, read=60.0))
    client.request("GET", params={"offset": "-1", "live": "sse"}, timeout=httpx.Timeout(30.0, read=None))
    waits = {kind: [t[kind] for _, t in seen] for kind in ("connect", "read", "write")}
    assert waits["read"] == [SILENT_SERVER, 2.0, 60.0, None], seen
    assert waits["connect"] == [SILENT_SERVER, 5.0, SILENT_SERVER, SILENT_SERVER], seen
    assert waits["write"] == [SILENT_SERVER, 5.0, SILENT_SERVER, SILENT_SERVER], seen
    assert SILENT_SERVER <= 15.0  # a few terms of the default 3 s lease


def test_a_body_that_cannot_be_sent_again_gets_the_followers_answer() -> None:
    fleet = Fleet(a_1=follower("http://b:2"), b_2=ok("b"))
    client = Client("sync", "http://a:1,b:2", fleet)
    try:
        resp = client.request(content=iter([b"[1]"]))
        assert resp.status_code == 503
        assert fleet.calls == ["a:1"]
        assert client.request(content=b"[1]").json() == {"server": "b"}  # the next request moved on
    finally:
        client.close()


# ---------------------------------------------------------------------- the clients onceflow makes


def test_one_server_gets_a_plain_client() -> None:
    port = free_port()  # nothing listens there
    with http_client(f"http://127.0.0.1:{port}", timeout=5) as c, pytest.raises(httpx.ConnectError) as caught:
        c.get(f"http://127.0.0.1:{port}/v1/streams")
    assert not isinstance(caught.value, NoServerError)


def test_a_stream_with_every_server_down_names_them() -> None:
    ports = [free_port(), free_port()]
    url = f"http://127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}"
    with Stream.connect(url, "s") as s, pytest.raises(TransportError) as caught:
        s.head()
    assert caught.value.retriable
    for p in ports:
        assert f"http://127.0.0.1:{p}: ConnectError" in caught.value.message


@pytest.mark.anyio
async def test_the_async_client_fails_over_too() -> None:
    port = free_port()
    async with async_http_client(f"http://127.0.0.1:{port},127.0.0.1:{free_port()}", timeout=5) as c:
        with pytest.raises(NoServerError, match=f"127.0.0.1:{port}"):
            await c.get(request_url(f"http://127.0.0.1:{port}") + "/v1/streams")


# ---------------------------------------------------------------------- a real server


class FollowerStandIn:
    """A real HTTP server answering every request as a follower: 503 ``not_leader`` naming ``leader``."""

    def __init__(self, leader: str) -> None:
        body = json.dumps({"error": {"code": "not_leader", "message": "not the leader", "leader": leader}}).encode()
        self.requests = 0
        stand_in = self

        class Answer(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                stand_in.requests += 1
                self.rfile.read(int(self.headers.get("content-length") or 0))
                self.send_response(503)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.send_header("onceflow-leader", leader)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_HEAD = do_DELETE = _answer

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="follower", daemon=True)

    def __enter__(self) -> FollowerStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


def read_all(url: str, name: str) -> list[Any]:
    with Stream.connect(url, name) as s:
        return list(s.messages())


@pytest.mark.slow
def test_a_dead_server_first_in_the_list(server: ServerProcess) -> None:
    url = f"http://127.0.0.1:{free_port()},127.0.0.1:{server.port}"
    with Stream.connect(url, "orders") as s:
        s.create("application/json")
        assert s.url == f"{url}/v1/stream/orders"
    with IdempotentProducer(url, "orders", producer_id="p", epoch=1, linger_ms=1) as producer:
        for i in range(200):
            producer.append({"i": i})
        producer.flush()
        assert (producer.stats.acked, producer.stats.duplicates) == (200, 0)
    assert read_all(server.url, "orders") == [{"i": i} for i in range(200)]
    with Consumer(url, group="g", streams=["orders"], live=None) as consumer:
        assert [m.value for m in consumer] == [{"i": i} for i in range(200)]
    with AdminClient(url) as admin:
        assert [s["name"] for s in admin.get("/v1/streams")["streams"]] == ["orders"]


@pytest.mark.slow
def test_a_transaction_through_a_dead_server_and_a_follower(server: ServerProcess) -> None:
    for name in ("out", "in"):  # the offsets below name "in": offsets name streams that exist
        with Stream.connect(server.url, name) as s:
            s.create("application/json")
    with FollowerStandIn(server.url) as follower:
        url = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{follower.port}", server.url]
        with TransactionalProducer(url, "t") as producer:
            with producer.transaction():
                producer.extend("out", [{"i": i} for i in range(10)])
                producer.send_offsets_to_transaction("g", {"in": "0000000000000000_0000000000000010"})
        assert follower.requests >= 1
    assert read_all(server.url, "out") == [{"i": i} for i in range(10)]


@pytest.mark.slow
def test_a_lost_acknowledgement_is_resent_to_the_next_server_and_lands_once(server: ServerProcess) -> None:
    """Dead port, follower (naming the proxy as leader), a proxy that drops every POST's answer
    after the server stored it, the server itself: the producer's HEAD hops to the proxy; each
    POST through it is stored unanswered, so it is raised, the transport moves to the server,
    and the producer resends it with the same producer id, epoch and seq: a duplicate, dropped."""
    with Stream.connect(server.url, "orders") as s:
        s.create("application/json")
    proxy = FaultProxy(server.port, drop_every=1)
    proxy.start()
    try:
        with FollowerStandIn(proxy.url) as follower:
            url = f"http://127.0.0.1:{free_port()},127.0.0.1:{follower.port},127.0.0.1:{proxy.port},{server.url[7:]}"
            with IdempotentProducer(url, "orders", producer_id="p", epoch=1, linger_ms=1) as producer:
                for i in range(200):
                    producer.append({"i": i})
                producer.flush()
                stats = producer.stats
            assert follower.requests >= 1
    finally:
        proxy.stop()
    assert proxy.responses_dropped >= 1
    assert stats.duplicates >= 1
    assert stats.acked == 200
    assert read_all(server.url, "orders") == [{"i": i} for i in range(200)]


@pytest.fixture
def frozen_port() -> Iterator[int]:
    """A server that is frozen (SIGSTOP, a paused VM): its kernel accepts connections, nothing answers."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_server_that_accepts_and_never_answers_moves_the_next_request_on(
    server: ServerProcess, frozen_port: int, kind: Kind
) -> None:
    """The read timeout is raised (the request may have reached the server: not sent again
    elsewhere), and the next request goes to the next server."""
    url = f"http://127.0.0.1:{frozen_port},127.0.0.1:{server.port}"
    target = request_url(url) + "/v1/streams"
    timeout = httpx.Timeout(10.0, read=1.0)
    if kind == "sync":
        with http_client(url, timeout=timeout) as c:
            with pytest.raises(httpx.ReadTimeout):
                c.get(target)
            assert c.get(target).status_code == 200
    else:
        async with async_http_client(url, timeout=timeout) as ac:
            with pytest.raises(httpx.ReadTimeout):
                await ac.get(target)
            assert (await ac.get(target)).status_code == 200


@pytest.mark.anyio
async def test_a_transactional_append_that_only_followers_answered_is_aborted_with_a_new_epoch() -> None:
    """Every server a follower (a leader change under way): the append's attempts were carried to
    servers, and a copy of one can still land once a leader is up (a proxy that sends a request
    again, found by ``onceflow sim --cluster`` seed 103142: the copy opened the producer's next
    transaction under the same epoch, which then committed the aborted one's data in place of its
    own). So it is not "stored nowhere": the transaction is aborted by a new epoch, which fences
    any such copy, never by simply forgetting it."""
    inits: list[dict[str, Any]] = []

    def serve(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/init"):
            body = json.loads(request.content)
            inits.append(body)
            return httpx.Response(200, json={"producer_id": "p", "epoch": len(inits) - 1, "txn": 0})
        if request.method == "HEAD":
            return httpx.Response(200, headers={"content-type": "application/json"})
        error = {"error": {"code": "not_leader", "message": "no server holds the lease", "leader": None}}
        return httpx.Response(503, json=error, headers={"onceflow-leader": ""})

    servers = parse_servers("http://a:1,b:1")
    assert servers is not None
    client = httpx.AsyncClient(transport=AsyncFailoverTransport(servers, httpx.MockTransport(serve)))
    producer = AsyncTransactionalProducer(
        "http://a:1,b:1", "t", client=client, delivery_timeout=0.05, retry_backoff=(0.001, 0.002)
    )
    async with client:
        await producer.init()
        await producer.extend("s", [{"n": 1}])
        with pytest.raises(OnceflowError):
            await producer.flush()
        await producer.abort()
    assert len(inits) == 2 and inits[1].get("expected_epoch") == 0, inits  # a new epoch, naming the old one
    assert producer.epoch == 1
