"""Transactions across streams, read_committed, and consumer-group offsets (HTTP, in process)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from helpers.servers import InProcess
from helpers.txn import JSON, S, T, Txn, committed, make, uncommitted
from onceflow.core.broker import Broker
from onceflow.core.txn import TxnError

pytestmark = pytest.mark.anyio


async def test_a_transaction_across_streams_becomes_visible_at_once(onceflow: InProcess) -> None:
    await make(onceflow, "a", "b")
    t = Txn(onceflow.client, "copier")
    await t.init()
    assert (await t.send("a", {"n": 1})).status_code == 200
    assert (await t.send("b", {"n": 2})).status_code == 200
    await onceflow.client.post(S + "a", json=[{"plain": True}], headers=JSON)  # after the open txn
    assert await committed(onceflow, "a") == [] and await committed(onceflow, "b") == []
    assert await uncommitted(onceflow, "a") == [{"n": 1}, {"plain": True}]
    head = await onceflow.client.head(S + "a")
    assert head.headers["stream-last-stable-offset"] < head.headers["stream-next-offset"]
    r = await t.end(commit=True)
    assert r.status_code == 200 and r.json()["status"] == "complete_commit"
    assert await committed(onceflow, "a") == [{"n": 1}, {"plain": True}]
    assert await committed(onceflow, "b") == [{"n": 2}]
    head = await onceflow.client.head(S + "a")
    assert head.headers["stream-last-stable-offset"] == head.headers["stream-next-offset"]


async def test_aborted_data_is_never_visible_to_read_committed(onceflow: InProcess) -> None:
    await make(onceflow, "ab")
    t = Txn(onceflow.client, "t")
    await t.init()
    await t.send("ab", {"n": "aborted"})
    assert (await t.end(commit=False)).json()["status"] == "complete_abort"
    await t.send("ab", {"n": "kept"})
    await t.end(commit=True)
    assert await committed(onceflow, "ab") == [{"n": "kept"}]
    assert await uncommitted(onceflow, "ab") == [{"n": "aborted"}, {"n": "kept"}]


async def test_a_new_epoch_fences_the_zombie_and_aborts_what_it_left_open(onceflow: InProcess) -> None:
    await make(onceflow, "z")
    zombie = Txn(onceflow.client, "worker")
    await zombie.init()
    await zombie.send("z", {"from": "zombie"})
    fresh = Txn(onceflow.client, "worker")
    assert (await fresh.init())["epoch"] == zombie.epoch + 1
    r = await zombie.send("z", {"from": "zombie", "late": True})
    assert r.status_code == 403 and int(r.headers["producer-epoch"]) == fresh.epoch
    assert (await zombie.end(commit=True)).status_code == 403
    await fresh.send("z", {"from": "fresh"})
    await fresh.end(commit=True)
    assert await committed(onceflow, "z") == [{"from": "fresh"}]


async def test_a_delayed_commit_or_abort_cannot_touch_the_next_transaction(onceflow: InProcess) -> None:
    await make(onceflow, "d")
    t = Txn(onceflow.client, "t")
    await t.init()
    await t.send("d", {"txn": 1})
    assert (await t.end(commit=True)).status_code == 200
    assert (await t.end(commit=True)).status_code == 200  # a retried commit of txn 1: no-op success
    first = t.txn
    await t.send("d", {"txn": 2})
    assert t.txn == first + 1
    late_abort = await t.end(commit=False, txn=first)  # delivered after txn 2 began
    assert late_abort.status_code == 409 and late_abort.json()["error"]["code"] == "txn_refused"
    late_commit = await t.end(commit=True, txn=first)
    assert late_commit.status_code == 409
    await t.end(commit=True)
    assert await committed(onceflow, "d") == [{"txn": 1}, {"txn": 2}]


async def test_a_hanging_transaction_is_aborted_after_its_timeout(onceflow: InProcess) -> None:
    await make(onceflow, "h")
    t = Txn(onceflow.client, "dies")
    await t.init(timeout_ms=200)
    await t.send("h", {"n": "orphan"})
    await onceflow.client.post(S + "h", json=[{"n": "after"}], headers=JSON)
    assert await committed(onceflow, "h") == []  # the LSO is held by the open transaction
    await asyncio.sleep(0.3)
    assert await onceflow.broker.coordinator.expire() == ["dies"]
    assert await committed(onceflow, "h") == [{"n": "after"}]  # the LSO moved, the orphan is gone
    # the producer that let it time out is fenced: it cannot continue in a fresh transaction
    late = await t.send("h", {"n": "continues"})
    assert late.status_code == 403
    assert (await t.end(commit=True)).status_code == 403
    assert await committed(onceflow, "h") == [{"n": "after"}]


class _Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


@pytest.mark.parametrize("begins_with", ["append", "offsets"])
async def test_a_transaction_times_out_counting_from_when_it_began(
    onceflow: InProcess, monkeypatch: pytest.MonkeyPatch, begins_with: str
) -> None:
    """A transaction's timeout runs from its own beginning, whether its first request is an append
    or a group's offsets: not from the id's init or its previous transaction (found while making
    one apply function for the coordinator's records: an offsets request that began a transaction
    kept the time of the one before, and the sweep aborted it at once)."""
    await make(onceflow, "in", "out")
    clock = _Clock()
    monkeypatch.setattr(onceflow.broker.coordinator, "clock", clock)
    t = Txn(onceflow.client, "slow")
    await t.init(timeout_ms=5000)
    assert (await t.send("out", {"n": 1})).status_code == 200
    assert (await t.end(commit=True)).status_code == 200
    clock.now += 60  # long after the id's init and its first transaction
    if begins_with == "append":
        assert (await t.send("out", {"n": 2})).status_code == 200
    else:
        body = {"epoch": t.epoch, "group": "g", "offsets": {"in": "0000000000000000_0000000000000000"}}
        assert (await onceflow.client.post(T + "slow/offsets", json=body)).status_code == 200
    clock.now += 4  # within its 5 s
    assert await onceflow.broker.coordinator.expire() == []
    clock.now += 2  # past them
    assert await onceflow.broker.coordinator.expire() == ["slow"]


async def test_a_retried_init_gets_the_same_epoch_and_fences_nothing(onceflow: InProcess) -> None:
    """An init whose answer was lost is sent again; or the original arrives late, after its retry
    was answered and the producer began to work. Same request id: same epoch, nothing aborted."""
    await make(onceflow, "r")

    async def init(request_id: object, timeout_ms: int | None = None) -> httpx.Response:
        body: dict[str, object] = {"request_id": request_id}
        if timeout_ms is not None:
            body["timeout_ms"] = timeout_ms
        return await onceflow.client.post(T + "r/init", json=body)

    first = (await init("a1")).json()
    assert (await init("a1")).json()["epoch"] == first["epoch"]
    t = Txn(onceflow.client, "r")
    t.epoch = first["epoch"]
    assert (await t.send("r", {"n": 1})).status_code == 200
    late = await init("a1")  # the late original: must not fence the producer nor abort its work
    assert late.status_code == 200 and late.json()["epoch"] == t.epoch and late.json()["status"] == "ongoing"
    assert (await t.end(commit=True)).status_code == 200
    assert await committed(onceflow, "r") == [{"n": 1}]
    # another instance (another request id) fences as always
    assert (await init("b2")).json()["epoch"] == t.epoch + 1
    assert (await t.send("r", {"n": 2})).status_code == 403
    # an epoch the server began on its own (a timeout) is not the one that init asked for
    assert (await init("c3", timeout_ms=100)).json()["epoch"] == t.epoch + 2
    t.epoch += 2
    await t.send("r", {"n": "hangs"})
    await asyncio.sleep(0.2)
    assert await onceflow.broker.coordinator.expire() == ["r"]
    assert (await init("c3")).json()["epoch"] == t.epoch + 2  # after the fence: a new epoch
    for bad in ("", 7, "x" * 201):
        r = await init(bad)
        assert r.status_code == 400 and "request_id" in r.json()["error"]["message"]


async def test_ten_streams_commit_or_abort_as_one(onceflow: InProcess) -> None:
    names = [f"ten/{i}" for i in range(10)]
    await make(onceflow, *names)
    t = Txn(onceflow.client, "ten")
    await t.init()
    for commit in (False, True):
        for n in names:
            await t.send(n, {"commit": commit})
        await t.end(commit=commit)
    for n in names:
        assert await committed(onceflow, n) == [{"commit": True}]


async def test_long_poll_waits_for_the_commit_not_for_the_data(onceflow: InProcess) -> None:
    onceflow.app.config.long_poll_timeout = 10.0  # the wait must end because of the commit
    await make(onceflow, "lp")
    head = await onceflow.client.head(S + "lp")
    tail = head.headers["stream-next-offset"]
    t = Txn(onceflow.client, "lp")
    await t.init()
    poll = asyncio.ensure_future(onceflow.client.get(S + "lp", params={"offset": tail, "live": "long-poll"}))
    await asyncio.sleep(0.05)
    await t.send("lp", {"n": 1})
    await asyncio.sleep(0.1)
    assert not poll.done()  # the transaction's data is not visible yet
    await t.end(commit=True)
    r = await poll
    assert r.status_code == 200 and r.json() == [{"n": 1}]


async def test_group_offsets_count_only_if_the_transaction_commits(onceflow: InProcess) -> None:
    await make(onceflow, "in", "out")
    c = onceflow.client
    off = (await c.head(S + "in")).headers["stream-next-offset"]
    t = Txn(c, "eos")
    await t.init()
    await t.send("out", {"n": 1})
    r = await c.post(T + "eos/offsets", json={"epoch": t.epoch, "group": "g", "offsets": {"in": off}})
    assert r.status_code == 200
    assert (await c.get("/v1/groups/g/offsets")).json()["offsets"] == {}
    await t.end(commit=False)
    assert (await c.get("/v1/groups/g/offsets")).json()["offsets"] == {}
    await t.send("out", {"n": 2})
    await c.post(T + "eos/offsets", json={"epoch": t.epoch, "group": "g", "offsets": {"in": off}})
    await t.end(commit=True)
    assert (await c.get("/v1/groups/g/offsets")).json()["offsets"] == {"in": off}


async def test_group_offsets_are_monotonic_and_fence_zombie_members(onceflow: InProcess) -> None:
    await make(onceflow, "gs")
    c = onceflow.client
    r0 = (await c.head(S + "gs")).headers["stream-next-offset"]
    r1 = (await c.post(S + "gs", json=[{"x": 1}], headers=JSON)).headers["stream-next-offset"]
    g = "/v1/groups/members/offsets"
    assert (await c.post(g, json={"offsets": {"gs": r1}, "member_epoch": 2})).status_code == 200
    back = await c.post(g, json={"offsets": {"gs": r0}, "member_epoch": 2})
    assert back.status_code == 409 and "backwards" in back.json()["error"]["message"]
    zombie = await c.post(g, json={"offsets": {"gs": r1}, "member_epoch": 1})
    assert zombie.status_code == 403
    assert (await c.post(g, json={"offsets": {"gs": r0}, "member_epoch": 3, "reset": True})).status_code == 200
    assert (await c.get(g)).json()["offsets"] == {"gs": r0}


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        (T + "nope/commit", {"epoch": 0, "txn": 1}, 404),
        (T + "x/init", {"timeout_ms": -5}, 400),
        (T + "x/commit", {"epoch": "zero"}, 400),
        (T + "x/offsets", {"epoch": 0, "group": "g", "offsets": {"s": "garbage"}}, 400),
        (T + "x/explode", {}, 404),
        ("/v1/groups/g/offsets", {"offsets": []}, 400),
    ],
)
async def test_bad_transaction_requests_are_4xx_with_a_reason(
    onceflow: InProcess, path: str, body: dict[str, Any], status: int
) -> None:
    r = await onceflow.client.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]


async def test_recovery_completes_a_logged_decision_and_keeps_aborts_hidden(onceflow: InProcess) -> None:
    """Crash after the commit decision was logged but before any marker was written."""
    await make(onceflow, "r1", "r2", "r3")
    t = Txn(onceflow.client, "crashy")
    await t.init()
    await t.send("r3", {"n": "aborted"})
    await t.end(commit=False)
    await t.send("r1", {"n": 1})
    await t.send("r2", {"n": 2})
    coord = onceflow.broker.coordinator

    async def crash(stream: str, producer_id: str, epoch: int, txn: int, commit: bool) -> None:
        raise ConnectionAbortedError("power cut")  # the process dies here

    coord.write_marker = crash
    with pytest.raises(TxnError, match="decided") as raised:  # retriable: the outcome is fixed
        await coord.end("crashy", t.epoch, t.txn, commit=True)
    assert isinstance(raised.value.__cause__, ConnectionAbortedError)
    for s in onceflow.broker.streams.values():  # kill -9: no flush, no snapshot
        s.log.close_files()
    assert coord.log is not None
    coord.log.close_files()
    onceflow.broker.streams.clear()
    again = onceflow.reopen()
    again.open()
    await again.start()
    try:
        for name, expected in (("r1", [{"n": 1}]), ("r2", [{"n": 2}]), ("r3", [])):
            st = again.get(name)
            assert st is not None
            res = again.read(st, again.resolve_start(st, "-1"))  # type: ignore[arg-type]
            assert [m for b in res.batches for m in json.loads(b"[" + b.payload[:-1] + b"]")] == expected
            assert st.stable() == st.tail
        assert again.coordinator.txns["crashy"].status.value == "complete_commit"
    finally:
        again.begin_shutdown()
        await again.close()


@pytest.mark.local_store
async def test_a_lost_completion_record_is_redone_harmlessly(onceflow: InProcess) -> None:
    """COMPLETE is not synced before the answer: if it is lost, recovery rewrites the markers, which
    must neither duplicate nor hide the committed data."""
    from onceflow.storage.log import StreamLog
    from onceflow.storage.position import Position

    await make(onceflow, "lost")
    t = Txn(onceflow.client, "lost")
    await t.init()
    await t.send("lost", {"n": 1})
    await t.end(commit=True)
    before = await committed(onceflow, "lost")
    await onceflow.broker.close()
    coord_dir = onceflow.data / "coordinator"
    log = StreamLog.open(coord_dir, Position(0, 0))
    batches = log.read(log.base, 1 << 20)
    log.close_files()
    last = batches[-1]
    assert b"complete_commit" in last.payload
    (seg,) = sorted(coord_dir.glob("*.seg"))
    with open(seg, "r+b") as f:
        f.truncate(last.start.pos)  # the completion record never reached the disk
    (coord_dir / "producers.snap").unlink()
    again = Broker(onceflow.data)
    again.open()
    assert again.coordinator.txns["lost"].status.value == "prepare_commit"
    await again.start()
    try:
        s = again.get("lost")
        assert s is not None
        res = again.read(s, again.resolve_start(s, "-1"))  # type: ignore[arg-type]
        assert [m for b in res.batches for m in json.loads(b"[" + b.payload[:-1] + b"]")] == before == [{"n": 1}]
        assert s.stable() == s.tail
        assert again.coordinator.txns["lost"].status.value == "complete_commit"
    finally:
        again.begin_shutdown()
        await again.close()
