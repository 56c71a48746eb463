"""Fuzzing the HTTP extensions, and property tests of what clients rely on across random request sequences.

tests/server/test_http_bad_input.py fuzzes the Durable Streams core (stream headers, offsets, live modes);
this file covers what it leaves out: transactions (/v1/txn), consumer-group offsets (/v1/groups),
sink commits (/v1/sinks), the subscription routes (/v1/stream/__ds), deeply nested JSON bodies, the
stream listing, exact-range reads (format=records / boundaries) and transactional appends. Every answer must be < 500, and a rejected request (4xx) must change nothing
that a client can observe.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from helpers.servers import InProcess
from helpers.wirekit import connect, read_response
from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig
from onceflow.server.http import HttpLimits, HttpServerProtocol, start_server

pytestmark = pytest.mark.anyio
S = "/v1/stream/"
FUZZ_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


async def set_up(c: InProcess) -> None:
    """A stream with plain data, a committed and an open transaction, group offsets and a sink."""
    cl = c.client
    if (await cl.head(S + "fz")).status_code == 200:
        return
    assert (await cl.put(S + "fz", headers={"content-type": "application/json"})).status_code == 201
    assert (
        await cl.post(S + "fz", content=b'[{"n":0},{"n":1}]', headers={"content-type": "application/json"})
    ).status_code == 204
    epoch = (await cl.post("/v1/txn/tz/init", json={})).json()["epoch"]
    txh = {
        "content-type": "application/json",
        "producer-id": "txn:tz",
        "producer-epoch": str(epoch),
        "transaction-id": "tz",
    }
    r = await cl.post(S + "fz", content=b'{"t":1}', headers={**txh, "producer-seq": "0"})
    assert r.status_code == 200
    assert (
        await cl.post("/v1/txn/tz/commit", json={"epoch": epoch, "txn": int(r.headers["transaction-number"])})
    ).status_code == 200
    assert (
        await cl.post(S + "fz", content=b'{"t":2}', headers={**txh, "producer-seq": "1"})
    ).status_code == 200  # left open
    head = await cl.head(S + "fz")
    r = await cl.post(
        "/v1/groups/gz/offsets", json={"offsets": {"fz": head.headers["stream-last-stable-offset"]}, "member_epoch": 5}
    )
    assert r.status_code == 200
    assert (await cl.put(S + "wz", headers={"content-type": "application/json"})).status_code in (200, 201)
    r = await cl.put(S + "__ds/subscriptions/subz", json={"type": "pull-wake", "streams": ["fz"], "wake_stream": "wz"})
    assert r.status_code in (200, 201), r.text  # 200: made by an earlier set_up, before fz was deleted


async def snapshot(c: InProcess) -> dict[str, Any]:
    """Everything a client can observe of the fixture's state."""
    cl = c.client
    head = await cl.head(S + "fz")
    out: dict[str, Any] = {
        "head": (
            head.status_code,
            head.headers.get("stream-next-offset"),
            head.headers.get("stream-last-stable-offset"),
            head.headers.get("stream-closed"),
        ),
        "list": (await cl.get("/v1/streams")).json(),
        "group": (await cl.get("/v1/groups/gz/offsets")).json(),
        "txn": (await cl.get("/v1/txn/tz")).json(),
        "sink": (await cl.get("/v1/sinks/sz")).json(),
        "subscription": (await cl.get(S + "__ds/subscriptions/subz")).json(),
        "subscriptions": sorted(c.app.subscriptions.manager.subs),
    }
    if head.status_code == 200:
        for iso in ("read_committed", "read_uncommitted"):
            r = await cl.get(S + "fz", params={"offset": "-1", "isolation": iso})
            out[iso] = r.content
    return out


