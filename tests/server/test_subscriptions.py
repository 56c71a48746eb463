"""The reserved subscription APIs (PROTOCOL.md sections 6-7): webhooks, pull-wake, fencing, leases."""

from __future__ import annotations

import asyncio
import base64
import errno
import json
import random
import re
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from helpers.servers import ServerProcess
from onceflow.core.broker import Broker
from onceflow.core.subscriptions import glob_match
from onceflow.server.app import App, AppConfig
from onceflow.storage.fs import OsFileSystem
from onceflow_tools.sim.disk import SimDisk

pytestmark = pytest.mark.anyio

ROOT = "/v1/stream"
SUBS = f"{ROOT}/__ds/subscriptions"
JSON = {"content-type": "application/json"}


@dataclass
class Served:
    broker: Broker
    app: App
    client: httpx.AsyncClient


@pytest.fixture
async def srv(tmp_path: Path) -> AsyncIterator[Served]:
    broker = Broker(tmp_path / "data")
    broker.open()
    app = App(broker, AppConfig(long_poll_timeout=0.3, webhook_targets="loopback"))  # receivers listen on 127.0.0.1
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        yield Served(broker, app, client)
    await app.subscriptions.close()
    await broker.close()


@dataclass
class Receiver:
    """A webhook endpoint on 127.0.0.1 that records requests and answers from a script."""

    url: str = ""
    requests: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    answers: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # consumed first; then 200 {}
    before_answer: Callable[[dict[str, Any]], Awaitable[None]] | None = None  # runs before the response

    async def next(self, timeout: float = 5.0) -> tuple[dict[str, str], dict[str, Any], bytes]:
        """The latest request, waiting for a first one."""
        deadline = time.monotonic() + timeout
        while not self.requests:
            assert time.monotonic() < deadline, "no webhook request arrived"
            await asyncio.sleep(0.02)
        headers, raw = self.requests[-1]
        return headers, json.loads(raw), raw


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    rec = Receiver()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")[1:]
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines if ln)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            rec.requests.append((headers, body))
            if rec.before_answer is not None:
                await rec.before_answer(json.loads(body))
            status, answer = rec.answers.pop(0) if rec.answers else (200, {})
            payload = json.dumps(answer).encode()
            writer.write(
                f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n"
                f"connection: close\r\n\r\n".encode()
                + payload
            )
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    rec.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook"
    try:
        yield rec
    finally:
        server.close()
        await server.wait_closed()


