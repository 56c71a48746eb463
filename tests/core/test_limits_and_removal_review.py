"""A review of the limits and removals of issue 28, item 3, played as tests: each failed before its
fix (a commit's offsets lost by a restart after its id was deleted, a 500, a sink's reset reaching
another sink's tasks, five ways past the limits, a group that could not be deleted on a busy
server, a deleted stream kept by the subscriptions, another tenant's id named in a refusal)."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import onceflow.storage.log as storage_log
from helpers.txn import JSON, S, T, Txn
from onceflow.core.broker import Broker
from onceflow.core.limits import StateLimits
from onceflow.server.app import App, AppConfig
from onceflow.server.guard import Guard, GuardConfig

pytestmark = pytest.mark.anyio
SMALL = {"groups": 2, "transactional_ids": 1, "sinks": 1, "subscriptions": 1}


class Env:
    def __init__(self, broker: Broker, client: httpx.AsyncClient, app: App) -> None:
        self.broker, self.c, self.app = broker, client, app


async def _env(data: Path, limits: StateLimits | None = None, guard: dict[str, Any] | None = None) -> Env:
    broker = Broker(data, state_limits=limits)
    broker.open()
    await broker.start()
    app = App(broker, AppConfig(long_poll_timeout=0.3))
    front: Any = app if guard is None else Guard(app, broker, GuardConfig.from_json(guard))
    transport = httpx.ASGITransport(app=front, raise_app_exceptions=False)
    return Env(broker, httpx.AsyncClient(transport=transport, base_url="http://t"), app)


async def _close(env: Env) -> None:
    await env.c.aclose()
    await env.app.subscriptions.close()
    env.broker.begin_shutdown()
    await env.broker.close()


@pytest.fixture(params=["server", "guard"])
async def limited(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    """Small limits, set on the server (flags) or by the guard's ``limits``."""
    if request.param == "server":
        env = await _env(tmp_path / "data", StateLimits(**SMALL))
    else:
        env = await _env(tmp_path / "data", guard={"limits": SMALL})
    yield env
    await _close(env)


@pytest.fixture
async def plain(tmp_path: Path) -> AsyncIterator[Env]:
    env = await _env(tmp_path / "data")
    yield env
    await _close(env)


async def _tail(c: httpx.AsyncClient) -> str:
    assert (await c.put(S + "s", headers=JSON)).status_code == 201
    return (await c.post(S + "s", content=b"[1]", headers=JSON)).headers["stream-next-offset"]


def _limited(r: httpx.Response) -> bool:
    return r.status_code == 429 and r.json()["error"]["code"] in ("limit", "limit_exceeded")


# ---------------------------------------------------------------------- limits


async def test_one_transaction_cannot_create_groups_past_the_limit(limited: Env) -> None:
    """The groups a transaction's offsets name exist from then on (they count while it is open)."""
    c = limited.c
    tail = await _tail(c)
    t = Txn(c, "t1")
    await t.init()
    answers = []
    for i in range(4):
        r = await c.post(T + "t1/offsets", json={"epoch": t.epoch, "group": f"g{i}", "offsets": {"s": tail}})
        answers.append(r.status_code if r.status_code == 200 else _limited(r))
        if r.status_code == 200:
            t.txn = r.json()["txn"]
    assert answers == [200, 200, True, True]
    assert (await t.end(True)).status_code == 200
    assert sorted(limited.broker.coordinator.groups) == ["g0", "g1"]


async def test_sink_task_ids_count_among_transactional_ids(limited: Env) -> None:
    c = limited.c
    r = await c.post(f"{T}spark/anything/0/init", json={})
    assert r.status_code == 200, r.text
    assert _limited(await c.post(f"{T}spark/anything/1/init", json={}))
    assert _limited(await c.post(f"{T}t1/init", json={}))
    assert len(limited.broker.coordinator.txns) == 1


async def test_a_sink_task_needs_a_transactional_id_within_the_server_limit(tmp_path: Path) -> None:
    """A sink's begin makes a new id only for a new partition or slot (a retry or the next batch
    reuses the task's), which only the coordinator can tell: the server's limit refuses it there;
    a guard's limits do not (they would refuse a running query's next batch)."""
    env = await _env(tmp_path / "data", StateLimits(transactional_ids=1))
    c = env.c
    try:
        begin = {"query": "q", "batch": 0, "partition": 0, "task": "a"}
        assert (await c.post("/v1/sinks/k/begin", json=begin)).status_code == 200
        assert (await c.post("/v1/sinks/k/begin", json={**begin, "task": "a"})).status_code == 200  # a retry
        r = await c.post("/v1/sinks/k/begin", json={**begin, "partition": 1, "task": "b"})
        assert _limited(r), r.text
        assert (await c.post("/v1/sinks/k/commit", json={"query": "q", "batch": 0, "members": []})).status_code == 200
        assert (await c.post("/v1/sinks/k/begin", json={**begin, "batch": 1, "task": "c"})).status_code == 200
    finally:
        await _close(env)


