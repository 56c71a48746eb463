"""Tenancy under the guard: every name a request carries is checked, not only its path (issue 15).

A token granted only ``pub/`` must not reach another tenant's streams, transactions, groups, sinks
or subscriptions through a header or a body field. Each test plays one attack end to end and
checks that it is refused and that nothing changed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig
from onceflow.server.guard import Guard, GuardConfig

pytestmark = pytest.mark.anyio
S = "/v1/stream/"
SUBS = "/v1/stream/__ds/subscriptions"
JSON = {"content-type": "application/json"}
TOKENS = {
    "tokens": {
        "pub": [{"prefix": "pub/", "scopes": ["read", "write"]}],
        "admin": [{"prefix": "", "scopes": ["read", "write"]}],
        # a tenant whose prefix is also a prefix of "spark/", where every sink's task ids live
        "s": [{"prefix": "s", "scopes": ["read", "write", "admin"]}],
        # what an operator had to grant before for subscriptions to work at all: "__ds/" as a name
        "pub+ds": [{"prefix": "pub/", "scopes": ["read", "write"]}, {"prefix": "__ds/", "scopes": ["read", "write"]}],
        # a consumer reading "orders/" that keeps its group under "pub/", and the operator of "pub/"
        "consumer": [{"prefix": "pub/", "scopes": ["read", "write"]}, {"prefix": "orders/", "scopes": ["read"]}],
        "pubops": [{"prefix": "pub/", "scopes": ["read", "write", "admin"]}],
    },
    "limits": {"producers_per_stream": 1},
}


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


PUB = bearer("pub")
PUBDS = bearer("pub+ds")
ADMIN = bearer("admin")
CONSUMER = bearer("consumer")
PUBOPS = bearer("pubops")


@dataclass
class Guarded:
    broker: Broker
    app: App
    client: httpx.AsyncClient


@pytest.fixture
async def g(tmp_path: Path) -> AsyncIterator[Guarded]:
    broker = Broker(tmp_path / "data")
    broker.open()
    app = App(broker, AppConfig(long_poll_timeout=0.3))
    guard = Guard(app, broker, GuardConfig.from_json(TOKENS))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://t") as client:
        yield Guarded(broker, app, client)
    await app.subscriptions.close()
    await broker.close()


async def secret(c: httpx.AsyncClient) -> str:
    """orders/secret with one message, made by the admin; returns its tail."""
    assert (await c.put(S + "orders/secret", headers={**JSON, **ADMIN})).status_code == 201
    r = await c.post(S + "orders/secret", content=b'{"card":"4111"}', headers={**JSON, **ADMIN})
    assert r.status_code == 204
    return r.headers["stream-next-offset"]


async def open_txn(c: httpx.AsyncClient, tid: str, stream: str) -> tuple[int, int]:
    """The admin opens a transaction of ``tid`` with one message in ``stream``; (epoch, txn)."""
    epoch = (await c.post(f"/v1/txn/{tid}/init", json={}, headers=ADMIN)).json()["epoch"]
    h = {
        **JSON,
        **ADMIN,
        "producer-id": f"txn:{tid}",
        "producer-epoch": str(epoch),
        "producer-seq": "0",
        "transaction-id": tid,
    }
    r = await c.post(S + stream, content=b'{"t":1}', headers=h)
    assert r.status_code == 200, r.text
    return epoch, int(r.headers["transaction-number"])


async def txn_state(c: httpx.AsyncClient, tid: str) -> dict[str, Any]:
    r = await c.get(f"/v1/txn/{tid}", headers=ADMIN)
    return r.json() if r.status_code == 200 else {"status_code": r.status_code}


def forbidden(r: httpx.Response) -> bool:
    return r.status_code == 403 and r.json()["error"]["code"] == "forbidden"


# ---------------------------------------------------------------------- item 1: forks


async def test_a_fork_of_a_stream_outside_the_grant_is_refused(g: Guarded) -> None:
    await secret(g.client)
    r = await g.client.put(S + "pub/copy", headers={**JSON, **PUB, "stream-forked-from": "orders/secret"})
    assert forbidden(r), r.text
    assert (await g.client.head(S + "pub/copy", headers=ADMIN)).status_code == 404
    r = await g.client.put(S + "pub/copy", headers={**JSON, **PUB, "stream-forked-from": "/v1/stream/orders/secret"})
    assert forbidden(r), r.text
    assert (await g.client.head(S + "pub/copy", headers=ADMIN)).status_code == 404


# ---------------------------------------------------------------------- item 2: sinks


async def test_a_sink_abort_prefix_outside_the_grant_is_refused(g: Guarded) -> None:
    c = g.client
    await secret(c)
    await open_txn(c, "orders/t1", "orders/secret")
    before = await txn_state(c, "orders/t1")
    r = await c.post("/v1/sinks/pub/abort", json={"members": [], "abort_prefix": "orders/"}, headers=PUB)
    assert forbidden(r), r.text
    r = await c.post("/v1/sinks/pub/s1/abort", json={"members": [], "abort_prefix": "orders/"}, headers=PUB)
    assert forbidden(r), r.text
    assert await txn_state(c, "orders/t1") == before and before["status"] == "ongoing"


async def test_a_prefix_of_spark_slash_does_not_reach_other_tenants_sink_tasks(g: Guarded) -> None:
    """A sink task's id ``spark/<sink id>/...`` is checked as its sink id's. A listing or an
    ``abort_prefix`` shorter than ``spark/`` (``s``, ``spark``) takes in every sink's tasks, so it
    must not be checked as itself: a tenant granted ``s`` listed (names of other tenants' streams
    with them) and aborted the tasks of sink ``orders/k``."""
    c = g.client
    await secret(c)
    await open_txn(c, "spark/orders/k/p0", "orders/secret")
    before = await txn_state(c, "spark/orders/k/p0")
    S_TENANT = bearer("s")
    for prefix in ("s", "spark"):
        r = await c.get("/v1/txn", params={"prefix": prefix}, headers=S_TENANT)
        assert forbidden(r) or r.json()["transactions"] == [], r.text
        body: dict[str, Any] = {"members": [], "abort_prefix": prefix}
        r = await c.post("/v1/sinks/s/k/abort", json=body, headers=S_TENANT)
        assert forbidden(r), r.text
    assert await txn_state(c, "spark/orders/k/p0") == before and before["status"] == "ongoing"
    # the tenant's own ids under its prefix are still its to list
    assert (await c.get("/v1/txn", params={"prefix": "s/"}, headers=S_TENANT)).status_code == 200


async def test_a_sink_member_outside_the_grant_is_refused(g: Guarded) -> None:
    c = g.client
    await secret(c)
    epoch, txn = await open_txn(c, "orders/t1", "orders/secret")
    before = await txn_state(c, "orders/t1")
    for path in ("/v1/sinks/pub/commit", "/v1/sinks/pub/s1/commit"):
        r = await c.post(path, json={"members": [{"id": "orders/t1", "epoch": epoch, "txn": txn}]}, headers=PUB)
        assert forbidden(r), r.text
    assert await txn_state(c, "orders/t1") == before
    r = await c.get(S + "orders/secret", params={"offset": "-1"}, headers=ADMIN)
    assert r.json() == [{"card": "4111"}]  # the open transaction was not committed


async def test_sink_ids_are_names_under_the_grant(g: Guarded) -> None:
    """A sink id may hold '/' (the path's last segment is the action), so it can live under a grant."""
    c = g.client
    assert (await c.put(S + "pub/out", headers={**JSON, **PUB})).status_code == 201
    epoch, txn = (await c.post("/v1/txn/pub/w1/init", json={}, headers=PUB)).json()["epoch"], 0
    h = {
        **JSON,
        **PUB,
        "producer-id": "txn:pub/w1",
        "producer-epoch": str(epoch),
        "producer-seq": "0",
        "transaction-id": "pub/w1",
    }
    txn = int((await c.post(S + "pub/out", content=b'{"n":1}', headers=h)).headers["transaction-number"])
    r = await c.post(
        "/v1/sinks/pub/s1/commit",
        json={"batch": 3, "members": [{"id": "pub/w1", "epoch": epoch, "txn": txn}]},
        headers=PUB,
    )
    assert r.status_code == 200 and r.json() == {"sink": "pub/s1", "status": "committed", "batch": 3}
    assert (await c.get("/v1/sinks/pub/s1", headers=PUB)).json() == {
        "sink": "pub/s1",
        "batch": 3,
        "owner": None,
        "rows": None,
    }
    assert forbidden(await c.get("/v1/sinks/orders/s1", headers=PUB))


# ---------------------------------------------------------------------- item 3: groups


async def test_transaction_offsets_for_a_group_outside_the_grant_are_refused(g: Guarded) -> None:
    c = g.client
    await secret(c)
    tail = (await c.head(S + "orders/secret", headers=ADMIN)).headers["stream-next-offset"]
    assert (
        await c.post("/v1/groups/orders/g/offsets", json={"offsets": {"orders/secret": tail}}, headers=ADMIN)
    ).status_code == 200
    assert (await c.put(S + "pub/x", headers={**JSON, **PUB})).status_code == 201
    epoch = (await c.post("/v1/txn/pub/t9/init", json={}, headers=PUB)).json()["epoch"]
    r = await c.post(
        "/v1/txn/pub/t9/offsets",
        json={"epoch": epoch, "group": "orders/g", "offsets": {"orders/secret": "-1"}},
        headers=PUB,
    )
    assert r.status_code in (400, 403)  # "-1" is no offset this server issued; the group is refused either way
    start = "0000000000000000_0000000000000000"
    r = await c.post(
        "/v1/txn/pub/t9/offsets",
        json={"epoch": epoch, "group": "orders/g", "offsets": {"orders/secret": start}},
        headers=PUB,
    )
    assert forbidden(r), r.text
    r = await c.post(
        "/v1/txn/pub/t9/offsets",
        json={"epoch": epoch, "group": "pub/g", "offsets": {"orders/secret": start}},
        headers=PUB,
    )
    assert forbidden(r), r.text  # the offsets name a stream outside the grant
    r = await c.post("/v1/txn/pub/t9/commit", json={"epoch": epoch, "txn": 0}, headers=PUB)
    assert (await c.get("/v1/groups/orders/g/offsets", headers=ADMIN)).json()["offsets"] == {"orders/secret": tail}
    r = await c.post("/v1/groups/pub/g/offsets", json={"offsets": {"orders/secret": start}}, headers=PUB)
    assert forbidden(r), r.text
    assert (await c.get("/v1/groups/pub/g/offsets", headers=ADMIN)).json()["offsets"] == {}


# ---------------------------------------------------------------------- item 4: transactional appends


async def test_an_append_naming_a_transaction_outside_the_grant_is_refused(g: Guarded) -> None:
    c = g.client
    await secret(c)
    epoch = (await c.post("/v1/txn/orders/t2/init", json={}, headers=ADMIN)).json()["epoch"]
    before = await txn_state(c, "orders/t2")
    assert (await c.put(S + "pub/x", headers={**JSON, **PUB})).status_code == 201
    h = {
        **JSON,
        **PUB,
        "producer-id": "txn:orders/t2",
        "producer-epoch": str(epoch),
        "producer-seq": "0",
        "transaction-id": "orders/t2",
        "transaction-commit": "1",
    }
    assert forbidden(await c.post(S + "pub/x", content=b'{"x":1}', headers=h))
    del h["transaction-id"], h["transaction-commit"]  # the transactional producer's id alone is a name too
    assert forbidden(await c.post(S + "pub/x", content=b'{"x":1}', headers=h))
    assert await txn_state(c, "orders/t2") == before
    assert (
        await c.get(S + "pub/x", params={"offset": "-1", "isolation": "read_uncommitted"}, headers=PUB)
    ).json() == []


# ---------------------------------------------------------------------- item 5: subscriptions


async def test_a_subscription_pattern_or_wake_stream_outside_the_grant_is_refused(g: Guarded) -> None:
    c = g.client
    await secret(c)
    assert (await c.put(S + "pub/wake", headers={**JSON, **PUB})).status_code == 201
    for config in (
        {"type": "pull-wake", "pattern": "**", "wake_stream": "pub/wake"},
        {"type": "pull-wake", "pattern": "pub/**", "wake_stream": "pub/wake"},  # also matches the stream "pub"
        {"type": "pull-wake", "streams": ["orders/secret"], "wake_stream": "pub/wake"},
        {"type": "pull-wake", "pattern": "pub/*", "wake_stream": "orders/secret"},
    ):
        for token in (PUB, PUBDS):
            r = await c.put(f"{SUBS}/s1", json=config, headers=token)
            assert forbidden(r), (config, r.text)
        assert (await c.get(f"{SUBS}/s1", headers=ADMIN)).status_code == 404
    # another tenant's subscription can be neither read, changed, claimed nor deleted
    assert (await c.put(S + "orders/wake", headers={**JSON, **ADMIN})).status_code == 201
    r = await c.put(
        f"{SUBS}/theirs", json={"type": "pull-wake", "pattern": "orders/*", "wake_stream": "orders/wake"}, headers=ADMIN
    )
    assert r.status_code == 201
    for token in (PUB, PUBDS):
        assert forbidden(await c.get(f"{SUBS}/theirs", headers=token))
        assert forbidden(await c.post(f"{SUBS}/theirs/claim", json={"worker": "w"}, headers=token))
        assert forbidden(await c.post(f"{SUBS}/theirs/streams", json={"streams": ["pub/x"]}, headers=token))
        assert forbidden(await c.delete(f"{SUBS}/theirs", headers=token))
    assert (await c.get(f"{SUBS}/theirs", headers=ADMIN)).status_code == 200
    # within the grant all of it works
    r = await c.put(
        f"{SUBS}/mine", json={"type": "pull-wake", "pattern": "pub/*", "wake_stream": "pub/wake"}, headers=PUB
    )
    assert r.status_code == 201, r.text
    assert forbidden(await c.post(f"{SUBS}/mine/streams", json={"streams": ["orders/secret"]}, headers=PUB))
    assert [s["path"] for s in (await c.get(f"{SUBS}/mine", headers=PUB)).json()["streams"]] == []


# ---------------------------------------------------------------------- item 6: duplicated headers


async def test_a_duplicated_protocol_header_is_400_and_slips_past_no_limit(g: Guarded) -> None:
    c = g.client
    assert (await c.put(S + "pub/x", headers={**JSON, **PUB})).status_code == 201
    prod = [
        ("content-type", "application/json"),
        ("authorization", "Bearer pub"),
        ("producer-epoch", "0"),
        ("producer-seq", "0"),
    ]
    assert (await c.post(S + "pub/x", content=b"{}", headers=[*prod, ("producer-id", "p1")])).status_code == 200
    r = await c.post(S + "pub/x", content=b"{}", headers=[*prod, ("producer-id", "p2")])
    assert r.status_code == 429  # the limit: one producer per stream
    r = await c.post(S + "pub/x", content=b"{}", headers=[*prod, ("producer-id", "p2"), ("producer-id", "p1")])
    assert r.status_code == 400 and "producer-id" in r.json()["error"]["message"].lower()
    for dup in (
        [("content-type", "text/plain")],
        [("authorization", "Bearer admin")],
        [("stream-closed", "true"), ("stream-closed", "false")],
        [("transaction-id", "pub/t")] * 2,
        [("if-match", "0000000000000000_0000000000000000")] * 2,
        [("host", "a"), ("host", "b")],
    ):
        r = await c.post(S + "pub/x", content=b"{}", headers=[*prod, ("producer-id", "p1"), *dup])
        assert r.status_code == 400, (dup, r.text)
    assert len((await c.get(S + "pub/x", params={"offset": "-1"}, headers=PUB)).json()) == 1


# ---------------------------------------------------------------------- item 7: wake tokens under the guard


async def test_pull_wake_ack_and_release_work_under_the_guard(g: Guarded) -> None:
    c = g.client
    assert (await c.put(S + "pub/wake", headers={**JSON, **PUB})).status_code == 201
    r = await c.put(
        f"{SUBS}/mine", json={"type": "pull-wake", "pattern": "pub/e/*", "wake_stream": "pub/wake"}, headers=PUB
    )
    assert r.status_code == 201, r.text
    assert (await c.put(S + "pub/e/a", content=b'{"n":1}', headers={**JSON, **PUB})).status_code == 201
    claim = (await c.post(f"{SUBS}/mine/claim", json={"worker": "w1"}, headers=PUB)).json()
    reply = {"wake_id": claim["wake_id"], "generation": claim["generation"]}
    r = await c.post(f"{SUBS}/mine/release", json=reply, headers=bearer(claim["token"]))
    assert r.status_code == 204, r.text
    claim = (await c.post(f"{SUBS}/mine/claim", json={"worker": "w1"}, headers=PUB)).json()
    tail = next(s["tail_offset"] for s in claim["streams"] if s["path"] == "pub/e/a")
    reply = {
        "wake_id": claim["wake_id"],
        "generation": claim["generation"],
        "acks": [{"stream": "pub/e/a", "offset": tail}],
        "done": True,
    }
    r = await c.post(f"{SUBS}/mine/ack", json=reply, headers=bearer(claim["token"]))
    assert r.status_code == 200 and r.json()["ok"] is True, r.text
    body = (await c.get(f"{SUBS}/mine", headers=PUB)).json()
    assert body["streams"] == [{"path": "pub/e/a", "link_type": "glob", "acked_offset": tail}]


async def test_wake_routes_take_only_a_wake_token_of_that_subscription(g: Guarded) -> None:
    c = g.client
    assert (await c.put(S + "pub/wake", headers={**JSON, **PUB})).status_code == 201
    for sid in ("mine", "other"):
        r = await c.put(
            f"{SUBS}/{sid}", json={"type": "pull-wake", "pattern": "pub/e/*", "wake_stream": "pub/wake"}, headers=PUB
        )
        assert r.status_code == 201
    assert (await c.put(S + "pub/e/a", content=b'{"n":1}', headers={**JSON, **PUB})).status_code == 201
    claim = (await c.post(f"{SUBS}/mine/claim", json={"worker": "w1"}, headers=PUB)).json()
    reply = {"wake_id": claim["wake_id"], "generation": claim["generation"]}
    for headers in ({}, PUB, ADMIN, bearer("v1.forged.token")):
        r = await c.post(f"{SUBS}/mine/release", json=reply, headers=headers)
        assert r.status_code == 401, (headers, r.text)
    r = await c.post(f"{SUBS}/other/release", json=reply, headers=bearer(claim["token"]))
    assert r.status_code == 401  # a token of one subscription opens no other
    assert (await c.get(f"{SUBS}/mine", headers=PUB)).json()["streams"][0]["acked_offset"] == "-1"
    r = await c.post(f"{SUBS}/mine/claim", json={"worker": "w2"}, headers=PUB)
    assert r.status_code == 409 and r.json()["error"]["code"] == "ALREADY_CLAIMED"  # w1 still holds it


def test_subscriptions_kept_on_disk_are_checked_before_anything_else_loads_them(tmp_path: Path) -> None:
    """After a restart the subscriptions are loaded lazily; the guard must not judge an id as
    unknown (and let the request through) before they are."""
    import asyncio

    async def life(check: bool) -> None:
        broker = Broker(tmp_path / "data")
        broker.open()
        app = App(broker, AppConfig(long_poll_timeout=0.3))  # built outside the loop: nothing loads subscriptions yet
        guard = Guard(app, broker, GuardConfig.from_json(TOKENS))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://t") as c:
            if not check:
                assert (await c.put(S + "orders/wake", headers={**JSON, **ADMIN})).status_code == 201
                config = {"type": "pull-wake", "pattern": "orders/*", "wake_stream": "orders/wake"}
                assert (await c.put(f"{SUBS}/theirs", json=config, headers=ADMIN)).status_code == 201
            else:
                assert forbidden(await c.delete(f"{SUBS}/theirs", headers=PUB))
                assert (await c.get(f"{SUBS}/theirs", headers=ADMIN)).status_code == 200
        await app.subscriptions.close()
        await broker.close()

    asyncio.run(life(check=False))
    asyncio.run(life(check=True))


async def test_a_subscription_created_while_a_request_body_is_in_flight_is_checked_as_it_is_then(g: Guarded) -> None:
    """The guard checks a subscription's names against its state once the whole body is in: a claim
    for an id nobody uses yet, whose body trickles in while another tenant creates that id, must
    not claim the other tenant's subscription."""
    import asyncio

    c = g.client
    first_taken, gate = asyncio.Event(), asyncio.Event()

    async def body() -> AsyncIterator[bytes]:
        yield b'{"worker":'
        first_taken.set()
        await gate.wait()
        yield b'"w1"}'

    claim = asyncio.ensure_future(c.post(f"{SUBS}/later/claim", content=body(), headers={**JSON, **PUB}))
    taken = asyncio.ensure_future(first_taken.wait())
    await asyncio.wait({claim, taken}, return_when=asyncio.FIRST_COMPLETED)  # refused unread, or reading
    taken.cancel()
    assert (await c.put(S + "orders/wake", headers={**JSON, **ADMIN})).status_code == 201
    r = await c.put(
        f"{SUBS}/later",
        json={"type": "pull-wake", "pattern": "orders/e/*", "wake_stream": "orders/wake"},
        headers=ADMIN,
    )
    assert r.status_code == 201
    assert (await c.put(S + "orders/e/a", content=b'{"n":1}', headers={**JSON, **ADMIN})).status_code == 201
    gate.set()
    r = await claim
    assert forbidden(r), r.text
    assert g.app.subscriptions.manager.subs["later"].holder is None


async def test_a_stream_linked_later_counts_among_a_subscriptions_names(g: Guarded) -> None:
    """A token with grants on both tenants adds another tenant's stream to a subscription; a token
    granted only one of them can no longer read or claim it (it would see and ack that stream)."""
    c = g.client
    await secret(c)
    assert (await c.put(S + "pub/wake", headers={**JSON, **PUB})).status_code == 201
    r = await c.put(
        f"{SUBS}/mine", json={"type": "pull-wake", "pattern": "pub/e/*", "wake_stream": "pub/wake"}, headers=PUB
    )
    assert r.status_code == 201
    assert (await c.post(f"{SUBS}/mine/streams", json={"streams": ["orders/secret"]}, headers=ADMIN)).status_code == 204
    assert (await c.post(S + "orders/secret", content=b'{"card":"5500"}', headers={**JSON, **ADMIN})).status_code == 204
    assert forbidden(await c.get(f"{SUBS}/mine", headers=PUB))
    assert forbidden(await c.post(f"{SUBS}/mine/claim", json={"worker": "w"}, headers=PUB))
    assert g.app.subscriptions.manager.subs["mine"].holder is None


# ---------------------------------------------------------------------- issue 28, item 6: streams a group holds


async def test_an_operator_of_a_prefix_neither_sees_nor_moves_positions_in_streams_it_cannot_read(g: Guarded) -> None:
    """A group under ``pub/`` may hold a position in ``orders/secret`` (its consumer reads there);
    the operator of ``pub/`` may not read that stream, so no listing shows it that stream's name,
    position, ends or lag, and no reset moves the group there. Named streams were checked before;
    these are the streams a request reaches without naming them."""
    c = g.client
    tail = await secret(c)
    assert (await c.put(S + "pub/open", headers={**JSON, **PUB})).status_code == 201
    opened = (await c.post(S + "pub/open", content=b'{"n":1}', headers={**JSON, **PUB})).headers["stream-next-offset"]
    mine = {"orders/secret": tail, "pub/open": opened}
    r = await c.post("/v1/groups/pub/g/offsets", json={"offsets": mine}, headers=CONSUMER)
    assert r.status_code == 200, r.text
    assert r.json()["offsets"] == mine  # the consumer reads both: it sees both
    await open_txn(c, "pub/t", "orders/secret")  # a transaction of pub/ writing to orders/

    r = await c.post("/v1/groups/pub/g/offsets", json={"offsets": {"pub/open": opened}}, headers=PUBOPS)
    assert r.status_code == 200, r.text
    assert r.json()["offsets"] == {"pub/open": opened}
    assert (await c.get("/v1/groups/pub/g/offsets", headers=PUBOPS)).json()["offsets"] == {"pub/open": opened}
    listed = (await c.get("/v1/groups?prefix=pub/", headers=PUBOPS)).json()["groups"]
    assert [[s["stream"] for s in group["streams"]] for group in listed] == [["pub/open"]]
    assert listed[0]["hidden_streams"] == 1 and listed[0]["lag"] == 0
    txns = (await c.get("/v1/txn?prefix=pub/", headers=PUBOPS)).json()["transactions"]
    assert [t["streams"] for t in txns] == [[]], txns
    assert "orders/secret" not in (await c.get("/v1/txn/pub/t", headers=PUBOPS)).text

    r = await c.post("/v1/groups/pub/g/reset", json={"to": "earliest"}, headers=PUBOPS)
    assert forbidden(r), r.text  # a reset of all the group's streams reaches orders/secret
    assert "orders/secret" not in r.text and "1 stream" in r.json()["error"]["message"]
    r = await c.post("/v1/groups/pub/g/reset", json={"to": "earliest", "streams": ["pub/open"]}, headers=PUBOPS)
    assert r.status_code == 200 and "orders/secret" not in r.text, r.text
    moved = (await c.get("/v1/groups/pub/g/offsets", headers=CONSUMER)).json()["offsets"]
    assert moved["orders/secret"] == tail and moved["pub/open"] != opened  # only the stream it may read moved
