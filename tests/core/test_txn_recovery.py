"""Recovery of transactions whose coordinator records did not all reach the disk.

The coordinator does not wait for its ONGOING records (nor for COMPLETE): a crash can leave a
stream holding transactional data that the coordinator log knows nothing, or too little, about.
Each test runs a broker, "kills" it after everything staged reached the disk (no clean close, no
snapshot; or a clean close where noted), cuts the coordinator log the way a crash before its fsync
would, restarts, and checks what a user relies on: committed data is there exactly once, undecided or
aborted data is never visible to read_committed, the last stable offset is the tail, a
multi-stream transaction is all or nothing, and the transactional id works again.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from helpers.servers import InProcess
from helpers.txn import (
    JSON,
    S,
    Txn,
    assert_settled,
    committed,
    is_txn,
    kill,
    lose_records,
    lose_tail_from,
    make,
    serve,
    status,
    uncommitted,
)
from onceflow.core.broker import Broker
from onceflow.core.txn import TxnError

pytestmark = pytest.mark.anyio


async def crash_before_markers(*_: object) -> None:
    raise OSError("the process dies before the markers")


# ---------------------------------------------------------------------- data durable, ONGOING lost


@pytest.mark.parametrize("before", ["first transaction", "after a commit"])
async def test_data_without_its_ongoing_record_is_aborted_and_the_producer_fenced(tmp_path: Path, before: str) -> None:
    data = tmp_path / "data"
    async with serve(data) as c:
        await make(c, "s")
        t = Txn(c.client, "w")
        await t.init()
        if before == "after a commit":
            await t.send("s", {"n": "committed"})
            assert (await t.end(commit=True)).status_code == 200
        lost_txn = t.txn + 1
        assert (await t.send("s", {"n": "undecided"})).status_code == 200  # acknowledged: durable
        await kill(c.broker)
    lost = lose_tail_from(data, is_txn("w", "ongoing", lost_txn))
    assert [r["status"] for r in lost] == ["ongoing"]
    kept = [{"n": "committed"}] if before == "after a commit" else []
    async with serve(data) as c:
        t.c = c.client  # the same producer, talking to the restarted server
        assert await committed(c, "s") == kept
        assert {"n": "undecided"} in await uncommitted(c, "s")
        await assert_settled(c, "s")
        # the producer believes its transaction is open: it must not go on with half of it
        assert (await status(c, "w"))["epoch"] == t.epoch + 1
        assert (await t.send("s", {"n": "continues"})).status_code == 403
        assert (await t.end(commit=True)).status_code == 403
        # a new instance of the same id works from a clean slate
        fresh = Txn(c.client, "w")
        await fresh.init()
        await fresh.send("s", {"n": "redone"})
        assert (await fresh.end(commit=True)).status_code == 200
        assert await committed(c, "s") == [*kept, {"n": "redone"}]
        await assert_settled(c, "s")
        await c.broker.close()


@pytest.mark.parametrize("dies", ["before the abort marker", "after the abort marker"])
async def test_a_restart_that_dies_while_aborting_is_finished_by_the_next(tmp_path: Path, dies: str) -> None:
    """Recovery fences the id before it writes the abort marker: whether the marker made it or
    not, the next restart ends with the data aborted and the old producer refused."""
    data = tmp_path / "data"
    async with serve(data) as c:
        await make(c, "s")
        t = Txn(c.client, "w")
        await t.init()
        await t.send("s", {"n": 1})
        await kill(c.broker)
    lose_tail_from(data, is_txn("w", "ongoing", 1))
    broker = Broker(data)
    broker.open()
    real = broker.coordinator.write_marker
    assert real is not None

    async def dying(stream: str, producer_id: str, epoch: int, txn: int, commit: bool) -> None:
        if dies == "after the abort marker":
            await real(stream, producer_id, epoch, txn, commit)
        raise OSError("the process dies")

    broker.coordinator.write_marker = dying
    with pytest.raises(OSError):
        await broker.start()
    await kill(broker)
    async with serve(data) as c:
        t.c = c.client
        assert await committed(c, "s") == []
        await assert_settled(c, "s")
        assert (await status(c, "w"))["epoch"] == t.epoch + 1  # fenced once, not again
        assert (await t.send("s", {"n": 2})).status_code == 403
        await c.broker.close()


# ---------------------------------------------------------------------- a stream's addition lost, no decision


@pytest.mark.parametrize("outcome", ["commit", "abort", "timeout"])
async def test_a_stream_whose_addition_was_lost_joins_the_open_transaction(tmp_path: Path, outcome: str) -> None:
    """ONGOING {a} is durable, the record adding b is not, b's data is: after a restart the
    transaction still covers both, whichever way it ends."""
    data = tmp_path / "data"
    async with serve(data) as c:
        await make(c, "a", "b")
        t = Txn(c.client, "w")
        await t.init(timeout_ms=300 if outcome == "timeout" else None)
        await t.send("a", {"to": "a"})
        await t.send("b", {"to": "b"})
        await kill(c.broker)
    lost = lose_tail_from(
        data, lambda r: r.get("tid") == "w" and r["status"] == "ongoing" and r["streams"] == ["a", "b"]
    )
    assert len(lost) == 1
    async with serve(data) as c:
        t.c = c.client
        assert (await status(c, "w"))["streams"] == ["a", "b"]
        assert await committed(c, "a") == [] and await committed(c, "b") == []  # still open
        if outcome == "timeout":
            await asyncio.sleep(0.4)
            assert await c.broker.coordinator.expire() == ["w"]
        else:
            r = await t.end(commit=outcome == "commit")  # the producer's (retried) request
            assert r.status_code == 200, r.text
        expected = outcome == "commit"
        assert await committed(c, "a") == ([{"to": "a"}] if expected else [])
        assert await committed(c, "b") == ([{"to": "b"}] if expected else [])
        await assert_settled(c, "a", "b")
        await c.broker.close()


async def test_data_lost_after_its_ongoing_record_is_retried_into_the_same_transaction(tmp_path: Path) -> None:
    """The ONGOING record is durable but the data never was: the retried append joins the same
    transaction, whose commit then works."""
    data = tmp_path / "data"
    async with serve(data) as c:
        await make(c, "s")
        t = Txn(c.client, "w")
        await t.init()
        meta = await c.broker.coordinator.begin_write("w", t.epoch, "s")  # ... and the append dies
        await kill(c.broker)
    async with serve(data) as c:
        t.c = c.client
        r = await t.send("s", {"n": 1})  # the client's retry of the same sequence
        assert r.status_code == 200 and t.txn == meta.txn
        assert (await t.end(commit=True)).status_code == 200
        assert await committed(c, "s") == [{"n": 1}]
        await assert_settled(c, "s")
        await c.broker.close()


# ---------------------------------------------------------------------- the decision was logged


@pytest.mark.parametrize("decision", ["commit", "abort", "members"])
async def test_a_logged_decision_covers_streams_whose_addition_was_lost(tmp_path: Path, decision: str) -> None:
    """The decision record alone names every stream: with the ONGOING records gone (which an
    ordered log cannot do, so this is stricter than any crash) and no marker written, recovery
    still finishes the transaction in all its streams."""
    data = tmp_path / "data"
    async with serve(data) as c:
        await make(c, "a", "b")
        coord = c.broker.coordinator
        if decision == "members":
            p0, p1 = Txn(c.client, "spark/q/p0"), Txn(c.client, "spark/q/p1")
            for p in (p0, p1):
                await p.init()
            await p0.send("a", {"from": "p0"})
            await p1.send("a", {"from": "p1"})
            await p1.send("b", {"from": "p1"})
            coord.write_marker = crash_before_markers
            with pytest.raises(OSError):
                await coord.commit_members("q", 5, [(p.tid, p.epoch, p.txn) for p in (p0, p1)], "spark/q/")
        else:
            t = Txn(c.client, "w")
            await t.init()
            await t.send("a", {"from": "w"})
            await t.send("b", {"from": "w"})
            coord.write_marker = crash_before_markers
            with pytest.raises(TxnError, match="decided"):  # logged, its markers failed: retriable
                await coord.end("w", t.epoch, t.txn, commit=decision == "commit")
        await kill(c.broker)
    lost = lose_records(data, lambda r: r.get("status") == "ongoing")
    assert lost
    async with serve(data) as c:
        if decision == "members":
            assert sorted(m["from"] for m in await committed(c, "a")) == ["p0", "p1"]
            assert await committed(c, "b") == [{"from": "p1"}]
            assert (await c.client.get("/v1/sinks/q")).json()["batch"] == 5
        else:
            want = decision == "commit"
            assert await committed(c, "a") == ([{"from": "w"}] if want else [])
            assert await committed(c, "b") == ([{"from": "w"}] if want else [])
            assert (await status(c, "w"))["status"] == f"complete_{decision}"
        await assert_settled(c, "a", "b")
        await c.broker.close()


async def test_a_decision_whose_markers_reached_some_streams_is_finished_in_the_others(tmp_path: Path) -> None:
    """The commit decision is logged and the marker reached stream a, not b: after the restart both
    hold the data exactly once, and the producer, which lost nothing, goes on without re-init."""
    data = tmp_path / "data"
    async with serve(data) as c:
        await make(c, "a", "b")
        t = Txn(c.client, "w")
        await t.init()
        await t.send("a", {"n": 1})
        await t.send("b", {"n": 2})
        real = c.broker.coordinator.write_marker
        assert real is not None

        async def only_a(stream: str, producer_id: str, epoch: int, txn: int, commit: bool) -> None:
            if stream != "a":
                raise OSError("the process dies before b's marker")
            await real(stream, producer_id, epoch, txn, commit)

        c.broker.coordinator.write_marker = only_a
        assert (await t.end(commit=True)).status_code >= 500  # the client retries 5xx
        await kill(c.broker)
    async with serve(data) as c:
        t.c = c.client
        assert await committed(c, "a") == [{"n": 1}]
        assert await committed(c, "b") == [{"n": 2}]
        await assert_settled(c, "a", "b")
        assert (await t.end(commit=True)).status_code == 200  # the client's retry: already done
        await t.send("a", {"n": 3})
        assert (await t.end(commit=True)).status_code == 200
        assert await committed(c, "a") == [{"n": 1}, {"n": 3}]
        await c.broker.close()


@pytest.mark.parametrize("shutdown", ["kill", "clean close"])
async def test_the_next_transaction_is_not_swept_into_a_decision_whose_completion_was_lost(
    tmp_path: Path, shutdown: str
) -> None:
    """Transaction N committed (decision, markers) but its COMPLETE record and the next
    transaction's ONGOING record were lost, while N+1's data reached a stream N also wrote and a
    stream it did not. Recovery redoes N's decision: that must not commit N+1's data, which sits
    after N's marker in the shared stream."""
    data = tmp_path / "data"
    async with serve(data) as c:
        await make(c, "a", "b", "c")
        t = Txn(c.client, "w")
        await t.init()
        await t.send("a", {"txn": "N"})
        await t.send("b", {"txn": "N"})
        assert (await t.end(commit=True)).status_code == 200
        n = t.txn
        await t.send("a", {"txn": "N+1"})
        await t.send("c", {"txn": "N+1"})
        if shutdown == "kill":
            await kill(c.broker)
        else:
            await c.broker.close()  # the stream logs' snapshots now hold what their markers ended
    lost = lose_tail_from(data, is_txn("w", "complete_commit", n))
    assert [r["status"] for r in lost] == ["complete_commit", "ongoing", "ongoing"]
    async with serve(data) as c:
        t.c = c.client
        assert await committed(c, "a") == [{"txn": "N"}]
        assert await committed(c, "b") == [{"txn": "N"}]
        assert await committed(c, "c") == []
        assert {"txn": "N+1"} in await uncommitted(c, "a")
        await assert_settled(c, "a", "b", "c")
        assert (await status(c, "w"))["epoch"] == t.epoch + 1
        assert (await t.send("c", {"txn": "N+1, continued"})).status_code == 403
        fresh = Txn(c.client, "w")
        await fresh.init()
        await fresh.send("a", {"txn": "redone"})
        await fresh.send("c", {"txn": "redone"})
        assert (await fresh.end(commit=True)).status_code == 200
        assert await committed(c, "a") == [{"txn": "N"}, {"txn": "redone"}]
        assert await committed(c, "c") == [{"txn": "redone"}]
        await c.broker.close()