# lone UTF-16 surrogates too (issue 28, item 10): JSON can spell them ("\\ud800"), Unicode text cannot
plain = st.text(max_size=12)  # also in query strings, which cannot carry a lone surrogate at all
text = plain | st.sampled_from(["\ud800", "a\udfff", "\udc00z"])  # the bodies' strings
ints = st.one_of(st.integers(-3, 5), st.sampled_from([2**53, -(2**63), 10**30]))
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=False), text)
offsets_like = st.one_of(
    st.sampled_from(["-1", "now", "0000000000000000_0000000000000000", "0000000000000001_0000000000000008", "zz"]),
    plain,
)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=6
)
members = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "id": st.sampled_from(["tz", "sk1", "", "a/b"]) | text,
            "epoch": ints | scalars,
            "txn": ints | scalars,
        },
    ),
    max_size=3,
)
deep = st.integers(500, 5000).flatmap(lambda n: st.sampled_from([b"[" * n + b"]" * n, b'{"a":' * n + b"1" + b"}" * n]))
subscription_bodies = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["pull-wake", "webhook", "x"]) | scalars,
        "pattern": st.sampled_from(["fz", "*", "**", "f*", "a//b", "__ds/*", ""]) | scalars,
        "streams": st.lists(st.sampled_from(["fz", "/fz/", "", "..", "__ds/x"]) | scalars, max_size=3) | scalars,
        "wake_stream": st.sampled_from(["wz", "fz", "nope", ""]) | scalars,
        "webhook": st.fixed_dictionaries(
            {"url": st.sampled_from(["http://127.0.0.1:9/x", "ftp://x", "https://[::1]/", "https://10.0.0.1/"])}
        )
        | scalars,
        "lease_ttl_ms": ints | scalars,
        "worker": text | scalars,
        "wake_id": text | scalars,
        "generation": ints | scalars,
        "done": st.booleans() | scalars,
        "acks": st.lists(st.fixed_dictionaries({"stream": text, "offset": offsets_like}), max_size=2) | scalars,
    },
).map(lambda d: json.dumps(d).encode())
bodies = st.one_of(
    deep,
    subscription_bodies,
    st.fixed_dictionaries(
        {},
        optional={
            "epoch": ints | scalars,
            "txn": ints | scalars,
            "timeout_ms": ints | scalars,
            "group": st.sampled_from(["gz", ""]) | scalars,
            "offsets": st.dictionaries(st.sampled_from(["fz", "nope", ""]) | text, offsets_like | scalars, max_size=2)
            | scalars,
            "member_epoch": ints | scalars,
            "reset": st.booleans() | scalars,
            "members": members | scalars,
            "batch": ints | scalars,
            "abort_prefix": st.sampled_from(["sk", "", "zz"]) | scalars,
            "query": st.sampled_from(["Q1", "Q2", ""]) | scalars,
            "owner": st.sampled_from(["Q1", ""]) | scalars,
            "task": st.sampled_from(["r/t1", ""]) | scalars,
            "partition": ints | scalars,
            "fingerprint": text | scalars,
            "to": st.sampled_from(["earliest", "latest", "offsets", "time", ""]) | scalars,
            "streams": st.lists(st.sampled_from(["fz", "nope", ""]) | text, max_size=2) | scalars,
            "time_ms": ints | scalars,
            "dry_run": st.booleans() | scalars,
            "request_id": text | scalars,
        },
    ).map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=40),
)
ids = (st.sampled_from(["tz", "gz", "sz", "", "a/b", "..", "x" * 300, "\x00", "new"]) | st.text(max_size=10)).map(
    lambda i: quote(i, safe="/")
)  # sent percent-encoded, so that any text reaches the server
paths = st.one_of(
    st.builds(
        lambda i, a: f"/v1/txn/{i}/{a}",
        ids,
        st.sampled_from(["init", "commit", "abort", "offsets", "force-abort", "", "x"]),
    ),
    st.builds(lambda i: f"/v1/txn/{i}", ids),
    st.builds(lambda i, a: f"/v1/groups/{i}/{a}", ids, st.sampled_from(["offsets", "reset", "", "commit"])),
    st.builds(
        lambda i, a: f"/v1/sinks/{i}{a}",
        ids,
        st.sampled_from(["", "/commit", "/abort", "/begin", "/alive", "/reset", "/x"]),
    ),
    st.builds(
        lambda i, a: f"{S}__ds/subscriptions/{i}{a}",
        ids | st.just("subz"),
        st.sampled_from(["", "/streams", "/streams/fz", "/claim", "/ack", "/release", "/callback", "/x"]),
    ),
    st.sampled_from([S + "__ds/jwks.json", S + "__ds", S + "__ds/x", S + "bad%ff", S + "__ds/subscriptions/%ff"]),
    st.sampled_from(["/v1/streams", "/v1/streams/", "/v1/", "/", S, S + "fz", S + "fz/", S + "nope"]),
    st.builds(
        lambda p, q: p + q,
        st.sampled_from(["/v1/txn", "/v1/groups", "/v1/sinks", "/v1/txn/", "/v1/groups/", "/v1/sinks/"]),
        st.sampled_from(["", "?prefix=g", "?open=true", "?open=x", "?prefix=%ff", "?prefix=a&prefix=b"]),
    ),
)
header_names = st.sampled_from(
    [
        "content-type",
        "producer-id",
        "producer-epoch",
        "producer-seq",
        "transaction-id",
        "transaction-commit",
        "if-match",
        "stream-closed",
    ]
)
header_values = st.one_of(
    st.sampled_from(["application/json", "text/plain", "", "0", "1", "-1", "tz", "txn:tz", "true", "9" * 25]),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20),
)
query = st.dictionaries(
    st.sampled_from(["offset", "format", "until", "max_records", "every", "isolation", "max_bytes", "prefix", "live"]),
    st.one_of(
        offsets_like,
        st.sampled_from(
            ["records", "boundaries", "read_committed", "read_uncommitted", "0", "1", "99", "long-poll", "tz", "f"]
        ),
    ),
    max_size=4,
)