async def test_a_commit_of_a_sink_never_begun_counts_against_the_sink_limit(limited: Env) -> None:
    c = limited.c
    assert (await c.post("/v1/sinks/k0/commit", json={"members": [], "batch": 0, "query": "q"})).status_code == 200
    assert _limited(await c.post("/v1/sinks/k1/commit", json={"members": [], "batch": 0, "query": "q"}))
    assert list(limited.broker.coordinator.sinks) == ["k0"]
    r = await c.post("/v1/sinks/k1/abort", json={"query": "q", "members": []})  # creates nothing
    assert r.status_code == 200, r.text


async def test_requests_creating_at_once_count_each_other(limited: Env) -> None:
    c = limited.c
    tail = await _tail(c)
    rs = await asyncio.gather(*(c.post(f"{T}t{i}/init", json={}) for i in range(10)))
    assert sum(r.status_code == 200 for r in rs) == 1 and sum(_limited(r) for r in rs) == 9
    rs = await asyncio.gather(*(c.post(f"/v1/groups/g{i}/offsets", json={"offsets": {"s": tail}}) for i in range(10)))
    assert sum(r.status_code == 200 for r in rs) == 2 and len(limited.broker.coordinator.groups) == 2


# ---------------------------------------------------------------------- removals


@pytest.mark.parametrize("delete", [False, True], ids=["kept", "deleted"])
async def test_a_deleted_id_whose_completion_record_was_lost_keeps_its_commits_offsets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, delete: bool
) -> None:
    """The COMPLETE record is not waited for: when it fails, the log ends with the decision, and
    replay applies the commit's offsets at the id's next record, which may now be its deletion."""
    env = await _env(tmp_path / "data")
    c, coord = env.c, env.broker.coordinator
    fail: list[Any] = []
    real = storage_log._write_all

    def write(f: Any, data: bytes, at: int, sync: bool) -> None:
        if fail and f is fail[0]:
            fail.clear()
            raise OSError(errno.EIO, "injected: the COMPLETE_COMMIT record is not stored")
        real(f, data, at, sync)

    monkeypatch.setattr(storage_log, "_write_all", write)
    tail = await _tail(c)
    assert (await c.put(S + "out", headers=JSON)).status_code == 201
    first = (await c.post(S + "s", content=b"[2]", headers=JSON)).headers["stream-next-offset"]
    assert (await c.post("/v1/groups/g/offsets", json={"offsets": {"s": tail}})).status_code == 200
    t = Txn(c, "copier")
    await t.init()
    assert (await t.send("out", {"n": 1})).status_code == 200
    r = await c.post(T + "copier/offsets", json={"epoch": t.epoch, "group": "g", "offsets": {"s": first}})
    assert r.status_code == 200, r.text
    marker = coord.write_marker
    assert marker is not None

    async def then_fail(*a: Any) -> None:
        await marker(*a)
        assert coord.log is not None
        fail.append(coord.log._segments[-1].file)  # the next coordinator write: COMPLETE_COMMIT

    coord.write_marker = then_fail
    assert (await t.end(True)).status_code == 200  # committed: the group moves to `first`
    coord.write_marker = marker
    await asyncio.sleep(0.05)
    assert coord.groups["g"] == {"s": first}
    if delete:
        assert (await c.delete(T + "copier")).status_code == 204
    await _close(env)
    again = Broker(tmp_path / "data")
    again.open()
    await again.start()
    try:
        assert again.coordinator.groups["g"] == {"s": first}
    finally:
        again.begin_shutdown()
        await again.close()


async def test_a_commit_append_meeting_its_id_deleted_while_it_waited_is_refused_not_500(plain: Env) -> None:
    c, coord = plain.c, plain.broker.coordinator
    for n in ("a", "b"):
        assert (await c.put(S + n, headers=JSON)).status_code == 201
    t = Txn(c, "x")
    await t.init()
    assert (await t.send("a", {"n": 1})).status_code == 200
    assert (await t.send("b", {"n": 2})).status_code == 200
    release, held = asyncio.Event(), asyncio.Event()

    async def holder() -> None:
        async with coord.holding("x"):
            held.set()
            await release.wait()

    h = asyncio.create_task(holder())
    await held.wait()
    append = asyncio.create_task(t.send("a", {"n": 3}, commit=t.txn))
    await asyncio.sleep(0.05)  # queued on the id's lock
    abort = asyncio.create_task(coord.abort_open("x"))
    await asyncio.sleep(0)
    drop = asyncio.create_task(coord.drop_txn("x"))
    await asyncio.sleep(0)
    release.set()
    await h
    await abort
    assert await drop is True
    r = await append
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_transactional_id", r.text