async def test_a_member_that_lost_its_records_fails_the_whole_batch(tmp_path: Path) -> None:
    """Spark tasks: one member's ONGOING record was lost before the batch's commit. After the
    restart that member is fenced and aborted; committing the batch then commits nothing."""
    data = tmp_path / "data"
    async with serve(data) as c:
        await make(c, "x", "y")
        p0, p1 = Txn(c.client, "spark/q/p0"), Txn(c.client, "spark/q/p1")
        for p in (p0, p1):
            await p.init()
        await p0.send("x", {"from": "p0"})
        await p1.send("y", {"from": "p1"})
        await kill(c.broker)
    lose_records(data, is_txn("spark/q/p1", "ongoing"))
    async with serve(data) as c:
        members = [{"id": p.tid, "epoch": p.epoch, "txn": p.txn} for p in (p0, p1)]
        r = await c.client.post("/v1/sinks/q/commit", json={"batch": 0, "members": members, "abort_prefix": "spark/q/"})
        assert r.status_code == 403, r.text
        assert await committed(c, "x") == [] and await committed(c, "y") == []
        await assert_settled(c, "x", "y")
        assert (await c.client.get("/v1/sinks/q")).json()["batch"] is None
        await c.broker.close()


# ---------------------------------------------------------------------- while running


