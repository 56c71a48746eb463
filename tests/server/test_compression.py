"""Compressed appends and reads (issue 32, item 2; upstream Durable Streams issue #111): a body in
``Content-Encoding: gzip`` or ``zstd`` is decoded before it is checked, within ``--max-body`` as
decoded; a read answers in a coding the client accepts, when the answer is large enough to gain."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import zstandard

from helpers.servers import InProcess, ServerProcess
from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig
from onceflow.server.coding import BodyDecoder, Malformed, accepted_coding
from onceflow.server.guard import Guard, GuardConfig
from onceflow.wire import compress

S = "/v1/stream/"
JSON = {"content-type": "application/json"}
CODINGS = ("gzip", "zstd")
LIMIT = 64 * 1024  # the onceflow fixture's --max-body


def messages(n: int) -> list[dict[str, object]]:
    return [{"id": i, "user": f"user-{i % 50}", "event": "click", "amount": i * 0.25} for i in range(n)]


def body_of(values: list[dict[str, object]]) -> bytes:
    return json.dumps(values, separators=(",", ":")).encode()


def decoded(coding: str, data: bytes) -> bytes:
    return gzip.decompress(data) if coding == "gzip" else zstandard.ZstdDecompressor().decompressobj().decompress(data)


def producer(pid: str, seq: int) -> dict[str, str]:
    return {**JSON, "producer-id": pid, "producer-epoch": "0", "producer-seq": str(seq)}


async def tail(c: httpx.AsyncClient, name: str) -> str:
    return (await c.head(S + name)).headers["stream-next-offset"]


@pytest.mark.anyio
@pytest.mark.parametrize("coding", CODINGS)
async def test_a_compressed_append_reads_back_compressed_or_plain_as_asked(onceflow: InProcess, coding: str) -> None:
    c = onceflow.client
    values = messages(200)
    await c.put(S + "z", headers=JSON)
    r = await c.post(S + "z", content=compress(body_of(values), coding), headers={**JSON, "content-encoding": coding})
    assert r.status_code == 204, r.text
    coded = await c.get(S + "z", params={"offset": "-1"}, headers={"accept-encoding": coding})
    assert coded.headers["content-encoding"] == coding and coded.headers["vary"] == "accept-encoding"
    assert coded.json() == values  # httpx decoded it
    assert int(coded.headers["content-length"]) < len(body_of(values)) / 3  # what went on the wire
    plain = await c.get(S + "z", params={"offset": "-1"}, headers={"accept-encoding": "identity"})
    assert "content-encoding" not in plain.headers and plain.headers["vary"] == "accept-encoding"
    assert plain.content == coded.content == body_of(values)
    # the compressed answer's tag is the plain one's, weak: either revalidates either
    assert coded.headers["etag"] == "W/" + plain.headers["etag"]
    for held in (coded.headers["etag"], plain.headers["etag"]):
        for accept in (coding, "identity"):
            again = await c.get(
                S + "z", params={"offset": "-1"}, headers={"accept-encoding": accept, "if-none-match": held}
            )
            assert again.status_code == 304 and again.headers["vary"] == "accept-encoding"
    # a long-poll answer is compressed as a catch-up read is
    end = plain.headers["stream-next-offset"]
    await c.post(S + "z", content=body_of(values), headers=JSON)
    live = await c.get(S + "z", params={"offset": end, "live": "long-poll"}, headers={"accept-encoding": coding})
    assert live.status_code == 200 and live.headers["content-encoding"] == coding and live.json() == values


@pytest.mark.anyio
async def test_small_answers_and_live_and_head_answers_stay_plain(onceflow: InProcess) -> None:
    c = onceflow.client
    await c.put(S + "small", headers=JSON)
    await c.post(S + "small", content=b'[{"n":1}]', headers=JSON)
    r = await c.get(S + "small", params={"offset": "-1"}, headers={"accept-encoding": "gzip, zstd"})
    assert "content-encoding" not in r.headers and "vary" not in r.headers and r.content == b'[{"n":1}]'
    assert not r.headers["etag"].startswith("W/")
    await c.post(S + "small", content=body_of(messages(100)), headers=JSON)
    head = await c.head(S + "small", headers={"accept-encoding": "gzip"})
    assert "content-encoding" not in head.headers
    # SSE is never compressed (docs/protocol.md, "Compression": each event is shared by every reader)
    assert "content-encoding" not in await sse_headers(onceflow.app, "small", b"gzip, zstd")


async def sse_headers(app: App, name: str, accept: bytes) -> dict[str, str]:
    """The headers of an SSE read's answer, driven through the app until its first event."""
    headers: dict[str, str] = {}
    first = asyncio.Event()

    async def receive() -> dict[str, object]:
        await first.wait()
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        if message["type"] == "http.response.start":
            headers.update((k.decode(), v.decode()) for k, v in message["headers"])
        elif message.get("body"):
            first.set()

    scope = {
        "type": "http",
        "method": "GET",
        "path": S + name,
        "query_string": b"offset=-1&live=sse",
        "headers": [(b"accept-encoding", accept)],
    }
    await asyncio.wait_for(app(scope, receive, send), 30)
    return headers