async def test_a_sinks_reset_touches_no_task_of_a_sink_whose_id_begins_with_its_own(plain: Env) -> None:
    c, coord = plain.c, plain.broker.coordinator
    assert (await c.put(S + "out", headers=JSON)).status_code == 201
    r = await c.post("/v1/sinks/a/b/begin", json={"query": "q", "batch": 0, "partition": 0, "task": "t"})
    assert r.status_code == 200, r.text
    tid = r.json()["id"]
    assert tid == "spark/a/b/p0/s0"
    t = Txn(c, tid)
    t.epoch = r.json()["epoch"]
    assert (await t.send("out", {"n": 1})).status_code == 200
    await coord.reset_sink("a", None)
    assert coord.txns[tid].status.value == "ongoing"  # sink a/b's batch goes on
    # and a reset of a/b while one of a waits for its tasks' locks
    release, held = asyncio.Event(), asyncio.Event()

    async def holder() -> None:
        async with coord.holding(tid):
            held.set()
            await release.wait()

    h = asyncio.create_task(holder())
    await held.wait()
    reset_ab = asyncio.create_task(coord.reset_sink("a/b", None))
    await asyncio.sleep(0)
    reset_a = asyncio.create_task(coord.reset_sink("a", None))
    await asyncio.sleep(0)
    release.set()
    await h
    await reset_ab
    await reset_a
    assert tid not in coord.txns


async def test_a_group_is_deleted_while_other_groups_commit_all_the_time(plain: Env) -> None:
    c, coord = plain.c, plain.broker.coordinator
    tail = await _tail(c)
    await coord.commit_offsets("victim", {"s": tail})
    stop = False

    async def writer(g: str) -> None:
        while not stop:
            await coord.commit_offsets(g, {"s": tail})

    writers = [asyncio.create_task(writer(f"w{i}")) for i in range(4)]
    await asyncio.sleep(0.05)
    try:
        assert await coord.drop_group("victim") is True
    finally:
        stop = True
        await asyncio.gather(*writers)
    assert "victim" not in coord.groups


async def test_a_group_whose_transaction_record_is_being_written_is_not_deleted(plain: Env) -> None:
    """An offsets request staged and not yet applied: deleting the group would drop the offsets
    under the transaction (and a copier would copy again what it committed)."""
    c, coord = plain.c, plain.broker.coordinator
    tail = await _tail(c)
    assert (await c.post("/v1/groups/g/offsets", json={"offsets": {"s": tail}})).status_code == 200
    t = Txn(c, "copier")
    await t.init()
    pending = asyncio.create_task(
        c.post(T + "copier/offsets", json={"epoch": t.epoch, "group": "g", "offsets": {"s": tail}})
    )
    while not coord._in_flight_groups:
        await asyncio.sleep(0)
    r = await c.delete("/v1/groups/g")
    assert r.status_code == 409 and r.json()["error"]["code"] == "in_use", r.text
    assert (await pending).status_code == 200


async def test_a_refusal_to_delete_a_group_names_no_other_tenants_id(tmp_path: Path) -> None:
    tokens = {
        "a": [{"prefix": "a/", "scopes": ["read", "write", "admin"]}],
        "ab": [{"prefix": "a/", "scopes": ["read", "write"]}, {"prefix": "secret/", "scopes": ["write"]}],
    }
    env = await _env(tmp_path / "data", guard={"tokens": tokens})
    c = env.c
    a, ab = {"authorization": "Bearer a"}, {"authorization": "Bearer ab"}
    try:
        assert (await c.put(S + "a/s", headers={**JSON, **a})).status_code == 201
        tail = (await c.post(S + "a/s", content=b"[1]", headers={**JSON, **a})).headers["stream-next-offset"]
        assert (await c.post("/v1/groups/a/g/offsets", json={"offsets": {"a/s": tail}}, headers=a)).status_code == 200
        epoch = (await c.post(T + "secret/copier/init", json={}, headers=ab)).json()["epoch"]
        body = {"epoch": epoch, "group": "a/g", "offsets": {"a/s": tail}}
        assert (await c.post(T + "secret/copier/offsets", json=body, headers=ab)).status_code == 200
        r = await c.delete("/v1/groups/a/g", headers=a)
        assert r.status_code == 409 and "secret" not in r.text, r.text
    finally:
        await _close(env)


async def test_a_stream_deleted_by_the_expiry_sweep_is_not_kept_by_the_subscriptions(plain: Env) -> None:
    c, m = plain.c, plain.app.subscriptions.manager
    assert (await c.put(S + "w", headers=JSON)).status_code == 201
    sub = {"type": "pull-wake", "pattern": "x/*", "wake_stream": "w"}
    assert (await c.put(f"{S}__ds/subscriptions/s1", json=sub)).status_code == 201
    for i in range(3):
        assert (await c.put(f"{S}x/t{i}", headers={**JSON, "stream-ttl": "1"})).status_code == 201
        assert (await c.post(f"{S}x/t{i}", content=b"[1]", headers=JSON)).status_code == 204
    await asyncio.sleep(0.05)
    assert any(n.startswith("x/") for n in m._watched)
    for s in [s for n, s in plain.broker.streams.items() if n.startswith("x/")]:
        plain.broker._expire(s)  # as the sweep does once their TTL passed
    assert not [n for n in (*m._seen, *m._watched) if n.startswith("x/")]