async def test_an_append_that_waited_past_the_end_of_its_transaction_is_refused(tmp_path: Path) -> None:
    """A pipelined append (sequence 2) waits for sequence 1; meanwhile the transaction ends and
    sequence 1 begins the next one. The waiting append was sent for the ended transaction: it is
    refused, not slipped into the next one."""
    data = tmp_path / "data"
    async with serve(data) as c:
        await make(c, "s")
        t = Txn(c.client, "w")
        await t.init()
        await t.send("s", {"seq": 0})
        first = t.txn
        headers = {"producer-id": "txn:w", "producer-epoch": str(t.epoch), "transaction-id": "w", **JSON}
        waiting = asyncio.ensure_future(
            c.client.post(S + "s", json=[{"seq": 2}], headers={**headers, "producer-seq": "2"})
        )
        await asyncio.sleep(0.1)
        assert not waiting.done()
        assert (await t.end(commit=True)).status_code == 200
        r1 = await c.client.post(S + "s", json=[{"seq": 1}], headers={**headers, "producer-seq": "1"})
        assert r1.status_code == 200 and int(r1.headers["transaction-number"]) == first + 1
        r2 = await waiting
        assert r2.status_code == 409, r2.text
        await c.client.post("/v1/txn/w/commit", json={"epoch": t.epoch, "txn": first + 1})
        assert await committed(c, "s") == [{"seq": 0}, {"seq": 1}]
        await c.broker.close()


