"""Every endpoint of server/guard.py's ENDPOINTS against every kind of grant (issue 15).

For each endpoint there is at least one request whose names all lie under ``pub/``, the scopes it
needs there (written here, independently of the code's table), and one variant per name it
carries with that one name moved under ``orders/``. Each request is sent with no token, an unknown
token, read on ``pub/``, write on ``pub/``, both, admin on ``pub/``, read and admin, all three, a
grant on ``orders/`` only, read and write on everything (no admin) and every scope on everything. A refusal must be the guard's (401, or 403 ``forbidden``) and change nothing a client
can observe; an allowed request must not be refused by the guard (the app may still say no). And
docs/security.md shows the code's table.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig
from onceflow.server.guard import ENDPOINTS, Guard, GuardConfig, refused_before_body, scope_table

pytestmark = pytest.mark.anyio
S = "/v1/stream/"
SUBS = "/v1/stream/__ds/subscriptions"
JSON = {"content-type": "application/json"}
GRANTS: dict[str, list[dict[str, Any]]] = {
    "pub-r": [{"prefix": "pub/", "scopes": ["read"]}],
    "pub-w": [{"prefix": "pub/", "scopes": ["write"]}],
    "pub-rw": [{"prefix": "pub/", "scopes": ["read", "write"]}],
    "pub-a": [{"prefix": "pub/", "scopes": ["admin"]}],
    "pub-ra": [{"prefix": "pub/", "scopes": ["read", "admin"]}],
    "pub-all": [{"prefix": "pub/", "scopes": ["read", "write", "admin"]}],
    "other": [{"prefix": "orders/", "scopes": ["read", "write", "admin"]}],
    "rw-all": [{"prefix": "", "scopes": ["read", "write"]}],  # everything but the operator's and the scraper's scopes
    "admin": [{"prefix": "", "scopes": ["read", "write", "admin", "metrics"]}],
}
WHO: list[str | None] = [None, "unknown", "wake", *GRANTS]  # no token, an unknown one, the claim token, the grants
PUB_SCOPES = {
    "pub-r": {"read"},
    "pub-w": {"write"},
    "pub-rw": {"read", "write"},
    "pub-a": {"admin"},
    "pub-ra": {"read", "admin"},
    "pub-all": {"read", "write", "admin"},
}


@dataclass
class World:
    """A broker with the same things under pub/ and orders/, reached directly (``raw``) or
    through the guard (``guarded``)."""

    broker: Broker
    app: App
    raw: httpx.AsyncClient
    guarded: httpx.AsyncClient
    facts: dict[str, Any] = field(default_factory=dict)


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    broker = Broker(tmp_path / "data")
    broker.open()
    app = App(broker, AppConfig(long_poll_timeout=0.2))
    guard = Guard(app, broker, GuardConfig.from_json({"tokens": {name: grants for name, grants in GRANTS.items()}}))
    async with (
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as raw,
        httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://t") as guarded,
    ):
        w = World(broker, app, raw, guarded)
        await populate(w)
        yield w
    await app.subscriptions.close()
    await broker.close()


async def populate(w: World) -> None:
    c = w.raw
    for tenant in ("pub", "orders"):
        for name in ("s", "wake"):
            assert (await c.put(f"{S}{tenant}/{name}", headers=JSON)).status_code == 201
        r = await c.post(f"{S}{tenant}/s", content=b'{"n":1}', headers=JSON)
        w.facts[f"{tenant}/tail"] = r.headers["stream-next-offset"]
        epoch = (await c.post(f"/v1/txn/{tenant}/t/init", json={})).json()["epoch"]
        h = {
            **JSON,
            "producer-id": f"txn:{tenant}/t",
            "producer-epoch": str(epoch),
            "producer-seq": "0",
            "transaction-id": f"{tenant}/t",
        }
        r = await c.post(f"{S}{tenant}/s", content=b'{"t":1}', headers=h)
        assert r.status_code == 200, r.text
        w.facts[f"{tenant}/txn"] = {"id": f"{tenant}/t", "epoch": epoch, "txn": int(r.headers["transaction-number"])}
        r = await c.post(f"/v1/groups/{tenant}/g/offsets", json={"offsets": {f"{tenant}/s": w.facts[f"{tenant}/tail"]}})
        assert r.status_code == 200, r.text
        assert (await c.post(f"/v1/sinks/{tenant}/k/commit", json={"batch": 1, "members": []})).status_code == 200
        sid = f"{tenant}sub"
        config = {"type": "pull-wake", "pattern": f"{tenant}/e/*", "wake_stream": f"{tenant}/wake"}
        assert (await c.put(f"{SUBS}/{sid}", json=config)).status_code == 201
        assert (await c.put(f"{S}{tenant}/e/a", content=b'{"e":1}', headers=JSON)).status_code == 201
        w.facts[sid] = sid
    # pub's subscription is claimed, so that its wake routes can be tried with the claim token
    claim = (await c.post(f"{SUBS}/pubsub/claim", json={"worker": "w"})).json()
    w.facts["claim"] = claim
    other = (await c.post(f"{SUBS}/orderssub/claim", json={"worker": "w"})).json()
    w.facts["other-claim"] = other


async def snapshot(w: World) -> dict[str, Any]:
    """Everything a client could observe, read around the guard."""
    c = w.raw
    streams = (await c.get("/v1/streams")).json()["streams"]
    out: dict[str, Any] = {"streams": streams}
    for s in streams:
        out[s["name"]] = (await c.get(S + s["name"], params={"offset": "-1", "isolation": "read_uncommitted"})).content
    coord = w.broker.coordinator
    out["txns"] = {tid: (m.epoch, m.txn, m.status.value, sorted(m.streams)) for tid, m in coord.txns.items()}
    out["groups"] = {g: dict(o) for g, o in coord.groups.items()}
    out["sinks"] = dict(coord.sinks)
    out["subs"] = {
        sid: (
            sub.config.to_json(),
            sub.generation,
            sub.wake_id,
            sub.holder,
            {p: (k.explicit, k.glob, k.acked) for p, k in sub.links.items()},
        )
        for sid, sub in w.app.subscriptions.manager.subs.items()
    }
    return out


@dataclass(frozen=True)
class Case:
    """A request under pub/ for one endpoint, the scopes it needs on pub/ ("anyone", "token": any
    valid token, "wake": the claim token), and variants with one name moved under orders/."""

    endpoint: str
    needs: frozenset[str] | str
    build: Callable[[World], tuple[str, str, dict[str, str], Any]]
    outside: dict[str, Callable[[World], tuple[str, str, dict[str, str], Any]]] = field(default_factory=dict)


def req(method: str, path: str, body: Any = None, **headers: str) -> tuple[str, str, dict[str, str], Any]:
    return method, path, {k.replace("_", "-"): v for k, v in headers.items()}, body


def txn_headers(w: World, tenant: str, seq: str) -> dict[str, str]:
    t = w.facts[f"{tenant}/txn"]
    return {
        "content_type": "application/json",
        "producer_id": f"txn:{t['id']}",
        "producer_epoch": str(t["epoch"]),
        "producer_seq": seq,
        "transaction_id": t["id"],
    }


R, W, RW = frozenset({"read"}), frozenset({"write"}), frozenset({"read", "write"})
A, RA, RWA = frozenset({"admin"}), frozenset({"read", "admin"}), frozenset({"read", "write", "admin"})
SUB_SPEC = {"type": "pull-wake", "pattern": "pub/x/*", "streams": ["pub/s"], "wake_stream": "pub/wake"}

CASES: list[Case] = [
    Case(
        "stream.read",
        R,
        lambda w: req("GET", S + "pub/s?offset=-1"),
        {"path": lambda w: req("GET", S + "orders/s?offset=-1")},
    ),
    Case(
        "stream.read",
        R,
        lambda w: req("GET", S + "pub/s?offset=-1&format=records"),
        {"path": lambda w: req("GET", S + "orders/s?offset=-1&format=records")},
    ),
    Case("stream.head", R, lambda w: req("HEAD", S + "pub/s"), {"path": lambda w: req("HEAD", S + "orders/s")}),
    Case(
        "stream.create",
        W,
        lambda w: req("PUT", S + "pub/new", content_type="application/json"),
        {"path": lambda w: req("PUT", S + "orders/new", content_type="application/json")},
    ),
    Case(
        "stream.create",
        RW,
        lambda w: req("PUT", S + "pub/fork", content_type="application/json", stream_forked_from="pub/s"),
        {
            "path": lambda w: req(
                "PUT", S + "orders/fork", content_type="application/json", stream_forked_from="pub/s"
            ),
            "Stream-Forked-From": lambda w: req(
                "PUT", S + "pub/fork", content_type="application/json", stream_forked_from="orders/s"
            ),
            "Stream-Forked-From (URL)": lambda w: req(
                "PUT", S + "pub/fork", content_type="application/json", stream_forked_from="/v1/stream/orders/s"
            ),
        },
    ),
    Case(
        "stream.append",
        W,
        lambda w: req("POST", S + "pub/s", b'{"n":2}', content_type="application/json"),
        {"path": lambda w: req("POST", S + "orders/s", b'{"n":2}', content_type="application/json")},
    ),
    Case(
        "stream.append",
        W,
        lambda w: req("POST", S + "pub/s", b'{"t":2}', **txn_headers(w, "pub", "1")),
        {
            "path": lambda w: req("POST", S + "orders/s", b'{"t":2}', **txn_headers(w, "pub", "1")),
            "Transaction-Id": lambda w: req("POST", S + "pub/s", b'{"t":2}', **txn_headers(w, "orders", "1")),
            "Producer-Id txn:": lambda w: req(
                "POST",
                S + "pub/s",
                b'{"t":2}',
                **{k: v for k, v in txn_headers(w, "orders", "0").items() if k != "transaction_id"},
            ),
        },
    ),
    Case("stream.delete", W, lambda w: req("DELETE", S + "pub/s"), {"path": lambda w: req("DELETE", S + "orders/s")}),
    Case(
        "stream.other",
        W,
        lambda w: req("PATCH", S + "pub/s", b"x"),
        {"path": lambda w: req("PATCH", S + "orders/s", b"x")},
    ),
    Case(
        "streams.list",
        R,
        lambda w: req("GET", "/v1/streams?prefix=pub/"),
        {
            "prefix": lambda w: req("GET", "/v1/streams?prefix=orders/"),
            "no prefix": lambda w: req("GET", "/v1/streams"),
            "short prefix": lambda w: req("GET", "/v1/streams?prefix=pu"),
        },
    ),
    Case(
        "txns.list",
        A,
        lambda w: req("GET", "/v1/txn?prefix=pub/&open=true"),
        {
            "prefix": lambda w: req("GET", "/v1/txn?prefix=orders/"),
            "another tenant's sink tasks": lambda w: req("GET", "/v1/txn?prefix=spark/orders/"),
            "all the sink tasks": lambda w: req("GET", "/v1/txn?prefix=spark/"),
            "no prefix": lambda w: req("GET", "/v1/txn"),
            "short prefix": lambda w: req("GET", "/v1/txn?prefix=pu"),
        },
    ),
    Case("txns.list", A, lambda w: req("GET", "/v1/txn?prefix=spark/pub/k/")),  # the tasks of sink pub/k
    Case("txn.read", R, lambda w: req("GET", "/v1/txn/pub/t"), {"path": lambda w: req("GET", "/v1/txn/orders/t")}),
    Case(
        "txn.init",
        W,
        lambda w: req("POST", "/v1/txn/pub/t2/init", {}),
        {"path": lambda w: req("POST", "/v1/txn/orders/t2/init", {})},
    ),
    Case(
        "txn.end",
        W,
        lambda w: req("POST", "/v1/txn/pub/t/abort", {k: w.facts["pub/txn"][k] for k in ("epoch", "txn")}),
        {
            "path": lambda w: req(
                "POST", "/v1/txn/orders/t/abort", {k: w.facts["orders/txn"][k] for k in ("epoch", "txn")}
            )
        },
    ),
    Case(
        "txn.offsets",
        RW,
        lambda w: req(
            "POST",
            "/v1/txn/pub/t/offsets",
            {"epoch": w.facts["pub/txn"]["epoch"], "group": "pub/g", "offsets": {"pub/s": w.facts["pub/tail"]}},
        ),
        {
            "path": lambda w: req(
                "POST",
                "/v1/txn/orders/t/offsets",
                {"epoch": w.facts["orders/txn"]["epoch"], "group": "pub/g", "offsets": {"pub/s": w.facts["pub/tail"]}},
            ),
            "group": lambda w: req(
                "POST",
                "/v1/txn/pub/t/offsets",
                {"epoch": w.facts["pub/txn"]["epoch"], "group": "orders/g", "offsets": {"pub/s": w.facts["pub/tail"]}},
            ),
            "offsets stream": lambda w: req(
                "POST",
                "/v1/txn/pub/t/offsets",
                {
                    "epoch": w.facts["pub/txn"]["epoch"],
                    "group": "pub/g",
                    "offsets": {"orders/s": w.facts["orders/tail"]},
                },
            ),
        },
    ),
    Case(
        "txn.force_abort",
        A,
        lambda w: req("POST", "/v1/txn/pub/t/force-abort", {}),
        {"path": lambda w: req("POST", "/v1/txn/orders/t/force-abort", {})},
    ),
    Case("txn.other", W, lambda w: req("PUT", "/v1/txn/pub/t"), {"path": lambda w: req("PUT", "/v1/txn/orders/t")}),
    Case(
        "txn.delete", A, lambda w: req("DELETE", "/v1/txn/pub/t"), {"path": lambda w: req("DELETE", "/v1/txn/orders/t")}
    ),
    Case(
        "groups.list",
        A,
        lambda w: req("GET", "/v1/groups?prefix=pub/"),
        {
            "prefix": lambda w: req("GET", "/v1/groups?prefix=orders/"),
            "no prefix": lambda w: req("GET", "/v1/groups"),
        },
    ),
    Case(
        "group.read",
        R,
        lambda w: req("GET", "/v1/groups/pub/g/offsets"),
        {"path": lambda w: req("GET", "/v1/groups/orders/g/offsets")},
    ),
    Case(
        "group.delete",
        A,
        lambda w: req("DELETE", "/v1/groups/pub/g"),
        {"path": lambda w: req("DELETE", "/v1/groups/orders/g")},
    ),
    Case(
        "group.commit",
        RW,
        lambda w: req("POST", "/v1/groups/pub/g/offsets", {"offsets": {"pub/s": w.facts["pub/tail"]}}),
        {
            "path": lambda w: req("POST", "/v1/groups/orders/g/offsets", {"offsets": {"pub/s": w.facts["pub/tail"]}}),
            "offsets stream": lambda w: req(
                "POST", "/v1/groups/pub/g/offsets", {"offsets": {"orders/s": "0000000000000000_0000000000000000"}}
            ),
        },
    ),
    Case(
        "group.commit",
        RWA,  # a rewind is an operator's act
        lambda w: req("POST", "/v1/groups/pub/g/offsets", {"offsets": {"pub/s": w.facts["pub/tail"]}, "reset": True}),
        {
            "path": lambda w: req(
                "POST", "/v1/groups/orders/g/offsets", {"offsets": {"pub/s": w.facts["pub/tail"]}, "reset": True}
            ),
            "offsets stream": lambda w: req(
                "POST",
                "/v1/groups/pub/g/offsets",
                {"offsets": {"orders/s": "0000000000000000_0000000000000000"}, "reset": True},
            ),
        },
    ),
    Case(
        "group.reset",
        RA,  # no streams named: it moves the group in every stream it holds (pub/s), which it must read
        lambda w: req("POST", "/v1/groups/pub/g/reset", {"to": "earliest"}),
        {"path": lambda w: req("POST", "/v1/groups/orders/g/reset", {"to": "earliest"})},
    ),
    Case(
        "group.reset",
        RA,
        lambda w: req("POST", "/v1/groups/pub/g/reset", {"to": "latest", "streams": ["pub/s"]}),
        {
            "path": lambda w: req("POST", "/v1/groups/orders/g/reset", {"to": "latest", "streams": ["pub/s"]}),
            "streams": lambda w: req("POST", "/v1/groups/pub/g/reset", {"to": "latest", "streams": ["orders/s"]}),
            "offsets stream": lambda w: req(
                "POST", "/v1/groups/pub/g/reset", {"to": "offsets", "offsets": {"orders/s": w.facts["orders/tail"]}}
            ),
        },
    ),
    Case(
        "group.other",
        W,
        lambda w: req("POST", "/v1/groups/pub/g/bogus", {}),
        {"path": lambda w: req("POST", "/v1/groups/orders/g/bogus", {})},
    ),
    Case(
        "sinks.list",
        A,
        lambda w: req("GET", "/v1/sinks?prefix=pub/"),
        {
            "prefix": lambda w: req("GET", "/v1/sinks?prefix=orders/"),
            "no prefix": lambda w: req("GET", "/v1/sinks"),
        },
    ),
    Case("sink.read", R, lambda w: req("GET", "/v1/sinks/pub/k"), {"path": lambda w: req("GET", "/v1/sinks/orders/k")}),
    Case(
        "sink.post",
        W,
        lambda w: req(
            "POST", "/v1/sinks/pub/k/commit", {"batch": 2, "members": [w.facts["pub/txn"]], "abort_prefix": "pub/x/"}
        ),
        {
            "path": lambda w: req("POST", "/v1/sinks/orders/k/commit", {"batch": 2, "members": [w.facts["pub/txn"]]}),
            "member": lambda w: req("POST", "/v1/sinks/pub/k/commit", {"batch": 2, "members": [w.facts["orders/txn"]]}),
            "abort_prefix": lambda w: req(
                "POST", "/v1/sinks/pub/k/commit", {"batch": 2, "members": [], "abort_prefix": "orders/"}
            ),
            "abort_prefix everything": lambda w: req(
                "POST", "/v1/sinks/pub/k/commit", {"batch": 2, "members": [], "abort_prefix": "p"}
            ),
            "one-segment sink": lambda w: req("POST", "/v1/sinks/pub/abort", {"members": [], "abort_prefix": "pub/"}),
        },
    ),
    Case(
        "sink.post",
        W,
        lambda w: req("POST", "/v1/sinks/pub/k/abort", {"members": [w.facts["pub/txn"]], "abort_prefix": "pub/"}),
        {
            "member": lambda w: req("POST", "/v1/sinks/pub/k/abort", {"members": [w.facts["orders/txn"]]}),
            "abort_prefix": lambda w: req("POST", "/v1/sinks/pub/k/abort", {"members": [], "abort_prefix": "orders/"}),
        },
    ),
    Case(
        "sink.post",
        W,
        lambda w: req("POST", "/v1/sinks/pub/k/begin", {"query": "q", "batch": 0, "partition": 0, "task": "t1"}),
        {
            "path": lambda w: req(
                "POST", "/v1/sinks/orders/k/begin", {"query": "q", "batch": 0, "partition": 0, "task": "t1"}
            ),
        },
    ),
    Case(
        "sink.post",
        W,
        lambda w: req("POST", "/v1/sinks/pub/k/abort", {"members": [], "abort_prefix": "spark/pub/k/"}),
        {
            # a sink task's id, spark/<sink id>/..., belongs to the tenant of the sink id
            "abort_prefix of another tenant's tasks": lambda w: req(
                "POST", "/v1/sinks/pub/k/abort", {"members": [], "abort_prefix": "spark/orders/"}
            ),
            "all the tasks": lambda w: req("POST", "/v1/sinks/pub/k/abort", {"members": [], "abort_prefix": "spark/"}),
        },
    ),
    Case(
        "sink.reset",
        A,
        lambda w: req("POST", "/v1/sinks/pub/k/reset", {"owner": None}),
        {
            "path": lambda w: req("POST", "/v1/sinks/orders/k/reset", {"owner": None}),
        },
    ),
    Case(
        "sink.other",
        W,
        lambda w: req("DELETE", "/v1/sinks/pub/k"),
        {"path": lambda w: req("DELETE", "/v1/sinks/orders/k")},
    ),
    Case("subs.jwks", "anyone", lambda w: req("GET", f"{S}__ds/jwks.json")),
    Case(
        "subs.create",
        RW,
        lambda w: req("PUT", f"{SUBS}/new", SUB_SPEC),
        {
            "pattern": lambda w: req("PUT", f"{SUBS}/new", {**SUB_SPEC, "pattern": "orders/*"}),
            "pattern **": lambda w: req("PUT", f"{SUBS}/new", {**SUB_SPEC, "pattern": "**"}),
            "pattern pub/** (matches the stream pub)": lambda w: req(
                "PUT", f"{SUBS}/new", {**SUB_SPEC, "pattern": "pub/**"}
            ),
            "pattern */s": lambda w: req("PUT", f"{SUBS}/new", {**SUB_SPEC, "pattern": "*/s"}),
            "streams": lambda w: req("PUT", f"{SUBS}/new", {**SUB_SPEC, "streams": ["pub/s", "/orders/s/"]}),
            "wake_stream": lambda w: req("PUT", f"{SUBS}/new", {**SUB_SPEC, "wake_stream": "orders/wake"}),
            "an existing subscription of orders/": lambda w: req("PUT", f"{SUBS}/orderssub", SUB_SPEC),
        },
    ),
    Case(
        "subs.create",
        R,
        lambda w: req(
            "PUT",
            f"{SUBS}/hook",
            {"type": "webhook", "pattern": "pub/x/*", "webhook": {"url": "https://hooks.example.com/x"}},
        ),
        {
            "pattern": lambda w: req(
                "PUT",
                f"{SUBS}/hook",
                {"type": "webhook", "pattern": "orders/*", "webhook": {"url": "https://hooks.example.com/x"}},
            ),
        },
    ),
    Case(
        "subs.read",
        RW,
        lambda w: req("GET", f"{SUBS}/pubsub"),
        {"subscription": lambda w: req("GET", f"{SUBS}/orderssub")},
    ),
    Case(
        "subs.delete",
        RW,
        lambda w: req("DELETE", f"{SUBS}/pubsub"),
        {"subscription": lambda w: req("DELETE", f"{SUBS}/orderssub")},
    ),
    Case(
        "subs.add_streams",
        RW,
        lambda w: req("POST", f"{SUBS}/pubsub/streams", {"streams": ["pub/s"]}),
        {
            "subscription": lambda w: req("POST", f"{SUBS}/orderssub/streams", {"streams": ["pub/s"]}),
            "streams": lambda w: req("POST", f"{SUBS}/pubsub/streams", {"streams": ["pub/s", "orders/s"]}),
        },
    ),
    Case(
        "subs.remove_stream",
        RW,
        lambda w: req("DELETE", f"{SUBS}/pubsub/streams/pub%2Fs"),
        {
            "subscription": lambda w: req("DELETE", f"{SUBS}/orderssub/streams/pub%2Fs"),
            "path": lambda w: req("DELETE", f"{SUBS}/pubsub/streams/orders%2Fs"),
        },
    ),
    Case(
        "subs.claim",
        RW,
        lambda w: req("POST", f"{SUBS}/pubsub/claim", {"worker": "w2"}),
        {"subscription": lambda w: req("POST", f"{SUBS}/orderssub/claim", {"worker": "w2"})},
    ),
    Case(
        "subs.wake",
        "wake",
        lambda w: req("POST", f"{SUBS}/pubsub/release", {k: w.facts["claim"][k] for k in ("wake_id", "generation")}),
    ),
    Case(
        "subs.other",
        RW,
        lambda w: req("POST", f"{SUBS}/pubsub/bogus", {}),
        {"subscription": lambda w: req("POST", f"{SUBS}/orderssub/bogus", {})},
    ),
    Case("metrics", frozenset({"metrics"}), lambda w: req("GET", "/metrics")),
    Case("metrics", frozenset({"metrics"}), lambda w: req("POST", "/metrics")),  # 405 past the guard
    Case("ui", "anyone", lambda w: req("GET", "/ui")),
    Case("other", "token", lambda w: req("GET", "/v2/pub/s")),
]


def expected_refusal(needs: frozenset[str] | str, who: str | None) -> int | None:
    if needs == "anyone":
        return None
    if needs == "wake":
        return None if who == "wake" else 401
    if who is None or who in ("unknown", "wake"):
        return 401
    if needs == "token" or who == "admin":
        return None
    assert isinstance(needs, frozenset)
    if who == "rw-all":
        return None if needs <= {"read", "write"} else 403
    if who == "other":
        return 403
    return None if needs <= PUB_SCOPES[who] else 403  # a pub/ grant never has the whole server's metrics


async def send(w: World, who: str | None, request: tuple[str, str, dict[str, str], Any]) -> httpx.Response:
    method, path, headers, body = request
    headers = dict(headers)
    if who == "wake":
        headers["authorization"] = f"Bearer {w.facts['claim']['token']}"
    elif who is not None:
        headers["authorization"] = f"Bearer {who}"
    if isinstance(body, bytes):
        return await w.guarded.request(method, path, headers=headers, content=body)
    return await w.guarded.request(method, path, headers=headers, json=body)


def refused_by_guard(r: httpx.Response) -> int | None:
    if r.status_code == 401:
        return 401
    if r.status_code == 403 and (r.request.method == "HEAD" or r.json()["error"]["code"] == "forbidden"):
        return 403
    return None


def test_every_endpoint_of_the_table_has_a_case() -> None:
    assert {c.endpoint for c in CASES} == {e.key for e in ENDPOINTS}


@pytest.mark.parametrize("case", CASES, ids=[f"{c.endpoint}-{i}" for i, c in enumerate(CASES)])
async def test_each_grant_is_refused_or_allowed_and_a_refusal_changes_nothing(world: World, case: Case) -> None:
    request = case.build(world)
    order = sorted(WHO, key=lambda t: expected_refusal(case.needs, t) is None)  # refusals first, on untouched state
    for who in order:
        expected = expected_refusal(case.needs, who)
        before = await snapshot(world)
        r = await send(world, who, request)
        assert refused_by_guard(r) == expected, (case.endpoint, who, r.status_code, r.text)
        assert r.status_code < 500, r.text
        if expected is not None:
            assert await snapshot(world) == before, (case.endpoint, who)


VARIANTS = [(c, label) for c in CASES for label in c.outside]


@pytest.mark.parametrize(("case", "label"), VARIANTS, ids=[f"{c.endpoint}-{label}" for c, label in VARIANTS])
async def test_every_name_a_request_carries_is_checked(world: World, case: Case, label: str) -> None:
    """With every scope on pub/, a request naming one thing under orders/ is refused, changing
    nothing; the same request from the admin gets past the guard (so the name is what was refused)."""
    request = case.outside[label](world)
    before = await snapshot(world)
    r = await send(world, "pub-all", request)
    assert refused_by_guard(r) == 403, (label, r.status_code, r.text)
    assert await snapshot(world) == before
    r = await send(world, "admin", request)
    assert refused_by_guard(r) is None and r.status_code < 500, (label, r.status_code, r.text)


PASSED_ON = 299  # the answer of a stand-in for a follower's forward: the early check let the request through
EVERY_REQUEST = [(c, label) for c in CASES for label in ("", *c.outside)]


@pytest.mark.parametrize(
    ("case", "label"), EVERY_REQUEST, ids=[f"{c.endpoint}-{label or 'pub'}" for c, label in EVERY_REQUEST]
)
async def test_a_follower_refuses_before_the_body_what_the_guard_refuses_and_so(
    world: World, case: Case, label: str
) -> None:
    """Issue 28, item 1: a follower (server/leader.py) refuses what it can tell from a request's path
    and headers before it reads the body (:func:`refused_before_body`), with the leader's guard's
    own answer, word for word; and for an endpoint whose names are all in its path and headers (an
    append, a read) it refuses everything the guard refuses, so that no such body is ever held for a
    request the leader would refuse. Except a wake token's: which subscription it was issued for
    only the leader knows (a follower refuses only a missing one)."""
    config = GuardConfig.from_json({"tokens": GRANTS})

    async def follower(scope: Any, receive: Any, send: Any) -> None:
        if not await refused_before_body(config, scope, send):
            await send({"type": "http.response.start", "status": PASSED_ON, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    request = case.outside[label](world) if label else case.build(world)
    endpoint = next(e for e in ENDPOINTS if e.key == case.endpoint)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=follower), base_url="http://t") as early:
        for who in WHO if not label else ["pub-all"]:
            refused = await send(World(world.broker, world.app, world.raw, early, world.facts), who, request)
            expected = 403 if label else expected_refusal(case.needs, who)
            if refused.status_code == PASSED_ON:
                early_enough = endpoint.body == "none" and endpoint.auth != "wake_token"
                assert not early_enough or expected is None, (case.endpoint, label, who)
                continue
            by_guard = await send(world, who, request)  # refused: nothing changes
            assert (refused.status_code, refused.headers.raw, refused.content) == (
                by_guard.status_code,
                by_guard.headers.raw,
                by_guard.content,
            ), (case.endpoint, label, who)


async def test_a_wake_token_opens_only_its_own_subscription(world: World) -> None:
    release = {k: world.facts["claim"][k] for k in ("wake_id", "generation")}
    before = await snapshot(world)
    for token in (world.facts["other-claim"]["token"], "admin", "v1.AAAA.AAAA"):
        r = await world.guarded.post(
            f"{SUBS}/pubsub/release", json=release, headers={"authorization": f"Bearer {token}"}
        )
        assert r.status_code == 401, r.text
    r = await world.guarded.post(
        f"{SUBS}/orderssub/ack", json=release, headers={"authorization": f"Bearer {world.facts['claim']['token']}"}
    )
    assert r.status_code == 401
    assert await snapshot(world) == before


def test_the_scope_table_in_docs_security_md_is_the_code_table() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    begin, end = "<!-- scope-table: generated from server/guard.py ENDPOINTS -->\n", "<!-- /scope-table -->"
    assert begin in doc and end in doc, "docs/security.md lost its scope-table markers"
    shown = doc.split(begin, 1)[1].split(end, 1)[0]
    assert shown == scope_table(), "docs/security.md's scope table differs from the code; paste scope_table() there"
