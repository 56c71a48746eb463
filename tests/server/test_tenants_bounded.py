"""Random tenants creating and deleting every kind of state: what the server holds stays bounded
(issue 28, "done when").

Three tenants, each with read, write and admin on a prefix of its own, send random requests of
every kind a client can make the server keep something for: streams, appends, group commits and
resets, transactional ids and transactions, sinks, subscriptions, and requests naming ids and
groups that do not exist (names never seen before, so a table keyed by whatever a request names
grows with them). The guard's limits are small. After every request: no 5xx, and no kind holds
more than its limit. At the end each tenant deletes what it made, and then the server holds
nothing keyed by a name: every per-name table is empty, whatever the requests were."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig
from onceflow.server.guard import Guard, GuardConfig

S = "/v1/stream/"
SUBS = "/v1/stream/__ds/subscriptions/"
JSON = {"content-type": "application/json"}
TENANTS = ("a", "b", "c")
LIMITS = {"streams": 6, "groups": 4, "transactional_ids": 4, "sinks": 2, "subscriptions": 2}
CONFIG = {
    "tokens": {t: [{"prefix": f"{t}/", "scopes": ["read", "write", "admin"]}] for t in TENANTS},
    "limits": LIMITS,
}
KINDS = (
    "create",
    "append",
    "delete",
    "commit",
    "reset",
    "drop_group",
    "txn",
    "drop_txn",
    "ghost_txn",
    "ghost_group",
    "sink",
    "sink_reset",
    "sub",
    "drop_sub",
)

# streams are made often (most other requests need one), of few names, so that requests meet
op = st.tuples(
    st.sampled_from(TENANTS), st.sampled_from(KINDS + ("create",) * 4), st.integers(0, 2), st.integers(0, 10**9)
)


class World:
    def __init__(self, data: Path) -> None:
        self.broker = Broker(data)
        self.broker.open()
        self.app = App(self.broker, AppConfig(long_poll_timeout=0.2))
        self.guard = Guard(self.app, self.broker, GuardConfig.from_json(CONFIG))
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.guard), base_url="http://t")
        self.epochs: dict[str, int] = {}

    async def close(self) -> None:
        await self.client.aclose()
        await self.app.subscriptions.close()
        await self.broker.close()

    async def send(self, tenant: str, kind: str, i: int, nonce: int) -> httpx.Response:
        c, h = self.client, {"authorization": f"Bearer {tenant}"}
        stream, group, tid, sink = (f"{tenant}/{k}{i}" for k in ("s", "g", "t", "k"))
        sub = f"{tenant}-x{i}"  # a subscription id is one path segment
        if kind == "create":
            return await c.put(S + stream, headers={**JSON, **h})
        if kind == "append":
            return await c.post(S + stream, json=[nonce], headers=h)
        if kind == "delete":
            return await c.delete(S + stream, headers=h)
        if kind == "commit":
            tail = (await c.head(S + stream, headers=h)).headers.get("stream-next-offset", "-1")
            return await c.post(f"/v1/groups/{group}/offsets", json={"offsets": {stream: tail}}, headers=h)
        if kind == "reset":
            return await c.post(f"/v1/groups/{group}/reset", json={"to": "latest", "streams": [stream]}, headers=h)
        if kind == "drop_group":
            return await c.delete(f"/v1/groups/{group}", headers=h)
        if kind == "txn":
            r = await c.post(f"/v1/txn/{tid}/init", json={}, headers=h)
            if r.status_code != 200:
                return r
            epoch = r.json()["epoch"]
            headers = {**h, "producer-id": f"txn:{tid}", "producer-epoch": str(epoch), "producer-seq": "0"}
            r = await c.post(S + stream, json=[nonce], headers={**headers, "transaction-id": tid})
            if r.status_code != 200:
                return r
            if nonce % 2:  # half of them stay open, for a while
                return r
            return await c.post(
                f"/v1/txn/{tid}/commit", json={"epoch": epoch, "txn": int(r.headers["transaction-number"])}, headers=h
            )
        if kind == "drop_txn":
            for meta in [self.broker.coordinator.txns.get(tid)]:
                if meta is not None and meta.status.value == "ongoing":  # an operator aborts it first
                    await c.post(f"/v1/txn/{tid}/force-abort", json={}, headers=h)
            return await c.delete(f"/v1/txn/{tid}", headers=h)
        if kind == "ghost_txn":  # an id never initialised, a new name every time
            return await c.post(f"/v1/txn/{tenant}/ghost{nonce}/commit", json={"epoch": 0, "txn": 1}, headers=h)
        if kind == "ghost_group":
            return await c.delete(f"/v1/groups/{tenant}/ghost{nonce}", headers=h)
        if kind == "sink":
            begin = {"query": "q", "batch": nonce % 3, "partition": i, "task": f"t{nonce}"}
            return await c.post(f"/v1/sinks/{sink}/begin", json=begin, headers=h)
        if kind == "sink_reset":
            owner = (await c.get(f"/v1/sinks/{sink}", headers=h)).json().get("owner")
            return await c.post(f"/v1/sinks/{sink}/reset", json={"owner": owner}, headers=h)
        if kind == "sub":
            config = {"type": "pull-wake", "pattern": f"{tenant}/*", "wake_stream": stream}
            return await c.put(SUBS + sub, json=config, headers=h)
        assert kind == "drop_sub"
        return await c.delete(SUBS + sub, headers=h)

    def counts(self) -> dict[str, int]:
        coord = self.broker.coordinator
        assert coord.member_epochs.keys() <= coord.groups.keys()  # so len(groups) counts the groups
        return {
            "streams": sum(1 for _ in self.broker.list()),
            "groups": len(coord.groups.keys() | coord.member_epochs.keys()),
            "transactional_ids": len(coord.txns),
            "sinks": coord.sink_count(),
            "subscriptions": len(self.app.subscriptions.manager.subs),
        }

    async def clean_up(self) -> None:
        """Each tenant removes what it made, as an operator would: transactions aborted, then ids,
        groups, sinks, subscriptions and streams deleted."""
        coord = self.broker.coordinator
        for tenant in TENANTS:
            h = {"authorization": f"Bearer {tenant}"}
            c = self.client
            for meta in list(coord.txns.values()):
                if meta.status.value == "ongoing":
                    r = await c.post(f"/v1/txn/{meta.tid}/force-abort", json={}, headers=h)
            for sink in [
                s for s in (await c.get("/v1/sinks", params={"prefix": f"{tenant}/"}, headers=h)).json()["sinks"]
            ]:
                r = await c.post(f"/v1/sinks/{sink['sink']}/reset", json={"owner": sink["owner"]}, headers=h)
                assert r.status_code == 200, r.text
            for i in range(3):  # sinks begun but never committed have no record: reset them by name
                await c.post(f"/v1/sinks/{tenant}/k{i}/reset", json={"owner": None}, headers=h)
            for t in (await c.get("/v1/txn", params={"prefix": f"{tenant}/"}, headers=h)).json()["transactions"]:
                r = await c.delete(f"/v1/txn/{t['transactional_id']}", headers=h)
                assert r.status_code == 204, r.text
            for g in (await c.get("/v1/groups", params={"prefix": f"{tenant}/"}, headers=h)).json()["groups"]:
                r = await c.delete(f"/v1/groups/{g['group']}", headers=h)
                assert r.status_code == 204, r.text
            for i in range(3):
                await c.delete(f"{SUBS}{tenant}-x{i}", headers=h)
            for s in (await c.get("/v1/streams", params={"prefix": f"{tenant}/"}, headers=h)).json()["streams"]:
                r = await c.delete(S + s["name"], headers=h)
                assert r.status_code == 204, r.text

    async def held_by_name(self) -> dict[str, int]:
        """The size of every table the server keys by a name a request carries, once the
        subscriptions' writes in the background are done."""
        coord = self.broker.coordinator
        subs = self.app.subscriptions.manager
        while subs._writes:
            await asyncio.gather(*subs._writes, return_exceptions=True)
        return {
            "streams": len(self.broker.streams),
            "groups": len(coord.groups),
            "member_epochs": len(coord.member_epochs),
            "txns": len(coord.txns),
            "sinks": len(coord.sinks),
            "sink_tasks": sum(len(t) for t in coord._enlisted.values()),
            "sink_entries": len(coord._enlisted),
            "coordinator_locks": len(coord._locks),
            "subscriptions": len(subs.subs),
            "subscription_locks": len(subs._locks),
            "subscription_versions": len(subs._version) + len(subs._saved),
            "subscription_indexes": sum(len(t) for t in (subs._by_stream, subs._by_wake, subs._patterns)),
            "subscription_streams": sum(len(t) for t in (subs._watched, subs._seen, subs._dirty)),
        }


async def _play(ops: list[tuple[str, str, int, int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        w = World(Path(tmp) / "data")
        try:
            for tenant, kind, i, nonce in ops:
                r = await w.send(tenant, kind, i, nonce)
                assert r.status_code < 500, (tenant, kind, i, r.status_code, r.text)
                counts = w.counts()
                assert all(counts[k] <= LIMITS[k] for k in LIMITS), counts
            await w.clean_up()
            held = await w.held_by_name()
            assert held == dict.fromkeys(held, 0), held
        finally:
            await w.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=10, max_size=60))
def test_random_tenants_leave_nothing_behind_and_never_pass_a_limit(ops: list[Any]) -> None:
    asyncio.run(_play(ops))
