"""The client's ``compression=`` (issue 32, item 2): appends go compressed, reads ask for compressed
answers, against a real server; without it, nothing is compressed either way."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from helpers.servers import ServerProcess
from onceflow.client import (
    AsyncConsumer,
    AsyncIdempotentProducer,
    AsyncStream,
    Stream,
    TransactionalProducer,
)
from onceflow.client._transport import LeanAsyncTransport
from onceflow.client.lowlevel import async_http_client, stream_url


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    srv = ServerProcess(tmp_path_factory.mktemp("compression") / "data")
    srv.start()
    try:
        yield srv.url
    finally:
        srv.kill()


def events(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"id": i, "user": f"user-{i % 97}", "event": "view", "path": f"/items/{i % 13}"} for i in range(start, n)]


class Wire:
    """What went over the wire: each request's method, Content-Encoding and body size, and each
    answer's Content-Encoding and size as received (before httpx decodes it)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str | None, int]] = []
        self.got: list[tuple[str, str | None, str | None]] = []

    def request(self, request: httpx.Request) -> None:
        self.sent.append((request.method, request.headers.get("content-encoding"), len(request.content)))

    def response(self, response: httpx.Response) -> None:
        r = response.request
        self.got.append((r.method, r.headers.get("accept-encoding"), response.headers.get("content-encoding")))

    async def arequest(self, request: httpx.Request) -> None:
        self.request(request)

    async def aresponse(self, response: httpx.Response) -> None:
        self.response(response)

    def sync_client(self) -> httpx.Client:
        return httpx.Client(timeout=30, event_hooks={"request": [self.request], "response": [self.response]})

    def async_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=30, event_hooks={"request": [self.arequest], "response": [self.aresponse]})


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
def test_a_stream_with_compression_appends_and_reads_compressed(base: str, compression: Any) -> None:
    wire = Wire()
    with wire.sync_client() as c, Stream.connect(base, f"cs-{compression}", client=c, compression=compression) as s:
        s.create("application/json")
        s.append_many(events(300))
        s.append({"small": True})  # below 1 KiB: sent as it is
        chunk = s.read()
        assert chunk.messages() == [*events(300), {"small": True}]
    posts = [w for w in wire.sent if w[0] == "POST"]
    assert posts[0][1] == compression and posts[0][2] < len(json.dumps(events(300))) / 3
    assert posts[1][1] is None
    assert wire.got[-1] == ("GET", compression, compression)


def test_without_compression_nothing_is_compressed_either_way(base: str) -> None:
    wire = Wire()
    with Stream.connect(base, "cs-plain") as s:
        s._client.event_hooks = {"request": [wire.request], "response": [wire.response]}
        s.create("application/json")
        s.append_many(events(300))
        assert s.read().messages() == events(300)
    assert [w[:2] for w in wire.sent] == [("PUT", None), ("POST", None), ("GET", None)]
    assert wire.got[-1] == ("GET", "identity", None)  # the client made by the factory asks for no coding
    with pytest.raises(ValueError, match="compression must be 'gzip' or 'zstd' or None"):
        Stream.connect(base, "cs-plain", compression="br")  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_producer_with_compression_sends_each_batch_compressed_once(base: str) -> None:
    wire = Wire()
    async with wire.async_client() as c:
        async with AsyncStream.connect(base, "cs-producer", client=c) as s:
            await s.create("application/json")
        async with AsyncIdempotentProducer(
            base, "cs-producer", content_type="application/json", compression="zstd", client=c, max_batch_bytes=8192
        ) as p:
            p.extend(events(1000))
            await p.flush()
            plain = len(json.dumps(events(1000), separators=(",", ":")))
            assert p.stats.body_bytes < plain / 3
        async with AsyncStream.connect(base, "cs-producer", client=c, compression="gzip") as s:
            got = [m async for m in s.messages()]
    assert got == events(1000)
    posts = [w for w in wire.sent if w[0] == "POST"]
    assert len(posts) > 1 and all(coding == "zstd" for _, coding, _ in posts)


def test_a_transactional_producer_with_compression_commits_what_it_sent(base: str) -> None:
    with Stream.connect(base, "cs-txn") as s:
        s.create("application/json")
    wire = Wire()
    with TransactionalProducer(base, "cs-t", compression="gzip") as p:
        p._core._client.event_hooks = {"request": [wire.arequest], "response": [wire.aresponse]}
        with p.transaction():
            p.extend("cs-txn", events(500))
    with Stream.connect(base, "cs-txn") as s:
        assert s.read().messages() == events(500)
    appends = [w for w in wire.sent if w[0] == "POST" and w[1] is not None]
    assert appends and all(w[1] == "gzip" for w in appends)


@pytest.mark.anyio
async def test_a_consumer_with_compression_reads_compressed_answers(base: str) -> None:
    with Stream.connect(base, "cs-consumer") as s:
        s.create("application/json")
        s.append_many(events(300))
    wire = Wire()
    async with wire.async_client() as c:
        consumer = AsyncConsumer(base, group="g", streams=["cs-consumer"], live=None, client=c, compression="gzip")
        async with consumer:
            got: list[Any] = []
            while len(got) < 300:
                got += [m.value for m in await asyncio.wait_for(consumer.poll(), 30)]
    assert got == events(300)
    reads = [w for w in wire.got if w[0] == "GET" and w[2] is not None]
    assert reads and all(w[1:] == ("gzip", "gzip") for w in reads)


@pytest.mark.anyio
async def test_the_lean_transport_reads_compressed_answers(base: str) -> None:
    """The asyncio clients onceflow makes for http:// go through its own transport (client/_transport.py);
    httpx decodes above it."""
    async with AsyncStream.connect(base, "cs-lean", compression="zstd") as s:
        await s.create("application/json")
        await s.append_many(events(300))
        assert (await s.read()).messages() == events(300)
    async with async_http_client(base, timeout=30) as c:
        assert isinstance(c._transport, LeanAsyncTransport)
        r = await c.get(stream_url(base, "cs-lean"), params={"offset": "-1"}, headers={"accept-encoding": "zstd"})
    assert r.headers["content-encoding"] == "zstd" and r.json() == events(300)