async def wait_for(cond: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def put_stream(c: httpx.AsyncClient, name: str, body: Any = None) -> None:
    r = await c.put(f"{ROOT}/{name}", headers=JSON, content=json.dumps(body) if body is not None else b"")
    assert r.status_code == 201, r.text


async def append(c: httpx.AsyncClient, name: str, body: Any) -> None:
    r = await c.post(f"{ROOT}/{name}", headers=JSON, content=json.dumps(body))
    assert r.status_code in (200, 204), r.text


async def tail(c: httpx.AsyncClient, name: str) -> str:
    r = await c.head(f"{ROOT}/{name}")
    return r.headers["stream-next-offset"]


async def wake_events(c: httpx.AsyncClient, wake_stream: str, sid: str) -> list[dict[str, Any]]:
    r = await c.get(f"{ROOT}/{wake_stream}", params={"offset": "-1"})
    return [e for e in r.json() if e.get("subscription_id") == sid]


async def pull_sub(
    c: httpx.AsyncClient, sid: str, *, pattern: str = "events/*", wake: str = "wake/pool", ttl: int = 30_000
) -> None:
    if (await c.head(f"{ROOT}/{wake}")).status_code == 404:
        await put_stream(c, wake)
    r = await c.put(
        f"{SUBS}/{sid}", json={"type": "pull-wake", "pattern": pattern, "wake_stream": wake, "lease_ttl_ms": ttl}
    )
    assert r.status_code == 201, r.text


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def stream_info(body: dict[str, Any], path: str) -> dict[str, Any]:
    return next(s for s in body["streams"] if s["path"] == path)


# ---------------------------------------------------------------------- configuration


async def test_create_reconfirm_conflict_get_delete(srv: Served) -> None:
    c = srv.client
    config = {
        "type": "pull-wake",
        "pattern": "events/**",
        "streams": ["other/x"],
        "wake_stream": "wake/a",
        "lease_ttl_ms": 5000,
        "description": "d",
    }
    r = await c.put(f"{SUBS}/s1", json=config)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["id"] == body["subscription_id"] == "s1"
    assert body["type"] == "pull-wake" and body["pattern"] == "events/**" and body["wake_stream"] == "wake/a"
    assert body["streams"] == [{"path": "other/x", "link_type": "explicit", "acked_offset": "-1"}]
    assert body["status"] == "active" and body["lease_ttl_ms"] == 5000 and body["webhook"] is None
    # the same configuration (streams in another order, slashes around paths) re-confirms
    r = await c.put(f"{SUBS}/s1", json={**config, "streams": ["/other/x/"]})
    assert r.status_code == 200
    r = await c.put(f"{SUBS}/s1", json={**config, "lease_ttl_ms": 6000})
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "SUBSCRIPTION_ALREADY_EXISTS"
    assert (await c.get(f"{SUBS}/s1")).json()["lease_ttl_ms"] == 5000
    assert (await c.delete(f"{SUBS}/s1")).status_code == 204
    assert (await c.delete(f"{SUBS}/s1")).status_code == 204  # idempotent
    r = await c.get(f"{SUBS}/s1")
    assert r.status_code == 404 and r.json()["error"]["code"] == "SUBSCRIPTION_NOT_FOUND"


async def test_jwks_and_webhook_signing_metadata(srv: Served, receiver: Receiver) -> None:
    c = srv.client
    r = await c.get(f"{ROOT}/__ds/jwks.json")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/jwk-set+json")
    assert "max-age=300" in r.headers["cache-control"]
    (key,) = r.json()["keys"]
    assert key["kty"] == "OKP" and key["crv"] == "Ed25519" and key["alg"] == "EdDSA" and key["kid"].startswith("ds_")
    r = await c.put(f"{SUBS}/hook", json={"type": "webhook", "pattern": "events/*", "webhook": {"url": receiver.url}})
    assert r.status_code == 201
    signing = r.json()["webhook"]["signing"]
    assert signing == {"alg": "ed25519", "kid": key["kid"], "jwks_url": f"http://testserver{ROOT}/__ds/jwks.json"}
    assert "secret" not in r.text


def test_glob_rules() -> None:
    def m(p: str, s: str) -> bool:
        return glob_match(tuple(p.split("/")), s)

    assert m("events/*", "events/a")
    assert not m("events/*", "events/a/b")
    assert not m("events/*", "events")
    assert m("events/**", "events")
    assert m("events/**", "events/a/b/c")
    assert m("**/x", "x") and m("**/x", "a/b/x") and not m("**/x", "a/x/b")
    assert m("a/**/z", "a/z") and m("a/**/z", "a/b/c/z") and not m("a/**/z", "a/b/c")
    assert m("*/b/*", "a/b/c") and not m("*/b/*", "a/c/c")
    assert m("**", "anything/at/all")


# The webhook URL policy and delivery checks: tests/core/test_webhook_targets.py


BAD_CREATES: list[tuple[object, str, str]] = [
    ("not json", "INVALID_REQUEST", "not valid JSON"),
    ([1, 2], "INVALID_REQUEST", "JSON object"),
    ({"pattern": "events/*"}, "INVALID_REQUEST", '"type"'),
    ({"type": "queue", "pattern": "events/*"}, "INVALID_REQUEST", '"type"'),
    ({"type": "pull-wake", "wake_stream": "w"}, "INVALID_REQUEST", '"pattern" or a non-empty "streams"'),
    ({"type": "pull-wake", "pattern": "ev*", "wake_stream": "w"}, "INVALID_REQUEST", "whole path segments"),
    ({"type": "pull-wake", "pattern": "a//b", "wake_stream": "w"}, "INVALID_REQUEST", "segment"),
    ({"type": "pull-wake", "pattern": "__ds/*", "wake_stream": "w"}, "INVALID_REQUEST", "reserved"),
    ({"type": "pull-wake", "streams": "a", "wake_stream": "w"}, "INVALID_REQUEST", "array"),
    ({"type": "pull-wake", "streams": ["a/../b"], "wake_stream": "w"}, "INVALID_REQUEST", "streams[0]"),
    ({"type": "pull-wake", "streams": [7], "wake_stream": "w"}, "INVALID_REQUEST", "streams[0]"),
    ({"type": "pull-wake", "pattern": "e/*"}, "INVALID_REQUEST", "wake_stream"),
    ({"type": "pull-wake", "streams": ["w"], "wake_stream": "w"}, "INVALID_REQUEST", "wake stream"),
    (
        {"type": "pull-wake", "pattern": "e/*", "wake_stream": "w", "lease_ttl_ms": 999},
        "INVALID_REQUEST",
        "lease_ttl_ms",
    ),
    (
        {"type": "pull-wake", "pattern": "e/*", "wake_stream": "w", "lease_ttl_ms": 600_001},
        "INVALID_REQUEST",
        "lease_ttl_ms",
    ),
    (
        {"type": "pull-wake", "pattern": "e/*", "wake_stream": "w", "lease_ttl_ms": "30000"},
        "INVALID_REQUEST",
        "lease_ttl_ms",
    ),
    ({"type": "pull-wake", "pattern": "e/*", "wake_stream": "w", "description": 5}, "INVALID_REQUEST", "description"),
    (
        {"type": "pull-wake", "pattern": "e/*", "wake_stream": "w", "webhook": {"url": "http://127.0.0.1/"}},
        "INVALID_REQUEST",
        "webhook",
    ),
    ({"type": "webhook", "pattern": "e/*"}, "INVALID_REQUEST", "webhook"),
    ({"type": "webhook", "pattern": "e/*", "webhook": {}}, "INVALID_REQUEST", "webhook"),
    (
        {"type": "webhook", "pattern": "e/*", "webhook": {"url": "http://10.0.0.1/hook"}},
        "WEBHOOK_URL_REJECTED",
        "10.0.0.1",
    ),
    (
        {"type": "webhook", "pattern": "e/*", "webhook": {"url": "http://127.0.0.1/"}, "wake_stream": "w"},
        "INVALID_REQUEST",
        "wake_stream",
    ),
]


@pytest.mark.parametrize(("body", "code", "says"), BAD_CREATES)
async def test_bad_create_is_400_with_reason(srv: Served, body: object, code: str, says: str) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    r = await srv.client.put(f"{SUBS}/bad", headers=JSON, content=content)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code
    assert says in err["message"], err["message"]
    assert (await srv.client.get(f"{SUBS}/bad")).status_code == 404


async def test_bad_routes_and_methods(srv: Served) -> None:
    c = srv.client
    await pull_sub(c, "p")
    cases = [
        (c.get(f"{ROOT}/__ds"), 404, "NOT_FOUND"),
        (c.get(f"{ROOT}/__ds/nope"), 404, "NOT_FOUND"),
        (c.get(f"{SUBS}/p/whatever"), 404, "NOT_FOUND"),
        (c.post(f"{SUBS}/p"), 405, "METHOD_NOT_ALLOWED"),
        (c.post(f"{ROOT}/__ds/jwks.json"), 405, "METHOD_NOT_ALLOWED"),
        (c.get(f"{SUBS}/p/claim"), 405, "METHOD_NOT_ALLOWED"),
        (c.post(f"{SUBS}/missing/claim", json={"worker": "w"}), 404, "SUBSCRIPTION_NOT_FOUND"),
        (c.post(f"{SUBS}/p/claim", json={}), 400, "INVALID_REQUEST"),
        (c.post(f"{SUBS}/p/claim", json={"worker": ""}), 400, "INVALID_REQUEST"),
        (c.post(f"{SUBS}/p/claim", headers=JSON, content=b"{"), 400, "INVALID_REQUEST"),
        (c.post(f"{SUBS}/p/ack", json={"wake_id": "w", "generation": 1}), 401, "TOKEN_INVALID"),
        (
            c.post(f"{SUBS}/p/ack", json={"wake_id": "w", "generation": 1}, headers=bearer("garbage")),
            401,
            "TOKEN_INVALID",
        ),
        (c.post(f"{SUBS}/p/ack", json={"generation": 1}, headers=bearer("v1.x.y")), 400, "INVALID_REQUEST"),
        (
            c.post(f"{SUBS}/p/ack", json={"wake_id": "w", "generation": "1"}, headers=bearer("x")),
            400,
            "INVALID_REQUEST",
        ),
        (
            c.post(f"{SUBS}/p/release", json={"wake_id": "w", "generation": 1}, headers=bearer("v1.AA.AA")),
            401,
            "TOKEN_INVALID",
        ),
        (
            c.post(f"{SUBS}/p/callback", json={"wake_id": "w", "generation": 1}, headers=bearer("x")),
            400,
            "INVALID_REQUEST",
        ),
        (c.post(f"{SUBS}/p/streams", json={"streams": []}), 400, "INVALID_REQUEST"),
        (c.post(f"{SUBS}/p/streams", json={"streams": ["wake/pool"]}), 400, "INVALID_REQUEST"),
        (c.delete(f"{SUBS}/p/streams/a%2F..%2Fb"), 400, "INVALID_REQUEST"),
        (c.put(f"{SUBS}/p", headers=JSON, content=b"x" * (2 << 20)), 413, "PAYLOAD_TOO_LARGE"),
    ]
    for request, status, code in cases:
        r = await request
        assert r.status_code == status, (r.request.method, r.request.url, r.text)
        assert r.json()["error"]["code"] == code, r.text
        assert r.json()["error"]["message"]
    # a stream under __ds cannot be created or read
    assert (await c.put(f"{ROOT}/__ds/x")).status_code in (404, 405)


# ---------------------------------------------------------------------- pull-wake


async def test_pull_wake_claim_is_exclusive_and_ack_advances(srv: Served) -> None:
    c = srv.client
    await put_stream(c, "events/old", {"n": 0})  # existing: linked at its tail, not replayed
    await pull_sub(c, "p")
    sub = (await c.get(f"{SUBS}/p")).json()
    assert stream_info(sub, "events/old")["acked_offset"] == await tail(c, "events/old")
    r = await c.post(f"{SUBS}/p/claim", json={"worker": "w1"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "NO_PENDING_WORK"

    await put_stream(c, "events/a", {"n": 1})  # a new matching stream: its first data is pending
    await wait_for(lambda: _has_events(c, "wake/pool", "p", 1))
    (event,) = await wake_events(c, "wake/pool", "p")
    assert event["type"] == "wake" and event["stream"] == "events/a" and event["generation"] == 1

    r = await c.post(f"{SUBS}/p/claim", json={"worker": "w1"})
    assert r.status_code == 200, r.text
    claim = r.json()
    assert claim["generation"] == 1 and claim["lease_ttl_ms"] == 30_000
    a = next(s for s in claim["streams"] if s["path"] == "events/a")
    assert a["has_pending"] is True and a["acked_offset"] == "-1" and a["tail_offset"] == await tail(c, "events/a")

    r = await c.post(f"{SUBS}/p/claim", json={"worker": "w2"})
    assert r.status_code == 409
    assert r.json()["error"] | {"message": ""} == {
        "code": "ALREADY_CLAIMED",
        "current_holder": "w1",
        "generation": 1,
        "message": "",
    }

    reply = {"wake_id": claim["wake_id"], "generation": 1}
    r = await c.post(f"{SUBS}/p/ack", json=reply, headers=bearer(claim["token"]))  # heartbeat
    assert r.json() == {"ok": True, "next_wake": False}
    r = await c.post(
        f"{SUBS}/p/ack",
        json={**reply, "acks": [{"stream": "events/a", "offset": a["tail_offset"]}], "done": True},
        headers=bearer(claim["token"]),
    )
    assert r.status_code == 200 and r.json() == {"ok": True, "next_wake": False}
    assert stream_info((await c.get(f"{SUBS}/p")).json(), "events/a")["acked_offset"] == a["tail_offset"]
    # the wake is over: its token is fenced
    r = await c.post(f"{SUBS}/p/ack", json=reply, headers=bearer(claim["token"]))
    assert r.status_code == 409 and r.json()["error"]["code"] == "FENCED"

    await append(c, "events/a", {"n": 2})
    await wait_for(lambda: _has_events(c, "wake/pool", "p", 2))
    r = await c.post(f"{SUBS}/p/claim", json={"worker": "w2"})
    claim2 = r.json()
    assert claim2["generation"] == 2
    a2 = next(s for s in claim2["streams"] if s["path"] == "events/a")
    assert a2["acked_offset"] == a["tail_offset"] and a2["has_pending"] is True


async def _has_events(c: httpx.AsyncClient, wake: str, sid: str, n: int) -> bool:
    return len(await wake_events(c, wake, sid)) >= n


async def test_ack_done_with_more_pending_wakes_again(srv: Served) -> None:
    c = srv.client
    await pull_sub(c, "p")
    await put_stream(c, "events/a", {"n": 1})
    claim = (await c.post(f"{SUBS}/p/claim", json={"worker": "w1"})).json()
    first_tail = stream_info(claim, "events/a")["tail_offset"]
    await append(c, "events/a", {"n": 2})  # arrives while the wake is held
    r = await c.post(
        f"{SUBS}/p/ack",
        headers=bearer(claim["token"]),
        json={
            "wake_id": claim["wake_id"],
            "generation": claim["generation"],
            "done": True,
            "acks": [{"stream": "events/a", "offset": first_tail}],
        },
    )
    assert r.json() == {"ok": True, "next_wake": True}
    claim2 = (await c.post(f"{SUBS}/p/claim", json={"worker": "w2"})).json()
    assert claim2["generation"] == claim["generation"] + 1
    assert stream_info(claim2, "events/a")["acked_offset"] == first_tail


async def test_release_hands_the_work_to_another_worker(srv: Served) -> None:
    c = srv.client
    await pull_sub(c, "p")
    await put_stream(c, "events/a", {"n": 1})
    claim = (await c.post(f"{SUBS}/p/claim", json={"worker": "w1"})).json()
    r = await c.post(
        f"{SUBS}/p/release",
        json={"wake_id": claim["wake_id"], "generation": claim["generation"]},
        headers=bearer(claim["token"]),
    )
    assert r.status_code == 204
    # pending work remains, so a new wake event is written for a later claim
    await wait_for(lambda: _gen_announced(c, "p", claim["generation"] + 1))
    claim2 = (await c.post(f"{SUBS}/p/claim", json={"worker": "w2"})).json()
    assert claim2["generation"] == claim["generation"] + 1
    # the first worker is fenced: its generation and token are stale
    r = await c.post(
        f"{SUBS}/p/ack",
        headers=bearer(claim["token"]),
        json={"wake_id": claim["wake_id"], "generation": claim["generation"], "done": True},
    )
    assert r.status_code == 409 and r.json()["error"]["code"] == "FENCED"
    # the right token with a stale generation or wake id is fenced too
    for body in (
        {"wake_id": claim2["wake_id"], "generation": claim["generation"]},
        {"wake_id": claim["wake_id"], "generation": claim2["generation"]},
    ):
        r = await c.post(f"{SUBS}/p/ack", headers=bearer(claim2["token"]), json=body)
        assert r.status_code == 409 and r.json()["error"]["code"] == "FENCED"
    # a token of one subscription is not valid for another
    await pull_sub(c, "q", pattern="other/*")
    r = await c.post(
        f"{SUBS}/q/ack", headers=bearer(claim2["token"]), json={"wake_id": claim2["wake_id"], "generation": 1}
    )
    assert r.status_code == 401


async def _gen_announced(c: httpx.AsyncClient, sid: str, generation: int) -> bool:
    return any(e["generation"] == generation for e in await wake_events(c, "wake/pool", sid))


async def test_lease_expiry_hands_the_work_over(srv: Served) -> None:
    c = srv.client
    await pull_sub(c, "p", ttl=1000)
    await put_stream(c, "events/a", {"n": 1})
    claim = (await c.post(f"{SUBS}/p/claim", json={"worker": "w1"})).json()
    # a heartbeat keeps it
    await asyncio.sleep(0.6)
    r = await c.post(
        f"{SUBS}/p/ack",
        headers=bearer(claim["token"]),
        json={"wake_id": claim["wake_id"], "generation": claim["generation"]},
    )
    assert r.status_code == 200
    await asyncio.sleep(0.6)
    assert (await c.post(f"{SUBS}/p/claim", json={"worker": "w2"})).status_code == 409
    # silence past the lease: the wake is taken back and re-issued
    await asyncio.sleep(1.1)
    await wait_for(lambda: _gen_announced(c, "p", claim["generation"] + 1))
    r = await c.post(f"{SUBS}/p/claim", json={"worker": "w2"})
    assert r.status_code == 200 and r.json()["generation"] == claim["generation"] + 1
    r = await c.post(
        f"{SUBS}/p/ack",
        headers=bearer(claim["token"]),
        json={"wake_id": claim["wake_id"], "generation": claim["generation"], "done": True},
    )
    assert r.status_code == 409 and r.json()["error"]["code"] == "FENCED"


async def test_ack_offsets_are_validated(srv: Served) -> None:
    c = srv.client
    await pull_sub(c, "p")
    await put_stream(c, "events/a", {"n": 1})
    await append(c, "events/a", {"n": 2})
    claim = (await c.post(f"{SUBS}/p/claim", json={"worker": "w1"})).json()
    t = stream_info(claim, "events/a")["tail_offset"]
    wake = {"wake_id": claim["wake_id"], "generation": claim["generation"]}

    async def ack(acks: list[dict[str, str]]) -> httpx.Response:
        return await c.post(f"{SUBS}/p/ack", headers=bearer(claim["token"]), json={**wake, "acks": acks})

    off, pos = (int(x) for x in t.split("_"))
    beyond = f"{off + 5:016d}_{pos + 500:016d}"
    middle = f"{off:016d}_{pos - 3:016d}"
    for acks, status, says in [
        ([{"stream": "events/zzz", "offset": t}], 409, "not linked"),
        ([{"stream": "events/a", "offset": beyond}], 409, "beyond"),
        ([{"stream": "events/a", "offset": middle}], 409, "boundary"),
        ([{"stream": "events/a", "offset": "-1"}], 400, "offset"),
        ([{"stream": "events/a"}], 400, "offset"),
        ([{"offset": t}], 400, "stream"),
        ("x", 400, "acks"),
    ]:
        r = await ack(acks)  # type: ignore[arg-type]
        assert r.status_code == status, r.text
        assert says in r.json()["error"]["message"], r.text
    assert (await ack([{"stream": "events/a", "offset": t}])).status_code == 200
    # a regression is refused, and a failed batch moves nothing
    await append(c, "events/a", {"n": 3})
    r = await ack(
        [{"stream": "events/a", "offset": await tail(c, "events/a")}, {"stream": "events/a", "offset": middle}]
    )
    assert r.status_code == 409
    assert stream_info((await c.get(f"{SUBS}/p")).json(), "events/a")["acked_offset"] == t
    first = (await c.get(f"{ROOT}/events/a", params={"offset": "-1", "max_bytes": 1})).headers["stream-next-offset"]
    r = await ack([{"stream": "events/a", "offset": first}])
    assert r.status_code == 409 and "behind" in r.json()["error"]["message"]


async def test_explicit_membership(srv: Served) -> None:
    c = srv.client
    await put_stream(c, "events/a", {"n": 1})
    r = await c.put(
        f"{SUBS}/p",
        json={"type": "pull-wake", "pattern": "events/*", "streams": ["manual/a"], "wake_stream": "wake/pool"},
    )
    assert r.status_code == 201
    assert (
        await c.post(f"{SUBS}/p/streams", json={"streams": ["manual/b", "events/a", "manual/b"]})
    ).status_code == 204
    links = {s["path"]: s["link_type"] for s in (await c.get(f"{SUBS}/p")).json()["streams"]}
    assert links == {"events/a": "explicit", "manual/a": "explicit", "manual/b": "explicit"}
    for path in ("manual%2Fb", "events%2Fa", "never%2Flinked"):
        assert (await c.delete(f"{SUBS}/p/streams/{path}")).status_code == 204
    links = {s["path"]: s["link_type"] for s in (await c.get(f"{SUBS}/p")).json()["streams"]}
    assert links == {"events/a": "glob", "manual/a": "explicit"}  # the glob link stays
    # an explicit stream created later is pending from its start
    await put_stream(c, "wake/pool")
    await put_stream(c, "manual/a", {"n": 1})
    await wait_for(lambda: _has_events(c, "wake/pool", "p", 1))
    assert (await wake_events(c, "wake/pool", "p"))[0]["stream"] == "manual/a"


async def test_wake_stream_created_after_the_wake(srv: Served) -> None:
    c = srv.client
    r = await c.put(f"{SUBS}/p", json={"type": "pull-wake", "pattern": "events/*", "wake_stream": "wake/late"})
    assert r.status_code == 201
    await put_stream(c, "events/a", {"n": 1})
    await asyncio.sleep(0.1)
    await put_stream(c, "wake/late")
    await wait_for(lambda: _has_events(c, "wake/late", "p", 1))


async def test_deleted_stream_and_deleted_subscription(srv: Served) -> None:
    c = srv.client
    await pull_sub(c, "p")
    await put_stream(c, "events/a", {"n": 1})
    claim = (await c.post(f"{SUBS}/p/claim", json={"worker": "w1"})).json()
    # a glob-linked stream that is deleted leaves the subscription
    assert (await c.delete(f"{ROOT}/events/a")).status_code == 204
    assert [s["path"] for s in (await c.get(f"{SUBS}/p")).json()["streams"]] == []
    # in-flight requests of a deleted subscription fail and move nothing
    assert (await c.delete(f"{SUBS}/p")).status_code == 204
    r = await c.post(
        f"{SUBS}/p/ack",
        headers=bearer(claim["token"]),
        json={"wake_id": claim["wake_id"], "generation": claim["generation"], "done": True},
    )
    assert r.status_code == 404
    # re-created with the same id: the old token belongs to another subscription's wake
    await pull_sub(c, "p")
    await put_stream(c, "events/b", {"n": 1})
    claim2 = (await c.post(f"{SUBS}/p/claim", json={"worker": "w1"})).json()
    assert claim2["generation"] == 1
    r = await c.post(
        f"{SUBS}/p/ack", headers=bearer(claim["token"]), json={"wake_id": claim2["wake_id"], "generation": 1}
    )
    assert r.status_code == 409 and r.json()["error"]["code"] == "FENCED"


# ---------------------------------------------------------------------- webhooks


def _verify(raw: bytes, header: str, jwks: dict[str, Any]) -> bool:
    m = re.fullmatch(r"t=(\d+),kid=([^,]+),ed25519=([A-Za-z0-9_-]+)", header)
    assert m, header
    ts, kid, sig = m.groups()
    assert abs(time.time() - int(ts)) < 300
    (jwk,) = [k for k in jwks["keys"] if k["kid"] == kid]
    x = base64.urlsafe_b64decode(jwk["x"] + "=" * (-len(jwk["x"]) % 4))
    try:
        Ed25519PublicKey.from_public_bytes(x).verify(
            base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4)), ts.encode() + b"." + raw
        )
    except InvalidSignature:
        return False
    return True


async def test_webhook_signature_verifies_and_callback_fences(srv: Served, receiver: Receiver) -> None:
    c = srv.client
    r = await c.put(f"{SUBS}/hook", json={"type": "webhook", "pattern": "events/*", "webhook": {"url": receiver.url}})
    jwks = (await c.get(r.json()["webhook"]["signing"]["jwks_url"].removeprefix("http://testserver"))).json()
    await put_stream(c, "events/a", {"n": 1})
    headers, body, raw = await receiver.next()
    assert headers["content-type"] == "application/json"
    assert _verify(raw, headers["webhook-signature"], jwks)
    assert not _verify(raw + b" ", headers["webhook-signature"], jwks)  # the signature covers the exact body
    assert body["subscription_id"] == "hook" and body["generation"] == 1 and body["wake_id"].startswith("w_")
    assert body["callback_url"] == f"http://testserver{SUBS}/hook/callback"
    a = stream_info(body, "events/a")
    assert a["has_pending"] is True and a["tail_offset"] == await tail(c, "events/a")

    callback = body["callback_url"].removeprefix("http://testserver")
    reply = {"wake_id": body["wake_id"], "generation": 1, "acks": [{"stream": "events/a", "offset": a["tail_offset"]}]}
    r = await c.post(callback, headers=bearer(body["callback_token"]), json=reply)  # progress, not done
    assert r.json() == {"ok": True, "next_wake": False}
    r = await c.post(callback, headers=bearer(body["callback_token"]), json={**reply, "done": True})
    assert r.json() == {"ok": True, "next_wake": False}
    r = await c.post(callback, headers=bearer(body["callback_token"]), json={**reply, "done": True})
    assert r.status_code == 409 and r.json()["error"]["code"] == "FENCED"
    assert stream_info((await c.get(f"{SUBS}/hook")).json(), "events/a")["acked_offset"] == a["tail_offset"]
    # a later append is a new wake with the next generation
    await append(c, "events/a", {"n": 2})
    await wait_for(lambda: _count_at_least(receiver, 2))
    assert json.loads(receiver.requests[-1][1])["generation"] == 2


async def _count_at_least(receiver: Receiver, n: int) -> bool:
    return len(receiver.requests) >= n


async def test_webhook_synchronous_done_auto_acks(srv: Served, receiver: Receiver) -> None:
    c = srv.client
    receiver.answers = [(200, {"done": True})] * 5
    await c.put(f"{SUBS}/hook", json={"type": "webhook", "pattern": "events/*", "webhook": {"url": receiver.url}})
    await put_stream(c, "events/a", {"n": 1})
    _, body, _ = await receiver.next()
    t = stream_info(body, "events/a")["tail_offset"]

    async def acked() -> bool:
        return bool(stream_info((await c.get(f"{SUBS}/hook")).json(), "events/a")["acked_offset"] == t)

    await wait_for(acked)


async def test_webhook_failure_retries_with_backoff(srv: Served, receiver: Receiver) -> None:
    c = srv.client
    receiver.answers = [(500, {}), (200, {"done": True})]
    await c.put(f"{SUBS}/hook", json={"type": "webhook", "pattern": "events/*", "webhook": {"url": receiver.url}})
    await put_stream(c, "events/a", {"n": 1})
    await wait_for(lambda: _count_at_least(receiver, 1))

    async def failed() -> bool:
        return bool((await c.get(f"{SUBS}/hook")).json()["status"] == "failed")

    await wait_for(failed)
    started = time.monotonic()
    await wait_for(lambda: _count_at_least(receiver, 2), timeout=5)
    assert time.monotonic() - started > 0.5  # about a second of backoff (20% jitter)
    first, second = (json.loads(raw) for _, raw in receiver.requests[:2])
    assert (first["wake_id"], first["generation"]) == (second["wake_id"], second["generation"])  # the same wake again

    async def recovered() -> bool:
        body = (await c.get(f"{SUBS}/hook")).json()
        return bool(body["status"] == "active" and stream_info(body, "events/a")["acked_offset"] != "-1")

    await wait_for(recovered)


async def test_webhook_callback_before_answer_then_next_wake(srv: Served, receiver: Receiver) -> None:
    """A receiver may finish a wake through the callback before it answers the POST; the next wake
    (work that arrived meanwhile) is still delivered."""
    c = srv.client
    results: list[dict[str, Any]] = []

    async def finish_first(body: dict[str, Any]) -> None:
        if body["generation"] != 1:
            return
        first_tail = stream_info(body, "events/a")["tail_offset"]
        await append(c, "events/a", {"n": 2})
        r = await c.post(
            body["callback_url"].removeprefix("http://testserver"),
            headers=bearer(body["callback_token"]),
            json={
                "wake_id": body["wake_id"],
                "generation": 1,
                "done": True,
                "acks": [{"stream": "events/a", "offset": first_tail}],
            },
        )
        results.append(r.json())

    receiver.before_answer = finish_first
    await c.put(f"{SUBS}/hook", json={"type": "webhook", "pattern": "events/*", "webhook": {"url": receiver.url}})
    await put_stream(c, "events/a", {"n": 1})
    await wait_for(lambda: _count_at_least(receiver, 2))
    assert results == [{"ok": True, "next_wake": True}]
    assert json.loads(receiver.requests[1][1])["generation"] == 2


async def test_webhook_lease_expiry_redelivers(srv: Served, receiver: Receiver) -> None:
    c = srv.client
    await c.put(
        f"{SUBS}/hook",
        json={"type": "webhook", "pattern": "events/*", "webhook": {"url": receiver.url}, "lease_ttl_ms": 1000},
    )
    await put_stream(c, "events/a", {"n": 1})
    _, body, _ = await receiver.next()
    # the receiver answered 200 {} and never called back: after the lease, the work is re-woken
    await wait_for(lambda: _count_at_least(receiver, 2), timeout=4)
    again = json.loads(receiver.requests[-1][1])
    assert again["generation"] == body["generation"] + 1
    callback = body["callback_url"].removeprefix("http://testserver")
    r = await c.post(
        callback,
        headers=bearer(body["callback_token"]),
        json={"wake_id": body["wake_id"], "generation": body["generation"], "done": True},
    )
    assert r.status_code == 409


# ---------------------------------------------------------------------- restarts


@pytest.mark.slow
def test_state_survives_restart(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "data")
    srv.start()
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            assert c.put(f"{ROOT}/wake/pool", headers=JSON).status_code == 201
            r = c.put(
                f"{SUBS}/p",
                json={"type": "pull-wake", "pattern": "events/*", "wake_stream": "wake/pool", "lease_ttl_ms": 60_000},
            )
            assert r.status_code == 201
            assert c.put(f"{ROOT}/events/a", headers=JSON, content=b'{"n":1}').status_code == 201
            claim = c.post(f"{SUBS}/p/claim", json={"worker": "w1"}).json()
            jwks = c.get(f"{ROOT}/__ds/jwks.json").json()
        srv.stop()
        srv.start()
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            assert c.get(f"{ROOT}/__ds/jwks.json").json() == jwks  # the signing key is kept
            # the lease and its holder survived
            r = c.post(f"{SUBS}/p/claim", json={"worker": "w2"})
            assert r.status_code == 409 and r.json()["error"]["current_holder"] == "w1"
            t = stream_info(claim, "events/a")["tail_offset"]
            r = c.post(
                f"{SUBS}/p/ack",
                headers=bearer(claim["token"]),
                json={
                    "wake_id": claim["wake_id"],
                    "generation": claim["generation"],
                    "done": True,
                    "acks": [{"stream": "events/a", "offset": t}],
                },
            )
            assert r.status_code == 200, r.text
            assert c.post(f"{ROOT}/events/a", headers=JSON, content=b'{"n":2}').status_code in (200, 204)
            deadline = time.monotonic() + 5
            while not any(
                e["generation"] == claim["generation"] + 1
                for e in c.get(f"{ROOT}/wake/pool", params={"offset": "-1"}).json()
            ):
                assert time.monotonic() < deadline
                time.sleep(0.05)
        srv.kill()  # a crash, not a clean stop
        srv.start()
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            body = c.get(f"{SUBS}/p").json()
            assert stream_info(body, "events/a")["acked_offset"] == t
            claim2 = c.post(f"{SUBS}/p/claim", json={"worker": "w2"}).json()
            assert claim2["generation"] == claim["generation"] + 1  # generations never go back
    finally:
        srv.kill()


async def test_webhook_retry_state_survives_restart(tmp_path: Path, receiver: Receiver) -> None:
    receiver.answers = [(503, {})] * 2

    async def serve() -> tuple[Broker, App, httpx.AsyncClient]:
        broker = Broker(tmp_path / "data")
        broker.open()
        app = App(broker, AppConfig(webhook_targets="loopback"))
        return broker, app, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")

    broker, app, c = await serve()
    r = await c.put(f"{SUBS}/hook", json={"type": "webhook", "pattern": "events/*", "webhook": {"url": receiver.url}})
    kid = r.json()["webhook"]["signing"]["kid"]
    await put_stream(c, "events/a", {"n": 1})
    await wait_for(lambda: _count_at_least(receiver, 1))

    async def failed() -> bool:
        return bool((await c.get(f"{SUBS}/hook")).json()["status"] == "failed")

    await wait_for(failed)
    await c.aclose()
    await app.subscriptions.close()
    await broker.close()

    broker, app, c = await serve()
    try:
        body = (await c.get(f"{SUBS}/hook")).json()
        assert body["status"] == "failed" and body["webhook"]["signing"]["kid"] == kid
        # the persisted retry schedule is honoured: the same wake is delivered again
        await wait_for(lambda: _count_at_least(receiver, 2), timeout=6)
        first, again = (json.loads(raw) for _, raw in receiver.requests[:2])
        assert (again["wake_id"], again["generation"]) == (first["wake_id"], first["generation"])
    finally:
        await c.aclose()
        await app.subscriptions.close()
        await broker.close()


async def test_state_lives_on_the_brokers_file_system(tmp_path: Path) -> None:
    """Subscriptions, cursors, leases and both keys are stored through the broker's file system
    (here the simulator's disk), survive a restart on it, and nothing reaches the OS directory."""
    disk = SimDisk(random.Random(0))
    data = tmp_path / "data"  # a path on the simulated disk; on the OS it must never appear
    disk.mount().mkdir(data)

    async def serve() -> tuple[Broker, App, httpx.AsyncClient]:
        broker = Broker(data, fs=disk.mount())
        broker.open()
        app = App(broker, AppConfig(long_poll_timeout=0.3))
        return broker, app, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")

    async def stop(broker: Broker, app: App, c: httpx.AsyncClient) -> None:
        await c.aclose()
        await app.subscriptions.close()
        await broker.close()

    broker, app, c = await serve()
    jwks = (await c.get(f"{ROOT}/__ds/jwks.json")).json()
    await pull_sub(c, "p")
    await put_stream(c, "events/a", {"n": 1})
    await wait_for(lambda: _has_events(c, "wake/pool", "p", 1))
    claim = (await c.post(f"{SUBS}/p/claim", json={"worker": "w1"})).json()
    await pull_sub(c, "q")
    assert (await c.delete(f"{SUBS}/q")).status_code == 204
    await stop(broker, app, c)

    fs = disk.mount()
    assert sorted(fs.listdir(data / "subscriptions")) == ["subs", "token.key", "webhook-ed25519.pem"]
    assert len(fs.listdir(data / "subscriptions" / "subs")) == 1  # p's file; q's is removed
    assert not data.exists() and list(tmp_path.iterdir()) == []

    broker, app, c = await serve()
    try:
        assert (await c.get(f"{ROOT}/__ds/jwks.json")).json() == jwks  # the signing key is kept
        assert (await c.get(f"{SUBS}/q")).status_code == 404
        r = await c.post(f"{SUBS}/p/claim", json={"worker": "w2"})
        assert r.status_code == 409 and r.json()["error"]["current_holder"] == "w1"  # the lease is kept
        t = stream_info(claim, "events/a")["tail_offset"]
        r = await c.post(  # the token issued before the restart is still valid: the token key is kept
            f"{SUBS}/p/ack",
            headers=bearer(claim["token"]),
            json={
                "wake_id": claim["wake_id"],
                "generation": claim["generation"],
                "done": True,
                "acks": [{"stream": "events/a", "offset": t}],
            },
        )
        assert r.status_code == 200, r.text
        assert stream_info((await c.get(f"{SUBS}/p")).json(), "events/a")["acked_offset"] == t
    finally:
        await stop(broker, app, c)
    assert list(tmp_path.iterdir()) == []


async def test_a_store_that_cannot_read_the_subscriptions_yet_never_turns_an_answer_into_a_500(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the cluster simulator (seed 116471): an app whose subscriptions were not started
    (left to its first requests: no lifespan, or the start it schedules failed) read them after a
    stream change had been stored and its answer decided, and when the store failed that read the
    stored append was answered 500; so was a subscription request. Now the change keeps its answer,
    a subscription request is a 503, and once the store reads them the changes made meanwhile count:
    the pattern links the stream created then, and the subscription wakes for it."""
    data = tmp_path / "data"

    async def serve() -> tuple[Broker, App, httpx.AsyncClient]:
        broker = Broker(data)
        broker.open()
        app = App(broker, AppConfig(long_poll_timeout=0.3))
        return broker, app, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")

    async def stop(broker: Broker, app: App, c: httpx.AsyncClient) -> None:
        await c.aclose()
        await app.subscriptions.close()
        await broker.close()

    broker, app, c = await serve()
    await pull_sub(c, "p")  # events/* wakes into wake/pool
    await stop(broker, app, c)

    failing = True
    listdir = OsFileSystem.listdir

    def flaky(fs: OsFileSystem, path: Path) -> list[str]:
        if failing and path.name == "subs":
            raise OSError(errno.EIO, "Input/output error")
        return listdir(fs, path)

    monkeypatch.setattr(OsFileSystem, "listdir", flaky)
    broker, app, c = await serve()
    try:
        r = await c.put(f"{ROOT}/events/a", headers=JSON, content=b'{"n":1}')
        assert r.status_code == 201, r.text
        r = await c.post(f"{ROOT}/events/a", headers=JSON, content=b'{"n":2}')
        assert r.status_code == 204, r.text
        assert (await c.get(f"{ROOT}/events/a", params={"offset": "-1"})).json() == [{"n": 1}, {"n": 2}]
        r = await c.get(f"{SUBS}/p")
        assert r.status_code == 503 and r.json()["error"]["code"] == "UNAVAILABLE", r.text
        failing = False
        r = await c.get(f"{SUBS}/p")
        assert r.status_code == 200, r.text
        assert stream_info(r.json(), "events/a")["acked_offset"] == "-1"  # linked from its start
        await wait_for(lambda: _has_events(c, "wake/pool", "p", 1))
        (event,) = await wake_events(c, "wake/pool", "p")
        assert event["type"] == "wake" and event["stream"] == "events/a"
    finally:
        await stop(broker, app, c)


async def test_key_files_are_owner_only(tmp_path: Path) -> None:
    """On the OS, the signing key and the token key are readable by the server's user alone."""
    broker = Broker(tmp_path / "data")
    broker.open()
    app = App(broker, AppConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver") as c:
        assert (await c.get(f"{ROOT}/__ds/jwks.json")).status_code == 200
        await pull_sub(c, "p")
        await put_stream(c, "events/a", {"n": 1})
        await wait_for(lambda: _has_events(c, "wake/pool", "p", 1))
        assert (await c.post(f"{SUBS}/p/claim", json={"worker": "w1"})).status_code == 200  # issues a token
    await app.subscriptions.close()
    await broker.close()
    directory = tmp_path / "data" / "subscriptions"
    for name in ("webhook-ed25519.pem", "token.key"):
        assert stat.S_IMODE((directory / name).stat().st_mode) == 0o600, name
    assert [f.suffix for f in (directory / "subs").iterdir()] == [".json"]


class _KeepNothing(random.Random):
    """A power loss keeps no unsynced write and no unsynced name (tests/storage/test_power_loss.py)."""

    def randint(self, a: int, b: int) -> int:
        return a


def test_acknowledged_state_and_keys_survive_a_power_loss() -> None:
    """Under ``--fsync always`` a power loss takes nothing a response acknowledged: the subscription,
    its claim, the signing key (receivers keep the JWKS they fetched) and the token key (the claim's
    token stays valid). Every name is durable, the ``subscriptions`` directories' included."""
    disk = SimDisk(_KeepNothing(0))
    data = Path("/data")
    fs = disk.mount()
    fs.mkdir(data)
    fs.sync_dir(Path("/"))
    fs.sync_dir(data)
    seen: dict[str, Any] = {}

    def serve() -> tuple[Broker, App, httpx.AsyncClient]:
        broker = Broker(data, fs=disk.mount())
        broker.open()
        app = App(broker, AppConfig(long_poll_timeout=0.3))
        return broker, app, httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver")

    async def before() -> None:
        _, _, c = serve()
        seen["jwks"] = (await c.get(f"{ROOT}/__ds/jwks.json")).json()
        await pull_sub(c, "p")
        await put_stream(c, "events/a", {"n": 1})
        await wait_for(lambda: _has_events(c, "wake/pool", "p", 1))
        r = await c.post(f"{SUBS}/p/claim", json={"worker": "w1"})
        assert r.status_code == 200, r.text
        seen["claim"] = r.json()
        disk.power_loss()  # no clean shutdown: the process and the page cache are gone

    async def after() -> None:
        broker, app, c = serve()
        try:
            assert (await c.get(f"{ROOT}/__ds/jwks.json")).json() == seen["jwks"], "the signing key changed"
            r = await c.get(f"{SUBS}/p")
            assert r.status_code == 200, "a subscription whose creation was acknowledged vanished"
            claim = seen["claim"]
            r = await c.post(
                f"{SUBS}/p/ack",
                headers=bearer(claim["token"]),
                json={"wake_id": claim["wake_id"], "generation": claim["generation"]},
            )
            assert r.status_code == 200, r.text  # the claim and its token survived
        finally:
            await c.aclose()
            await app.subscriptions.close()
            await broker.close()

    asyncio.run(before())
    asyncio.run(after())


class _FixedClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


async def test_subscriptions_read_the_brokers_clock(tmp_path: Path) -> None:
    """Issue 29, item 4: lease deadlines, retry times and wake timestamps come from the broker's
    clock (simulated time in the simulator), not from ``time.time()``; jitter from a random the
    simulator can seed."""
    import random

    from onceflow.core.subscriptions import Subscriptions

    clock = _FixedClock(1_700_000_000.0)
    broker = Broker(tmp_path / "data", clock=clock)
    broker.open()
    try:
        manager = Subscriptions(broker, poster=None, rng=random.Random(1))  # type: ignore[arg-type]
        assert manager.sign(b"{}").startswith("t=1700000000,")
        clock.now += 60
        assert manager.sign(b"{}").startswith("t=1700000060,")
    finally:
        await broker.close()