async def check_request(
    c: InProcess, method: str, path: str, headers: dict[str, str], params: dict[str, str], body: bytes
) -> None:
    await set_up(c)
    before = await snapshot(c)
    if params.get("live") is not None:
        params = {**params, "live": "long-poll"}  # never sse: an endless response
    r = await c.client.request(
        method, path, headers=headers, params=params, content=body if method in ("POST", "PUT", "PATCH") else None
    )
    assert r.status_code < 500, (method, path, params, r.status_code, r.text)
    if 400 <= r.status_code < 500:
        if method != "HEAD":
            assert r.json()["error"]["message"], r.text
        after = await snapshot(c)
        if path.startswith("/v1/sinks/") and r.status_code in (403, 409):
            # documented: a refused sink commit aborts the open members it names (docs/transactions.md)
            before = {k: v for k, v in before.items() if k in ("group", "sink", "list")}
            after = {k: v for k, v in after.items() if k in ("group", "sink", "list")}
        assert after == before, (method, path, headers, params, body, r.status_code, r.text)


@FUZZ_SETTINGS
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD", "PATCH", "OPTIONS"]),
    path=paths,
    body=bodies,
    headers=st.dictionaries(
        st.just("content-type"), st.sampled_from(["application/json", "text/plain", ""]), max_size=1
    ),
)
async def test_fuzzed_extension_requests_never_5xx_and_rejections_change_nothing(
    onceflow: InProcess, method: str, path: str, body: bytes, headers: dict[str, str]
) -> None:
    await check_request(onceflow, method, path, headers, {}, body)


