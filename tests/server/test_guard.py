"""Bearer tokens with read/write scopes per name prefix, and limits (server/guard.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.servers import ServerProcess
from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig
from onceflow.server.guard import Guard, GuardConfig, GuardConfigError

pytestmark = pytest.mark.anyio
S = "/v1/stream/"
JSON = {"content-type": "application/json"}
CONFIG = {
    "tokens": {
        "ingest": [{"prefix": "orders/", "scopes": ["write"]}],
        "report": [{"prefix": "orders/", "scopes": ["read"]}, {"prefix": "pub/", "scopes": ["read", "write"]}],
        "admin": [{"prefix": "", "scopes": ["read", "write"]}],
    },
}


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


@pytest.fixture
async def guarded(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[httpx.AsyncClient]:
    config: dict[str, Any] = getattr(request, "param", CONFIG)
    broker = Broker(tmp_path / "data")
    broker.open()
    app = App(broker, AppConfig(long_poll_timeout=1.0))
    guard = Guard(app, broker, GuardConfig.from_json(config))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard), base_url="http://t") as client:
        yield client
    await broker.close()


async def test_requests_without_a_valid_token_are_401(guarded: httpx.AsyncClient) -> None:
    r = await guarded.get(S + "orders/a", params={"offset": "-1"})
    assert r.status_code == 401
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert "Bearer" in r.json()["error"]["message"]
    r = await guarded.put(S + "orders/a", headers={**JSON, **bearer("stolen")})
    assert r.status_code == 401 and "invalid_token" in r.headers["www-authenticate"]
    r = await guarded.put(S + "orders/a", headers={**JSON, "authorization": "Basic YWRtaW4="})
    assert r.status_code == 401
    r = await guarded.head(S + "orders/a")
    assert r.status_code == 401 and r.content == b""
    assert (await guarded.request("OPTIONS", S + "orders/a")).status_code == 204  # CORS preflight carries no token
    assert (await guarded.head(S + "orders/a", headers=bearer("admin"))).status_code == 404  # nothing was created


async def test_scopes_apply_per_prefix_and_refusals_change_nothing(guarded: httpx.AsyncClient) -> None:
    assert (await guarded.put(S + "orders/a", headers={**JSON, **bearer("ingest")})).status_code == 201
    assert (
        await guarded.post(S + "orders/a", content=b'{"n":1}', headers={**JSON, **bearer("ingest")})
    ).status_code == 204
    # the writer may not read, the reader may not write, neither outside its prefix
    assert (await guarded.get(S + "orders/a", params={"offset": "-1"}, headers=bearer("ingest"))).status_code == 403
    r = await guarded.post(S + "orders/a", content=b'{"n":2}', headers={**JSON, **bearer("report")})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert (await guarded.put(S + "billing/a", headers={**JSON, **bearer("ingest")})).status_code == 403
    assert (await guarded.delete(S + "orders/a", headers=bearer("report"))).status_code == 403
    r = await guarded.get(S + "orders/a", params={"offset": "-1"}, headers=bearer("report"))
    assert r.status_code == 200 and r.json() == [{"n": 1}]
    assert (await guarded.head(S + "billing/a", headers=bearer("admin"))).status_code == 404
    # a token with several grants: read here, read and write there
    assert (await guarded.put(S + "pub/x", headers={**JSON, **bearer("report")})).status_code == 201


async def test_listing_transactions_and_groups_are_checked_by_name(guarded: httpx.AsyncClient) -> None:
    assert (await guarded.get("/v1/streams", params={"prefix": "orders/"}, headers=bearer("report"))).status_code == 200
    assert (await guarded.get("/v1/streams", headers=bearer("report"))).status_code == 403  # all names: needs prefix ""
    assert (await guarded.post("/v1/txn/orders/copier/init", json={}, headers=bearer("ingest"))).status_code == 200
    assert (await guarded.post("/v1/txn/billing/copier/init", json={}, headers=bearer("ingest"))).status_code == 403
    assert (
        await guarded.get("/v1/txn/billing/copier", headers=bearer("admin"))
    ).status_code == 404  # never initialised
    r = await guarded.post("/v1/groups/orders/g/offsets", json={"offsets": {}}, headers=bearer("report"))
    assert r.status_code == 403
    assert (await guarded.get("/v1/groups/orders/g/offsets", headers=bearer("report"))).status_code == 200


@pytest.mark.parametrize("guarded", [{"limits": {"streams": 2}}], indirect=True)
async def test_stream_limit_is_429_and_recreating_an_existing_stream_still_works(guarded: httpx.AsyncClient) -> None:
    for name in ("a", "b"):
        assert (await guarded.put(S + name, headers=JSON)).status_code == 201
    r = await guarded.put(S + "c", headers=JSON)
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "limit_exceeded"
    assert (await guarded.head(S + "c")).status_code == 404
    assert (await guarded.put(S + "a", headers=JSON)).status_code == 200  # idempotent create of an existing one
    assert (await guarded.delete(S + "b")).status_code == 204
    assert (await guarded.put(S + "c", headers=JSON)).status_code == 201


@pytest.mark.parametrize("guarded", [{"limits": {"producers_per_stream": 2}}], indirect=True)
async def test_producer_limit_refuses_only_new_producers(guarded: httpx.AsyncClient) -> None:
    await guarded.put(S + "s", headers=JSON)

    def prod(pid: str, seq: int) -> dict[str, str]:
        return {**JSON, "producer-id": pid, "producer-epoch": "0", "producer-seq": str(seq)}

    for pid in ("p1", "p2"):
        assert (await guarded.post(S + "s", content=b"{}", headers=prod(pid, 0))).status_code == 200
    r = await guarded.post(S + "s", content=b"{}", headers=prod("p3", 0))
    assert r.status_code == 429 and "producers" in r.json()["error"]["message"]
    assert (await guarded.post(S + "s", content=b"{}", headers=prod("p1", 1))).status_code == 200
    assert (
        await guarded.post(S + "s", content=b"{}", headers=prod("p1", 1))
    ).status_code == 204  # a retry still dedups
    assert (
        await guarded.post(S + "s", content=b"{}", headers=JSON)
    ).status_code == 204  # plain appends are not counted
    assert len((await guarded.get(S + "s", params={"offset": "-1"})).json()) == 4


@pytest.mark.parametrize("guarded", [{"limits": {"live_reads": 1}}], indirect=True)
async def test_live_read_limit_counts_open_long_polls(guarded: httpx.AsyncClient) -> None:
    await guarded.put(S + "s", headers=JSON)
    first = asyncio.ensure_future(guarded.get(S + "s", params={"offset": "now", "live": "long-poll"}))
    await asyncio.sleep(0.2)
    r = await guarded.get(S + "s", params={"offset": "now", "live": "long-poll"})
    assert r.status_code == 429
    assert (await guarded.get(S + "s", params={"offset": "-1"})).status_code == 200  # catch-up reads are not limited
    assert (await first).status_code == 204  # timed out with no data
    r = await guarded.get(S + "s", params={"offset": "now", "live": "long-poll"})
    assert r.status_code == 204  # the slot was freed


@pytest.mark.parametrize(
    "raw",
    [
        [],
        {"tokens": []},
        {"tokens": {"t": [{"prefix": "a"}]}},
        {"tokens": {"t": [{"prefix": "a", "scopes": ["root"]}]}},
        {"limits": {"streams": -1}},
        {"limits": {"stream": 1}},
        {"extra": 1},
    ],
)
def test_malformed_configurations_are_refused(raw: Any) -> None:
    with pytest.raises(GuardConfigError):
        GuardConfig.from_json(raw)


def test_serve_with_a_guard_file(tmp_path: Path) -> None:
    cfg = tmp_path / "guard.json"
    cfg.write_text(json.dumps(CONFIG))
    srv = ServerProcess(tmp_path / "data", "--guard", str(cfg))
    srv.start()
    try:
        assert httpx.put(f"{srv.url}{S}orders/a", headers=JSON).status_code == 401
        assert httpx.put(f"{srv.url}{S}orders/a", headers={**JSON, **bearer("ingest")}).status_code == 201
    finally:
        srv.kill()
    cfg.write_text("{not json")
    r = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "serve", "--data", str(tmp_path / "d2"), "--guard", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "guard configuration" in r.stderr


def test_the_python_clients_send_the_token_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every client of onceflow's library authenticates with $ONCEFLOW_TOKEN (or an explicit
    token); without one a guarded server refuses it with a clear 401."""
    from onceflow.client import (
        Consumer,
        GroupOffsetStore,
        IdempotentProducer,
        OnceflowError,
        Stream,
        TransactionalProducer,
    )

    cfg = tmp_path / "guard.json"
    cfg.write_text(json.dumps(CONFIG))
    srv = ServerProcess(tmp_path / "data", "--guard", str(cfg))
    srv.start()
    try:
        monkeypatch.delenv("ONCEFLOW_TOKEN", raising=False)
        with pytest.raises(OnceflowError) as refused, Stream.connect(srv.url, "pub/s") as s:
            s.create("application/json")
        assert refused.value.status == 401
        monkeypatch.setenv("ONCEFLOW_TOKEN", "report")  # read and write on pub/
        with Stream.connect(srv.url, "pub/s") as s:
            s.create("application/json")
            s.append({"n": 0})
        with IdempotentProducer(srv.url, "pub/s") as p:
            p.extend({"n": i} for i in range(1, 4))
        monkeypatch.setenv("ONCEFLOW_TOKEN", "admin")  # groups and transactional ids are named by id
        with TransactionalProducer(srv.url, "pub/copier") as tp, tp.transaction():
            tp.append("pub/s", {"n": 4})
        with Consumer(
            srv.url, group="pub/g", streams=["pub/s"], live=None, store=GroupOffsetStore(srv.url)
        ) as consumer:
            got = [m.value for m in consumer]
        assert got == [{"n": i} for i in range(5)]
        # an explicit token wins over the environment
        with pytest.raises(OnceflowError) as wrong, TransactionalProducer(srv.url, "pub/other", token="ingest"):  # noqa: S106 - a test token
            pass
        assert wrong.value.status == 403
    finally:
        srv.kill()