@pytest.mark.anyio
async def test_records_reads_are_compressed_when_asked(onceflow: InProcess) -> None:
    c = onceflow.client
    await c.put(S + "rec", headers=JSON)
    await c.post(S + "rec", content=body_of(messages(100)), headers=JSON)
    params = {"offset": "-1", "format": "records"}
    plain = await c.get(S + "rec", params=params, headers={"accept-encoding": "identity"})
    coded = await c.get(S + "rec", params=params, headers={"accept-encoding": "zstd"})
    assert coded.headers["content-encoding"] == "zstd" and coded.content == plain.content
    assert "content-encoding" not in plain.headers and plain.headers["vary"] == coded.headers["vary"]


@pytest.mark.anyio
@pytest.mark.parametrize("coding", CODINGS)
async def test_a_zip_bomb_is_413_with_nothing_stored(onceflow: InProcess, coding: str) -> None:
    c = onceflow.client
    await c.put(S + "bomb", headers={"content-type": "text/plain"})
    before = await tail(c, "bomb")
    bomb = compress(b"a" * (64 * LIMIT), coding)
    assert len(bomb) < LIMIT
    r = await c.post(S + "bomb", content=bomb, headers={"content-type": "text/plain", "content-encoding": coding})
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    assert "decodes to more than" in r.json()["error"]["message"]

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the bound holds as the pieces come
        for i in range(0, len(bomb), 1000):
            yield bomb[i : i + 1000]

    r = await c.post(S + "bomb", content=chunked(), headers={"content-type": "text/plain", "content-encoding": coding})
    assert r.status_code == 413
    # exactly the limit decoded is taken
    r = await c.post(
        S + "bomb",
        content=compress(b"a" * LIMIT, coding),
        headers={"content-type": "text/plain", "content-encoding": coding},
    )
    assert r.status_code == 204
    r = await c.get(S + "bomb", params={"offset": before})
    assert r.content == b"a" * LIMIT