JSON_ENDPOINTS = [  # every endpoint that parses a JSON body, with names that exist so that the body is parsed
    ("POST", "/v1/txn/tz/init"),
    ("POST", "/v1/txn/tz/commit"),
    ("POST", "/v1/txn/tz/abort"),
    ("POST", "/v1/txn/tz/offsets"),
    ("POST", "/v1/groups/gz/offsets"),
    ("POST", "/v1/sinks/sz/commit"),
    ("POST", "/v1/sinks/sz/abort"),
    ("PUT", S + "__ds/subscriptions/new"),
    ("PUT", S + "__ds/subscriptions/subz"),
    ("POST", S + "__ds/subscriptions/subz/streams"),
    ("POST", S + "__ds/subscriptions/subz/claim"),
    ("POST", S + "__ds/subscriptions/subz/ack"),
    ("POST", S + "__ds/subscriptions/subz/release"),
    ("POST", S + "__ds/subscriptions/subz/callback"),
    ("POST", S + "fz"),
    ("PUT", S + "new"),
]


@FUZZ_SETTINGS
@given(endpoint=st.sampled_from(JSON_ENDPOINTS), body=bodies)
async def test_fuzzed_json_bodies_never_5xx_and_rejections_change_nothing(
    onceflow: InProcess, endpoint: tuple[str, str], body: bytes
) -> None:
    method, path = endpoint
    await check_request(onceflow, method, path, {"content-type": "application/json"}, {}, body)


@FUZZ_SETTINGS
@given(params=query, headers=st.dictionaries(header_names, header_values, max_size=3))
async def test_fuzzed_stream_reads_never_5xx(
    onceflow: InProcess, params: dict[str, str], headers: dict[str, str]
) -> None:
    await check_request(onceflow, "GET", S + "fz", headers, params, b"")


@FUZZ_SETTINGS
@given(headers=st.dictionaries(header_names, header_values, max_size=6), body=bodies)
async def test_fuzzed_transactional_appends_never_5xx_and_rejections_change_nothing(
    onceflow: InProcess, headers: dict[str, str], body: bytes
) -> None:
    await check_request(onceflow, "POST", S + "fz", headers, {}, body)


# ---------------------------------------------------------------- properties


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=25))
async def test_idempotent_producers_with_random_retries_store_each_batch_once_in_order(
    onceflow: InProcess, plan: list[tuple[int, bool]]
) -> None:
    """Each step: producer k sends its next batch, and maybe sends it again (a retry after a lost answer)."""
    cl = onceflow.client
    name = f"prop{len(plan)}-{abs(hash(tuple(plan))) % 10**9}"
    assert (await cl.put(S + name, headers={"content-type": "application/json"})).status_code == 201
    seqs = [0, 0, 0]
    for k, retry in plan:
        h = {
            "content-type": "application/json",
            "producer-id": f"p{k}",
            "producer-epoch": "0",
            "producer-seq": str(seqs[k]),
        }
        body = json.dumps([{"p": k, "s": seqs[k]}]).encode()
        assert (await cl.post(S + name, content=body, headers=h)).status_code == 200
        if retry:
            assert (await cl.post(S + name, content=body, headers=h)).status_code == 204
        seqs[k] += 1
    got = (await cl.get(S + name, params={"offset": "-1"})).json()
    assert got == [
        {"p": k, "s": s} for k, s in ((k, sum(1 for kk, _ in plan[:i] if kk == k)) for i, (k, _) in enumerate(plan))
    ]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(commits=st.lists(st.integers(0, 6), min_size=1, max_size=12))
async def test_group_offsets_only_move_forward(onceflow: InProcess, commits: list[int]) -> None:
    cl = onceflow.client
    name = f"g{abs(hash(tuple(commits))) % 10**9}"
    await cl.put(S + name, headers={"content-type": "application/json"})
    tokens = []
    for i in range(6):
        r = await cl.post(S + name, content=json.dumps({"i": i}).encode(), headers={"content-type": "application/json"})
        tokens.append(r.headers["stream-next-offset"])
    best: str | None = None
    for i in commits:
        tok = tokens[min(i, 5)]
        r = await cl.post(f"/v1/groups/{name}/offsets", json={"offsets": {name: tok}})
        if best is not None and tok < best:
            assert r.status_code == 409
        else:
            assert r.status_code == 200
            best = tok
        assert (await cl.get(f"/v1/groups/{name}/offsets")).json()["offsets"] == {name: best}