# ---------------------------------------------------------------------- compaction


def coordinator_state(broker: Broker) -> dict[str, Any]:
    coord = broker.coordinator
    return {
        "txns": {tid: meta.record() for tid, meta in coord.txns.items()},
        "groups": coord.groups,
        "member_epochs": coord.member_epochs,
        "sinks": coord.sinks,
    }


async def busy_coordinator(c: InProcess) -> None:
    """Many records: committed, aborted and open transactions, offsets in and outside them
    (one group reset below what a transaction committed), a sink's batch."""
    await make(c, "a", "in")
    start = (await c.client.head(S + "in")).headers["stream-next-offset"]
    r = await c.client.post(S + "in", json=[1, 2, 3], headers={"content-type": "application/json"})
    tail = r.headers["stream-next-offset"]
    w = Txn(c.client, "w")
    await w.init()
    for n in range(40):
        assert (await w.send("a", {"n": n})).status_code == 200
        if n % 5 == 0:
            off = await c.client.post(
                "/v1/txn/w/offsets", json={"epoch": w.epoch, "group": "copy", "offsets": {"in": tail}}
            )
            assert off.status_code == 200
        assert (await w.end(commit=n % 4 != 3)).status_code == 200
    # the last transaction carries offsets and commits; the group is then reset below them
    assert (await w.send("a", {"n": "last"})).status_code == 200
    assert (
        await c.client.post("/v1/txn/w/offsets", json={"epoch": w.epoch, "group": "copy", "offsets": {"in": tail}})
    ).status_code == 200
    assert (await w.end(commit=True)).status_code == 200
    assert (
        await c.client.post("/v1/groups/reset/offsets", json={"offsets": {"in": tail}, "member_epoch": 3})
    ).status_code == 200
    back = await c.client.post(
        "/v1/groups/copy/offsets", json={"offsets": {"in": start}, "reset": True, "member_epoch": 7}
    )
    assert back.status_code == 200 and back.json()["offsets"] == {"in": start}
    s = Txn(c.client, "spark/k/p0/a0")
    await s.init()
    await s.send("a", {"spark": 1})
    r = await c.client.post(
        "/v1/sinks/k/commit", json={"batch": 4, "members": [{"id": s.tid, "epoch": s.epoch, "txn": s.txn}]}
    )
    assert r.status_code == 200
    o = Txn(c.client, "open")
    await o.init()
    await o.send("a", {"open": True})  # left open