@pytest.mark.anyio
@pytest.mark.parametrize("coding", CODINGS)
async def test_a_malformed_compressed_body_is_400_with_nothing_stored(onceflow: InProcess, coding: str) -> None:
    c = onceflow.client
    await c.put(S + "bad", headers=JSON)
    before = await tail(c, "bad")
    whole = compress(body_of(messages(50)), coding)
    for body, why in (
        (b"this is not compressed", f"not valid {coding}"),
        (whole[: len(whole) // 2], f"ends before its last {'member' if coding == 'gzip' else 'frame'}"),
        (whole + b"trailing junk", f"not valid {coding}"),
        (compress(b'[{"n":', coding), "invalid JSON"),  # decoded, then checked as JSON
    ):
        r = await c.post(S + "bad", content=body, headers={**JSON, "content-encoding": coding})
        assert r.status_code == 400 and why in r.json()["error"]["message"], (why, r.text)
    assert await tail(c, "bad") == before
    assert (await c.get(S + "bad", params={"offset": "-1"})).json() == []


@pytest.mark.anyio
async def test_unknown_codings_and_coded_control_bodies_are_415_naming_the_codings(onceflow: InProcess) -> None:
    c = onceflow.client
    await c.put(S + "u", headers=JSON)
    for value in ("br", "deflate", "gzip, zstd"):
        r = await c.post(S + "u", content=b"[1]", headers={**JSON, "content-encoding": value})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_encoding", value
        assert r.headers["accept-encoding"] == "gzip, zstd" and "gzip, zstd" in r.json()["error"]["message"]
    coded_init = gzip.compress(b'{"timeout_ms": 1000}')
    r = await c.post("/v1/txn/t1/init", content=coded_init, headers={**JSON, "content-encoding": "gzip"})
    assert r.status_code == 415 and "appends and creates of streams only" in r.json()["error"]["message"]
    # identity is no coding; a coded create is taken as an append is
    assert (await c.post(S + "u", content=b"[1]", headers={**JSON, "content-encoding": "identity"})).status_code == 204
    r = await c.put(S + "made", content=gzip.compress(b"[1,2]"), headers={**JSON, "content-encoding": "gzip"})
    assert r.status_code == 201 and (await c.get(S + "made", params={"offset": "-1"})).json() == [1, 2]
    assert (await c.get(S + "u", params={"offset": "-1"})).json() == [1]


@pytest.mark.anyio
async def test_a_compressed_retry_dedups_against_the_plain_append_and_back(onceflow: InProcess) -> None:
    c = onceflow.client
    await c.put(S + "idem", headers=JSON)
    first, second = body_of(messages(30)), body_of(messages(31))
    r = await c.post(S + "idem", content=first, headers=producer("p", 0))
    assert r.status_code == 200
    retry = await c.post(
        S + "idem", content=compress(first, "gzip"), headers={**producer("p", 0), "content-encoding": "gzip"}
    )
    assert retry.status_code == 204 and retry.headers["stream-next-offset"] == r.headers["stream-next-offset"]
    r = await c.post(
        S + "idem", content=compress(second, "zstd"), headers={**producer("p", 1), "content-encoding": "zstd"}
    )
    assert r.status_code == 200
    retry = await c.post(S + "idem", content=second, headers=producer("p", 1))
    assert retry.status_code == 204 and retry.headers["stream-next-offset"] == r.headers["stream-next-offset"]
    assert (await c.get(S + "idem", params={"offset": "-1"})).json() == messages(30) + messages(31)


@pytest.mark.anyio
async def test_a_compressed_transactional_append_commits_as_a_plain_one(onceflow: InProcess) -> None:
    c = onceflow.client
    await c.put(S + "tx", headers=JSON)
    meta = (await c.post("/v1/txn/t/init", json={})).json()
    headers = {
        **JSON,
        "producer-id": meta["producer_id"],
        "producer-epoch": str(meta["epoch"]),
        "transaction-id": "t",
        "content-encoding": "gzip",
    }
    values = messages(40)
    r = await c.post(S + "tx", content=compress(body_of(values), "gzip"), headers={**headers, "producer-seq": "0"})
    assert r.status_code == 200, r.text
    txn = int(r.headers["transaction-number"])
    assert (await c.get(S + "tx", params={"offset": "-1"})).json() == []  # not committed yet
    retry = await c.post(
        S + "tx", content=body_of(values), headers={**headers, "producer-seq": "0", "content-encoding": "identity"}
    )
    assert retry.status_code == 204
    r = await c.post("/v1/txn/t/commit", json={"epoch": meta["epoch"], "txn": txn})
    assert r.status_code == 200, r.text
    assert (await c.get(S + "tx", params={"offset": "-1"})).json() == values


@pytest.mark.anyio
async def test_the_guard_refuses_a_coded_control_body_as_the_app_does(tmp_path: Path) -> None:
    broker = Broker(tmp_path / "data")
    broker.open()
    app = App(broker, AppConfig())
    guard = Guard(app, broker, GuardConfig.from_json({"tokens": {"w": [{"prefix": "", "scopes": ["read", "write"]}]}}))
    auth = {"authorization": "Bearer w"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://t") as c:
        r = await c.post(
            "/v1/groups/g/offsets", content=gzip.compress(b"{}"), headers={**auth, **JSON, "content-encoding": "gzip"}
        )
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_encoding"
        assert r.headers["accept-encoding"] == "gzip, zstd"
        assert (await c.put(S + "g", headers={**auth, **JSON})).status_code == 201
        r = await c.post(S + "g", content=gzip.compress(b"[1]"), headers={**auth, **JSON, "content-encoding": "gzip"})
        assert r.status_code == 204
    await broker.close()


def test_a_chunked_bomb_on_the_wire_is_413_before_it_is_all_sent(tmp_path: Path) -> None:
    """Through onceflow's own HTTP server, chunked (no length to refuse it by): the answer comes as
    soon as the decoded bytes pass --max-body, though the client has not sent the rest of the body
    (it never does here), and the connection closes; nothing is stored."""
    srv = ServerProcess(tmp_path / "data", "--max-body", "1MiB")
    srv.start()
    try:
        assert httpx.put(f"{srv.url}{S}w", headers={"content-type": "text/plain"}).status_code == 201
        bomb = compress(b"\0" * (64 << 20), "gzip")
        start = bomb[: 64 << 10]  # decodes to about 14 MiB
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(
                f"POST {S}w HTTP/1.1\r\nhost: x\r\ncontent-type: text/plain\r\ncontent-encoding: gzip\r\n"
                "transfer-encoding: chunked\r\n\r\n".encode()
            )
            for i in range(0, len(start), 4096):
                s.sendall(b"%x\r\n%s\r\n" % (len(start[i : i + 4096]), start[i : i + 4096]))
            answer = b""
            while b"\r\n\r\n" not in answer:
                more = s.recv(65536)
                assert more, answer
                answer += more
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
        assert b"connection: close" in answer.lower()
        assert httpx.get(f"{srv.url}{S}w", params={"offset": "-1"}).content == b""
    finally:
        srv.kill()


def test_the_decoder_tells_a_cut_body_at_every_cut_and_reads_members_and_frames_in_a_row() -> None:
    for coding in CODINGS:
        first = compress(b"hello " * 300, coding)
        whole = first + compress(b"world", coding)
        for cut in range(1, len(whole)):
            if cut == len(first):
                continue  # one whole member or frame: a complete body
            d = BodyDecoder(coding, 1 << 20)  # type: ignore[arg-type]
            d.feed(whole[:cut])
            with pytest.raises(Malformed):
                d.end()
        d = BodyDecoder(coding, 1 << 20)  # type: ignore[arg-type]
        for i in range(0, len(whole), 7):
            d.feed(whole[i : i + 7])
        assert d.end() == b"hello " * 300 + b"world"


def test_accept_encoding_is_read_by_its_weights() -> None:
    assert accepted_coding(None) is None and accepted_coding("") is None and accepted_coding("identity") is None
    assert accepted_coding("gzip, deflate") == "gzip" and accepted_coding("x-gzip") == "gzip"
    assert accepted_coding("gzip, deflate, zstd") == "zstd"  # a tie goes to zstd
    assert accepted_coding("gzip;q=1, zstd;q=0.5") == "gzip"
    assert accepted_coding("zstd;q=0, *") == "gzip" and accepted_coding("*;q=0") is None
    assert accepted_coding("br") is None and accepted_coding("gzip;q=nonsense") is None
    assert accepted_coding("gzip;q=0.5, identity") is None and accepted_coding("gzip, identity;q=0.5") == "gzip"


@pytest.mark.anyio
async def test_with_compress_min_off_no_answer_is_compressed(tmp_path: Path) -> None:
    broker = Broker(tmp_path / "data")
    broker.open()
    app = App(broker, AppConfig(compress_min_bytes=None))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        await c.put(S + "off", headers=JSON)
        await c.post(S + "off", content=body_of(messages(200)), headers=JSON)
        r = await c.get(S + "off", params={"offset": "-1"}, headers={"accept-encoding": "gzip"})
        assert r.json() == messages(200) and "content-encoding" not in r.headers and "vary" not in r.headers
    await broker.close()


def test_a_zstd_frame_that_needs_a_window_over_8_mib_is_refused() -> None:
    """RFC 9659: the zstd content coding's window is at most 8 MiB; the decoder allocates what a
    frame asks for, so a larger one is refused before any of it is decoded."""
    params = zstandard.ZstdCompressionParameters.from_level(1, window_log=24, write_content_size=False)  # 16 MiB
    big = zstandard.ZstdCompressor(compression_params=params).compress(b"\0" * (20 << 20))
    d = BodyDecoder("zstd", 1 << 30)
    d.feed(big)
    with pytest.raises(Malformed, match="not valid zstd"):
        d.end()
    assert d.size == 0


def test_compress_min_takes_a_size_or_off() -> None:
    from onceflow.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["serve"]).compress_min == 1024
    assert parse(["serve", "--compress-min", "4KiB"]).compress_min == 4096
    assert parse(["serve", "--compress-min", "off"]).compress_min is None