# ---------------------------------------------------------------- the guard (tokens and limits)

GUARD = {
    "tokens": {"ingest": [{"prefix": "orders/", "scopes": ["write"]}], "report": [{"prefix": "", "scopes": ["read"]}]},
    "limits": {"streams": 3, "live_reads": 1, "producers_per_stream": 1},
}


@FUZZ_SETTINGS
@given(
    token=st.sampled_from([None, "ingest", "report", "bad", ""]),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "HEAD"]),
    path=st.one_of(paths, st.sampled_from([S + "orders/a", S + "orders/new", S + "other/x", "/v1/txn/orders/t/init"])),
    headers=st.dictionaries(header_names, header_values, max_size=3),
    body=bodies,
)
async def test_guard_refusals_change_nothing(
    onceflow: InProcess, token: str | None, method: str, path: str, headers: dict[str, str], body: bytes
) -> None:
    from onceflow.server.guard import Guard, GuardConfig

    await set_up(onceflow)  # through the unguarded app, on the same broker
    guard = Guard(onceflow.app, onceflow.broker, GuardConfig.from_json(GUARD))
    if token is not None:
        headers = {**headers, "authorization": f"Bearer {token}"}
    before = await snapshot(onceflow)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://testserver") as gc:
        r = await gc.request(method, path, headers=headers, content=body if method in ("POST", "PUT") else None)
    assert r.status_code < 500, (method, path, r.status_code, r.text)
    refused_by_guard = r.status_code in (401, 429) or (
        r.status_code == 403 and (method == "HEAD" or r.json()["error"]["code"] == "forbidden")
    )
    if refused_by_guard:
        assert await snapshot(onceflow) == before


# ---------------------------------------------------------------- slow and pipelining clients (native server)
#
# Raw sockets against the native HTTP/1.1 server (server/http.py): sequences of requests written in one
# go (pipelined), split at random byte boundaries with pauses inside request lines, headers and bodies,
# or trickled a few bytes at a time. Every response must be well-framed (tests/helpers/wirekit.py), the answers
# must be those of the requests in order, what was acknowledged must be stored exactly once in order,
# and the server must keep serving afterwards.


@dataclass
class Native:
    port: int
    tight: bool  # timeouts far shorter than the clients' pauses: connections may be cut with a 408


MAX_BODY = 256


@contextlib.asynccontextmanager
async def native_server(tmp_path: Path, limits: HttpLimits, tight: bool) -> AsyncIterator[Native]:
    broker = Broker(tmp_path / ("tight" if tight else "data"))
    broker.open()
    app = App(broker, AppConfig(long_poll_timeout=0.3, max_body_bytes=MAX_BODY))
    connections: set[HttpServerProtocol] = set()
    server = await start_server(app, "127.0.0.1", 0, limits, connections)
    try:
        yield Native(server.sockets[0].getsockname()[1], tight)
    finally:
        server.close()
        for c in list(connections):
            if c.transport is not None:
                c.transport.close()
        broker.begin_shutdown()
        await broker.close()


@pytest.fixture
async def native(tmp_path: Path) -> AsyncIterator[Native]:
    """Timeouts 100x longer than any pause a client below makes: nothing may time out."""
    async with native_server(
        tmp_path, HttpLimits(header_timeout=5, idle_timeout=5, body_timeout=5), tight=False
    ) as srv:
        yield srv


@pytest.fixture
async def tight(tmp_path: Path) -> AsyncIterator[Native]:
    """Timeouts shorter than the clients' longest pauses."""
    limits = HttpLimits(header_timeout=0.15, idle_timeout=0.15, body_timeout=0.15, min_body_rate=2000, linger=0.2)
    async with native_server(tmp_path, limits, tight=True) as srv:
        yield srv