LIMITED = {"groups": 2, "transactional_ids": 2, "sinks": 1, "subscriptions": 1}


def limited(r: httpx.Response, what: str) -> bool:
    return (
        r.status_code == 429 and r.json()["error"]["code"] == "limit_exceeded" and what in r.json()["error"]["message"]
    )


@pytest.mark.parametrize("guarded", [{"limits": {"transactional_ids": 2}}], indirect=True)
async def test_a_sinks_task_is_refused_an_id_past_the_transactional_ids_limit(guarded: httpx.AsyncClient) -> None:
    """Found by test_tenants_bounded.py's property test: a sink's ``begin`` gives its task a
    transactional id of its own (the server's to create, counted by the limit), and the guard let
    it through at the limit, so one token held more ids than ``limits.transactional_ids``. Now a
    begin that would create an id past the limit is a 429; one that reuses its id is not."""
    c = guarded
    for t in ("t1", "t2"):
        assert (await c.post(f"/v1/txn/{t}/init", json={})).status_code == 200
    begin = {"query": "q", "batch": 0, "partition": 0, "task": "a"}
    assert limited(await c.post("/v1/sinks/k/begin", json=begin), "transactional ids")
    assert len((await c.get("/v1/txn")).json()["transactions"]) == 2
    assert (await c.delete("/v1/txn/t2")).status_code == 204
    assert (await c.post("/v1/sinks/k/begin", json=begin)).status_code == 200
    assert (await c.post("/v1/sinks/k/begin", json=begin)).status_code == 200  # a retry: the same id
    assert limited(await c.post("/v1/sinks/k/begin", json={**begin, "task": "b"}), "transactional ids")
    assert len((await c.get("/v1/txn")).json()["transactions"]) == 2