async def test_a_large_coordinator_log_is_compacted_at_open_and_replays_to_the_same_state(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with serve(data) as c:
        await busy_coordinator(c)
        await kill(c.broker)
    big = sum(f.stat().st_size for f in (data / "coordinator").glob("*.seg"))
    broker = Broker(data)
    broker.open()
    expected = coordinator_state(broker)
    await kill(broker)
    broker = Broker(data)
    broker.coordinator.compact_bytes = 1000
    broker.open()
    assert coordinator_state(broker) == expected
    await kill(broker)
    small = sum(f.stat().st_size for f in (data / "coordinator").glob("*.seg"))
    assert small < big / 5, (small, big)
    assert sorted(p.name for p in data.iterdir() if p.name.startswith("coordinator")) == ["coordinator"]
    async with serve(data) as c:  # the compacted log, replayed, serves like the original
        assert coordinator_state(c.broker) == expected
        assert c.broker.coordinator.groups["copy"]["in"] < c.broker.coordinator.groups["reset"]["in"]  # the reset held
        o = Txn(c.client, "open")
        o.epoch, o.txn = expected["txns"]["open"]["epoch"], expected["txns"]["open"]["txn"]
        assert (await o.end(commit=True)).status_code == 200
        assert {"open": True} in await committed(c, "a")
        await assert_settled(c, "a")
        await c.broker.close()


class Died(BaseException):
    """The process dies here (nothing after it runs, not even an ``except Exception``)."""


@pytest.mark.parametrize(
    "fault", ["dies before the first rename", "dies between the renames", "disk full at the second rename"]
)
async def test_a_compaction_cut_short_leaves_a_log_that_replays_to_the_same_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    data = tmp_path / "data"
    async with serve(data) as c:
        await busy_coordinator(c)
        await kill(c.broker)
    broker = Broker(data)
    broker.open()
    expected = coordinator_state(broker)
    await kill(broker)
    from onceflow.storage.fs import OsFileSystem

    real_rename = OsFileSystem.rename
    calls: list[str] = []

    def rename(fs: OsFileSystem, src: Path, dst: Path) -> None:
        calls.append(str(dst))
        if fault == "dies before the first rename" or (len(calls) == 2 and fault == "dies between the renames"):
            raise Died
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_rename(fs, src, dst)

    monkeypatch.setattr(OsFileSystem, "rename", rename)
    broker = Broker(data)
    broker.coordinator.compact_bytes = 1000
    if fault.startswith("dies"):
        with pytest.raises(Died):
            broker.open()
        broker.coordinator.log.close_files()  # type: ignore[union-attr]
        broker.executor.shutdown(wait=True)
        assert (data / "coordinator.new").exists()
        monkeypatch.undo()
        broker = Broker(data)
        broker.open()  # finishes or drops the compaction, then replays
    else:
        broker.open()  # gives the compaction up and goes on with the log it had
        monkeypatch.undo()
    assert coordinator_state(broker) == expected
    await kill(broker)
    assert sorted(p.name for p in data.iterdir() if p.name.startswith("coordinator")) == ["coordinator"]
    broker = Broker(data)
    broker.open()
    assert coordinator_state(broker) == expected
    await kill(broker)


async def test_the_coordinator_log_is_compacted_while_serving_without_losing_a_change(tmp_path: Path) -> None:
    """Compaction while the server runs (transactions committed by /commit, by their last append
    and aborted, offsets in and outside transactions), attempted all the time and done whenever
    the log is idle: the server keeps answering, the log stays small, and a restart finds exactly
    the state the server had."""
    data = tmp_path / "data"
    async with serve(data) as c:
        coord = c.broker.coordinator
        coord.compact_bytes = 4096
        await make(c, "a", "in")
        r = await c.client.post(S + "in", json=[1, 2, 3], headers={"content-type": "application/json"})
        tokens = [r.headers["stream-next-offset"]]
        for _ in range(3):
            r = await c.client.post(S + "in", json=[4], headers={"content-type": "application/json"})
            tokens.append(r.headers["stream-next-offset"])

        async def producer(k: int) -> None:
            t = Txn(c.client, f"w{k}")
            await t.init()
            ended, open_txn = 0, None
            for n in range(12):
                if n % 3 == 0:  # the transaction carries a group's offsets
                    off = await c.client.post(
                        f"/v1/txn/w{k}/offsets",
                        json={"epoch": t.epoch, "group": f"g{k}", "offsets": {"in": tokens[n % 4]}},
                    )
                    assert off.status_code == 200, off.text
                    open_txn = off.json()["txn"]
                if n % 2:  # committed by its one append
                    number = open_txn if open_txn is not None else ended + 1
                    r = await t.send("a", {"k": k, "n": n}, commit=number)
                    assert r.status_code == 200 and r.headers["transaction-committed"] == "true", r.text
                else:  # an append, then /commit or /abort
                    assert (await t.send("a", {"k": k, "n": n})).status_code == 200
                    number = t.txn
                    assert (await t.end(commit=n % 4 != 2)).status_code == 200
                ended, open_txn = number, None

        member_epoch = 0

        async def groups() -> None:
            nonlocal member_epoch
            for n in range(20):
                member_epoch += 1
                body = {
                    "offsets": {"in": tokens[min(3, n // 5)]},
                    "member_epoch": member_epoch,
                    "reset": n == 0,
                }  # rewound each round
                r = await c.client.post("/v1/groups/plain/offsets", json=body)
                assert r.status_code == 200, r.text

        for _ in range(4):
            finished = asyncio.Event()

            async def compactor(finished: asyncio.Event = finished) -> None:
                while not finished.is_set():
                    await coord.maybe_compact(tries=1)  # mostly busy: a compaction waits for an idle log
                    await asyncio.sleep(0.001)

            async def workload(finished: asyncio.Event = finished) -> None:
                await asyncio.gather(groups(), *(producer(k) for k in range(3)))
                finished.set()

            before = coord.compactions
            await asyncio.gather(compactor(), workload())
            assert await coord.maybe_compact() or coord.compactions > before  # idle now: due, and done
        assert coord.compactions >= 4
        expected = coordinator_state(c.broker)
        assert expected["groups"]["plain"] == {"in": tokens[3]} and expected["member_epochs"]["plain"] == member_epoch
        await kill(c.broker)
    assert sum(f.stat().st_size for f in (data / "coordinator").glob("*.seg")) < 64 << 10
    broker = Broker(data)
    broker.open()
    assert coordinator_state(broker) == expected
    await kill(broker)


async def test_no_compaction_between_a_durable_record_and_its_effect_in_memory(tmp_path: Path) -> None:
    """Group offsets change in memory only once their record is durable. A compaction in between
    would snapshot the state without them and then drop the record: the offsets would be gone
    after a restart. Catch that instant (the log idle, the caller not yet resumed) and check that
    compaction waits."""
    data = tmp_path / "data"
    async with serve(data) as c:
        coord = c.broker.coordinator
        await make(c, "in")
        tail = (await c.client.post(S + "in", json=[1], headers={"content-type": "application/json"})).headers[
            "stream-next-offset"
        ]
        for n in range(300):  # enough to pass compact_bytes below
            await coord.commit_offsets(f"filler{n % 7}", {"in": tail})
        coord.compact_bytes = 1000
        caught = 0
        for n in range(200):
            task = asyncio.create_task(coord.commit_offsets("g", {"in": tail}, member_epoch=n))
            while not task.done():
                log_ = coord.log
                assert log_ is not None
                if log_.idle and coord._awaiting:  # durable, not yet applied
                    caught += 1
                    assert not await coord.maybe_compact(tries=1)
                await asyncio.sleep(0)
            await task
            if caught >= 3:
                break
        assert caught >= 1, "the instant between a durable record and its effect was never seen"
        assert await coord.maybe_compact()
        expected = coordinator_state(c.broker)
        await kill(c.broker)
    broker = Broker(data)
    broker.open()
    assert coordinator_state(broker) == expected and broker.coordinator.member_epochs["g"] >= 0
    await kill(broker)