@dataclass(frozen=True)
class Req:
    kind: str  # create | append | read | head | missing | wrong_type | too_big | garbage
    body: bytes = b""
    chunked: tuple[int, ...] = ()  # chunk sizes for a chunked append (empty: Content-Length)
    expect: bool = False  # Expect: 100-continue (the body follows without waiting, as curl does after 1 s)

    def wire(self, path: str) -> bytes:
        host = b"Host: x\r\n"
        if self.kind == "create":
            return b"PUT %s HTTP/1.1\r\n%sContent-Type: text/plain\r\nContent-Length: 0\r\n\r\n" % (path.encode(), host)
        if self.kind in ("append", "wrong_type", "too_big"):
            ctype = b"application/json" if self.kind == "wrong_type" else b"text/plain"
            head = b"POST %s HTTP/1.1\r\n%sContent-Type: %s\r\n" % (path.encode(), host, ctype)
            if self.expect:
                head += b"Expect: 100-continue\r\n"
            if not self.chunked:
                return head + b"Content-Length: %d\r\n\r\n" % len(self.body) + self.body
            out, at = [head + b"Transfer-Encoding: chunked\r\n\r\n"], 0
            for size in self.chunked:
                piece = self.body[at : at + size]
                at += len(piece)
                if piece:
                    out.append(b"%x\r\n%s\r\n" % (len(piece), piece))
            if at < len(self.body):
                out.append(b"%x\r\n%s\r\n" % (len(self.body) - at, self.body[at:]))
            return b"".join(out) + b"0\r\n\r\n"
        if self.kind == "read":
            return b"GET %s?offset=-1 HTTP/1.1\r\n%s\r\n" % (path.encode(), host)
        if self.kind == "head":
            return b"HEAD %s HTTP/1.1\r\n%s\r\n" % (path.encode(), host)
        if self.kind == "missing":
            return b"GET %s-none?offset=-1 HTTP/1.1\r\n%s\r\n" % (path.encode(), host)
        return b"GET / HTTP/1.1\r\nBad Header\x00: y\r\n\r\n"  # garbage


payloads = st.binary(min_size=1, max_size=48).map(lambda b: bytes(c % 94 + 33 for c in b))  # printable, no CR/LF
requests = st.one_of(
    st.just(Req("create")),
    st.builds(
        lambda b, ch, e: Req("append", b, tuple(ch), e),
        payloads,
        st.one_of(st.just([]), st.lists(st.integers(1, 20), min_size=1, max_size=4)),
        st.booleans(),
    ),
    st.sampled_from([Req("read"), Req("head"), Req("missing")]),
    st.builds(lambda b: Req("wrong_type", b), payloads),
    st.builds(lambda e: Req("too_big", b"z" * (MAX_BODY + 1), (), e), st.booleans()),
)
plans = st.tuples(
    st.lists(requests, min_size=1, max_size=30),
    st.booleans(),  # end with garbage
    st.sampled_from(["pipelined", "split", "trickle"]),
    st.lists(st.integers(1, 300), min_size=1, max_size=8),  # piece sizes, cycled
    st.lists(st.sampled_from([0.0, 0.0, 0.0, 0.001, 0.005, 0.02]), min_size=1, max_size=8),  # pauses, cycled
)
_names = itertools.count()


def expected_status(req: Req, created: bool) -> int | None:
    """The status the model predicts (None: any 4xx)."""
    if req.kind == "create":
        return 200 if created else 201
    if req.kind == "append":
        return 204 if created else 404
    if req.kind in ("read", "head"):
        return 200 if created else 404
    if req.kind == "missing":
        return 404
    if req.kind == "too_big":
        return 413
    return None