@pytest.mark.parametrize("guarded", [{"limits": LIMITED}], indirect=True)
async def test_groups_transactional_ids_sinks_and_subscriptions_have_limits(guarded: httpx.AsyncClient) -> None:
    """Issue 28, item 3: one token created 1,500 of each. Past the limit a new one is a 429; what
    exists goes on working, and deleting one makes room."""
    c = guarded
    assert (await c.put(S + "s", headers=JSON)).status_code == 201
    tail = (await c.post(S + "s", content=b"[1]", headers=JSON)).headers["stream-next-offset"]
    # groups: by an offsets commit, a reset, and a transaction's offsets
    for g in ("g1", "g2"):
        assert (await c.post(f"/v1/groups/{g}/offsets", json={"offsets": {"s": tail}})).status_code == 200
    assert limited(await c.post("/v1/groups/g3/offsets", json={"offsets": {"s": tail}}), "groups")
    assert limited(await c.post("/v1/groups/g3/reset", json={"to": "earliest", "streams": ["s"]}), "groups")
    r = await c.post("/v1/groups/g3/reset", json={"to": "earliest", "streams": ["s"], "dry_run": True})
    assert r.status_code == 200, r.text  # a dry run creates nothing
    assert (await c.post("/v1/groups/g1/offsets", json={"offsets": {"s": tail}})).status_code == 200
    # transactional ids
    epochs = {}
    for t in ("t1", "t2"):
        r = await c.post(f"/v1/txn/{t}/init", json={})
        assert r.status_code == 200, r.text
        epochs[t] = r.json()["epoch"]
    assert limited(await c.post("/v1/txn/t3/init", json={}), "transactional ids")
    assert (await c.post("/v1/txn/t1/init", json={})).status_code == 200  # an existing id inits again
    r = await c.post("/v1/txn/t2/offsets", json={"epoch": epochs["t2"], "group": "g3", "offsets": {"s": tail}})
    assert limited(r, "groups")
    # sinks (each task of a sink holds a transactional id of it: room for one)
    assert (await c.delete("/v1/txn/t1")).status_code == 204
    begin = {"query": "q", "batch": 0, "partition": 0, "task": "a"}
    assert (await c.post("/v1/sinks/k1/begin", json=begin)).status_code == 200
    assert limited(await c.post("/v1/sinks/k2/begin", json=begin), "sinks")
    assert (await c.post("/v1/sinks/k1/begin", json=begin)).status_code == 200  # the same task: its own id
    # subscriptions
    sub = {"type": "pull-wake", "pattern": "subs/*", "wake_stream": "s"}
    assert (await c.put(f"{S}__ds/subscriptions/x1", json=sub)).status_code == 201
    assert limited(await c.put(f"{S}__ds/subscriptions/x2", json=sub), "subscriptions")
    # deleting one makes room for another
    assert (await c.delete("/v1/groups/g2")).status_code == 204
    assert (await c.post("/v1/groups/g3/offsets", json={"offsets": {"s": tail}})).status_code == 200
    assert limited(await c.post("/v1/txn/t3/init", json={}), "transactional ids")  # the sink's task's id counts
    assert (await c.post("/v1/sinks/k1/reset", json={"owner": None})).status_code == 200  # it goes with it
    assert (await c.post("/v1/txn/t3/init", json={})).status_code == 200
    assert (await c.delete(f"{S}__ds/subscriptions/x1")).status_code in (200, 204)
    assert (await c.put(f"{S}__ds/subscriptions/x2", json=sub)).status_code == 201