async def write_plan(
    writer: asyncio.StreamWriter, data: bytes, mode: str, sizes: list[int], pauses: list[float], budget: float
) -> None:
    """Write ``data`` in one go, or in pieces with pauses between them (``budget`` seconds of pauses at most)."""
    if mode == "pipelined":
        writer.write(data)
        await writer.drain()
        return
    if mode == "trickle":
        sizes = [1 + s % 3 for s in sizes]
    at = 0
    for size, pause in zip(itertools.cycle(sizes), itertools.cycle(pauses), strict=False):
        if at >= len(data):
            break
        writer.write(data[at : at + size])
        at += size
        await writer.drain()
        pause = min(pause, budget)
        budget -= pause
        await asyncio.sleep(pause)


async def run_plan(
    srv: Native, plan: tuple[list[Req], bool, str, list[int], list[float]], event: Callable[[str], object] = event
) -> None:
    reqs, garbage, mode, sizes, pauses = plan
    if garbage:
        reqs = [*reqs, Req("garbage")]
    path = f"/v1/stream/fz{next(_names)}"
    reader, writer = await connect(srv.port)
    data = b"".join(r.wire(path) for r in reqs)
    sending = asyncio.ensure_future(write_plan(writer, data, mode, sizes, pauses, 1.0 if srv.tight else 0.3))
    created = False
    acked: list[bytes] = []  # bodies of appends answered 204, in order
    pending: bytes | None = None  # the first append not answered (it may be stored: its answer was cut off)
    try:
        for req in reqs:
            r = await read_response(reader, head=req.kind == "head")
            if r is None:  # closed: only a timeout of the tight server may do that without saying so
                assert srv.tight, f"connection closed before the answer to {req}"
                event("cut off: closed without an answer")
                if req.kind == "append" and created:
                    pending = req.body
                break
            if r.status == 408:
                assert srv.tight and r.closes, r
                event("cut off: 408")
                if req.kind == "append" and created:
                    pending = req.body
                break
            assert set(r.interim) <= {100} and (not r.interim or req.expect), (req, r.interim)
            want = expected_status(req, created)
            if want is None:
                assert 400 <= r.status < 500 and json.loads(r.body)["error"]["message"], (req, r)
            else:
                assert r.status == want, (req, r.status, r.body[:200])
            if req.kind == "create":
                created = True
            elif req.kind == "append" and created:
                acked.append(req.body)
            elif req.kind == "read" and created:
                assert r.body == b"".join(acked), (r.body, acked)
            if req.kind == "garbage":
                assert r.closes
            if r.closes:
                assert req.kind in ("too_big", "garbage") or srv.tight, (req, r)
                event(f"closed after {r.status}")
                break
        else:
            event("every request answered")
    finally:
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await sending
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    # the server is still up, and stored exactly what it acknowledged (plus perhaps the answer it cut off)
    reader, writer = await connect(srv.port)
    try:
        writer.write(Req("read").wire(path))
        r = await read_response(reader)
        assert r is not None
        if created:
            assert r.status == 200
            stored, done = r.body, b"".join(acked)
            assert stored == done or (pending is not None and stored == done + pending), (stored, acked, pending)
        else:
            assert r.status in (404, 200)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=plans)
async def test_slow_and_pipelining_clients_get_well_framed_answers_in_order(
    native: Native, plan: tuple[list[Req], bool, str, list[int], list[float]]
) -> None:
    await run_plan(native, plan)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=plans.map(lambda p: (p[0][:8], p[1], p[2], p[3], [x * 10 for x in p[4]])))  # pauses up to 0.2 s
async def test_clients_slower_than_the_timeouts_are_cut_off_cleanly(
    tight: Native, plan: tuple[list[Req], bool, str, list[int], list[float]]
) -> None:
    await run_plan(tight, plan)


async def test_many_pipelined_appends_in_one_write(native: Native) -> None:
    reqs = [Req("create"), *(Req("append", b"m%03d;" % i) for i in range(300)), Req("read")]
    await run_plan(native, (reqs, False, "pipelined", [1], [0.0]), event=lambda _: None)
