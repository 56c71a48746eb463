"""``Transaction-Commit``: the last append of a transaction commits it, in the same request.

A transaction that wrote to one stream only and carries no group offsets is committed by its
marker alone, written with the data in one write and one fsync; anything larger takes the ordinary
decision record. These tests check what a producer relies on: the data is committed exactly once
whatever is retried, a wrong transaction number changes nothing, and a crash that loses the
coordinator's unsynced records neither loses such a commit nor lets the next transaction's data
pass for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

import onceflow.storage.log as storage_log
from helpers.servers import InProcess
from helpers.txn import (
    S,
    Txn,
    assert_settled,
    committed,
    coordinator_records,
    is_txn,
    kill,
    lose_records,
    make,
    serve,
    status,
    uncommitted,
)
from onceflow.client.transactions import AsyncTransactionalProducer
from onceflow.storage.fs import File

pytestmark = pytest.mark.anyio


def statuses(data: Path, tid: str) -> list[tuple[int, str]]:
    """(transaction, status) of every coordinator record of ``tid``, members' decisions included."""
    out = []
    for _, _, rec in coordinator_records(data):
        for r in rec.get("members", [rec]):
            if r.get("tid") == tid:
                out.append((r["txn"], r["status"]))
    return out


@pytest.mark.local_store  # reads the coordinator's records off the disk
async def test_one_request_commits_a_one_stream_transaction_in_one_write(
    onceflow: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    await make(onceflow, "s")
    t = Txn(onceflow.client, "w")
    await t.init()
    segment = onceflow.broker.streams["s"].log._segments[-1].file
    writes: list[int] = []
    real = storage_log._write_all

    def counting(f: File, data: bytes, at: int, sync: bool) -> None:
        if f is segment:
            writes.append(len(data))
        real(f, data, at, sync)

    monkeypatch.setattr(storage_log, "_write_all", counting)
    r = await t.send("s", {"n": 1}, commit=1)
    assert r.status_code == 200, r.text
    assert r.headers["transaction-number"] == "1" and r.headers["transaction-committed"] == "true"
    assert await committed(onceflow, "s") == [{"n": 1}]
    await assert_settled(onceflow, "s")
    assert len(writes) == 1  # the data and its commit marker: one write (and one fsync)
    body = await status(onceflow, "w")
    assert (body["txn"], body["status"]) == (1, "complete_commit")
    await onceflow.broker.coordinator.log.drain()  # type: ignore[union-attr]
    assert statuses(onceflow.data, "w") == [(0, "empty"), (1, "ongoing"), (1, "complete_commit")]  # no decision record
    # the next transaction: opened by a plain append, committed by the last one
    assert (await t.send("s", {"n": 2})).status_code == 200
    assert (await t.send("s", {"n": 3}, commit=2)).headers["transaction-committed"] == "true"
    assert await committed(onceflow, "s") == [{"n": 1}, {"n": 2}, {"n": 3}]
    await assert_settled(onceflow, "s")


async def test_a_retried_commit_append_is_answered_committed_and_stored_once(onceflow: InProcess) -> None:
    await make(onceflow, "s")
    t = Txn(onceflow.client, "w")
    await t.init()
    assert (await t.send("s", {"n": 1}, commit=1)).status_code == 200
    again = await t.send("s", {"n": 1}, commit=1, seq=0)  # the answer was lost: the same request again
    assert again.status_code == 204 and again.headers["transaction-committed"] == "true"
    assert again.headers["transaction-number"] == "1"
    # a separate commit of the same transaction is the same no-op
    assert (await t.end(commit=True, txn=1)).status_code == 200
    assert await committed(onceflow, "s") == [{"n": 1}]
    assert (await t.send("s", {"n": 2}, commit=2)).status_code == 200
    assert await committed(onceflow, "s") == [{"n": 1}, {"n": 2}]


async def test_a_commit_append_naming_another_transaction_is_refused_and_stores_nothing(onceflow: InProcess) -> None:
    await make(onceflow, "s")
    t = Txn(onceflow.client, "w")
    await t.init()
    ahead = await t.send("s", {"n": "ahead"}, commit=2)  # nothing is open: this append would be transaction 1
    assert ahead.status_code == 409 and "transaction 1" in ahead.json()["error"]["message"]
    assert await uncommitted(onceflow, "s") == []
    assert (await t.send("s", {"n": 1}, commit=1)).status_code == 200
    # transaction 1 is committed: new data naming it would land outside any transaction
    late = await t.send("s", {"n": "late"}, commit=1)
    assert late.status_code == 409 and "already committed" in late.json()["error"]["message"]
    assert await uncommitted(onceflow, "s") == [{"n": 1}]
    # an open transaction can only be committed under its own number
    assert (await t.send("s", {"n": 2})).status_code == 200
    stale = await t.send("s", {"n": "stale"}, commit=1)
    assert stale.status_code == 409
    assert await uncommitted(onceflow, "s") == [{"n": 1}, {"n": 2}]
    assert (await t.send("s", {"n": 3}, commit=2)).status_code == 200
    assert await committed(onceflow, "s") == [{"n": 1}, {"n": 2}, {"n": 3}]


@pytest.mark.parametrize("header", ["yes", "-1", "1.0", "", "١".encode(), "9" * 30])
async def test_a_malformed_transaction_commit_header_is_a_400(onceflow: InProcess, header: str | bytes) -> None:
    await make(onceflow, "s")
    t = Txn(onceflow.client, "w")
    await t.init()
    r = await onceflow.client.post(
        S + "s",
        json=[1],
        headers={
            "producer-id": "txn:w",
            "producer-epoch": str(t.epoch),
            "producer-seq": "0",
            "transaction-id": "w",
            "transaction-commit": header,
        },
    )
    assert r.status_code == 400 and "Transaction-Commit" in r.json()["error"]["message"]
    plain = await onceflow.client.post(S + "s", json=[1], headers={"transaction-commit": "1"})
    assert plain.status_code == 400 and "Transaction-Id" in plain.json()["error"]["message"]
    assert await uncommitted(onceflow, "s") == []


@pytest.mark.local_store  # reads the coordinator's records off the disk
async def test_a_commit_append_ends_a_transaction_of_several_streams_or_with_offsets(onceflow: InProcess) -> None:
    await make(onceflow, "a", "b", "in")
    t = Txn(onceflow.client, "w")
    await t.init()
    assert (await t.send("a", {"to": "a"})).status_code == 200
    r = await t.send("b", {"to": "b"}, commit=1)
    assert r.status_code == 200 and r.headers["transaction-committed"] == "true"
    assert await committed(onceflow, "a") == [{"to": "a"}] and await committed(onceflow, "b") == [{"to": "b"}]
    await assert_settled(onceflow, "a", "b")
    # one stream, but with a group's offsets: they take effect with the data
    await onceflow.client.post(S + "in", json=[1, 2], headers={"content-type": "application/json"})
    position = (await onceflow.client.head(S + "in")).headers["stream-next-offset"]
    off = await onceflow.client.post(
        "/v1/txn/w/offsets", json={"epoch": t.epoch, "group": "g", "offsets": {"in": position}}
    )
    assert off.status_code == 200 and off.json()["txn"] == 2
    assert (await onceflow.client.get("/v1/groups/g/offsets")).json()["offsets"] == {}  # not before the commit
    assert (await t.send("a", {"to": "a", "n": 2}, commit=2)).headers["transaction-committed"] == "true"
    assert (await onceflow.client.get("/v1/groups/g/offsets")).json()["offsets"] == {"in": position}
    assert await committed(onceflow, "a") == [{"to": "a"}, {"to": "a", "n": 2}]
    await onceflow.broker.coordinator.log.drain()  # type: ignore[union-attr]
    assert (1, "prepare_commit") in statuses(onceflow.data, "w") and (2, "prepare_commit") in statuses(
        onceflow.data, "w"
    )


# ---------------------------------------------------------------------- crashes


async def commit_one_and_kill(data: Path, then_open_another: bool = False) -> Txn:
    """A server on ``data`` where producer "w" commits transaction 1 ({"n": 1} into "s") with its
    append, (optionally) leaves transaction 2 open with {"n": "undecided"}, and is killed."""
    async with serve(data) as c:
        await make(c, "s")
        t = Txn(c.client, "w")
        await t.init()
        assert (await t.send("s", {"n": 1}, commit=1)).status_code == 200
        if then_open_another:
            assert (await t.send("s", {"n": "undecided"})).status_code == 200
            assert t.txn == 2
        await kill(c.broker)
    return t


@pytest.mark.parametrize("lost", ["complete", "ongoing and complete"])
async def test_a_commit_by_marker_survives_losing_the_coordinators_records(tmp_path: Path, lost: str) -> None:
    data = tmp_path / "data"
    t = await commit_one_and_kill(data)
    gone = lose_records(
        data,
        lambda r: r.get("tid") == "w" and r["txn"] == 1 and (lost != "complete" or r["status"] == "complete_commit"),
    )
    assert {r["status"] for r in gone} == (
        {"complete_commit"} if lost == "complete" else {"ongoing", "complete_commit"}
    )
    async with serve(data) as c:
        t.c = c.client
        assert await committed(c, "s") == [{"n": 1}]
        await assert_settled(c, "s")
        body = await status(c, "w")
        assert (body["epoch"], body["txn"], body["status"]) == (t.epoch, 1, "complete_commit")  # not fenced
        retry = await t.send("s", {"n": 1}, commit=1, seq=0)
        assert retry.status_code == 204 and retry.headers["transaction-committed"] == "true"
        assert (await t.end(commit=True, txn=1)).status_code == 200
        assert (await t.send("s", {"n": 2}, commit=2)).status_code == 200  # number 1 is never reused
        assert await committed(c, "s") == [{"n": 1}, {"n": 2}]
        await c.broker.close()


async def test_the_next_transactions_data_is_not_taken_for_a_commit_by_marker(tmp_path: Path) -> None:
    """Transaction 1 committed by its marker, transaction 2's data durable after it, and the
    coordinator log lost everything after ONGOING 1: the restart must not read 2's data as 1's."""
    data = tmp_path / "data"
    t = await commit_one_and_kill(data, then_open_another=True)
    gone = lose_records(data, lambda r: r.get("tid") == "w" and (is_txn("w", "complete_commit", 1)(r) or r["txn"] == 2))
    assert [r["status"] for r in gone] == ["complete_commit", "ongoing"]
    async with serve(data) as c:
        t.c = c.client
        assert await committed(c, "s") == [{"n": 1}]
        await assert_settled(c, "s")
        assert (await status(c, "w"))["epoch"] == t.epoch + 1  # fenced: its transaction 2 was cut away
        assert (await t.send("s", {"n": 3}, commit=2)).status_code == 403
        fresh = Txn(c.client, "w")
        await fresh.init()
        assert (await fresh.send("s", {"n": "redone"}, commit=1)).status_code == 200
        assert await committed(c, "s") == [{"n": 1}, {"n": "redone"}]
        await c.broker.close()


async def test_the_next_transactions_data_in_another_stream_is_not_taken_for_a_commit_by_marker(tmp_path: Path) -> None:
    """Found by `onceflow chaos` (seed 1, in CI): transaction 1 committed by its marker in "s", the
    coordinator log kept only its ONGOING record; transaction 2 wrote to "s" and to "t", and none of
    its records survived. Recovery took 2's open data in "t" for transaction 1's (ONGOING, another
    stream), then recorded 1 as committed by its marker, which left that data open and owned by
    nothing, until a later commit marker in "t" published it: part of an aborted transaction."""
    data = tmp_path / "data"
    async with serve(data) as c:
        await make(c, "s", "t")
        t = Txn(c.client, "w")
        await t.init()
        assert (await t.send("s", {"n": 1}, commit=1)).status_code == 200
        assert (await t.send("s", {"n": "2s"})).status_code == 200
        assert (await t.send("t", {"n": "2t"})).status_code == 200
        assert t.txn == 2
        await kill(c.broker)
    gone = lose_records(data, lambda r: r.get("tid") == "w" and (is_txn("w", "complete_commit", 1)(r) or r["txn"] == 2))
    assert [r["status"] for r in gone] == ["complete_commit", "ongoing", "ongoing"]
    async with serve(data) as c:
        t.c = c.client
        assert await committed(c, "s") == [{"n": 1}] and await committed(c, "t") == []
        await assert_settled(c, "s", "t")  # nothing left open: transaction 2 aborted in both streams
        assert (await status(c, "w"))["epoch"] == t.epoch + 1
        fresh = Txn(c.client, "w")
        await fresh.init()
        assert (await fresh.send("t", {"n": "later"}, commit=1)).status_code == 200
        assert await committed(c, "t") == [{"n": "later"}]  # and 2's data stays out of it
        await c.broker.close()


async def test_data_whose_commit_marker_was_torn_is_committed_by_the_retry(tmp_path: Path) -> None:
    data = tmp_path / "data"
    t = await commit_one_and_kill(data)
    (seg,) = sorted((data / "streams").glob("*/*.seg"))
    with open(seg, "r+b") as f:  # the marker, last in the file, torn by the crash
        f.truncate(seg.stat().st_size - 1)
    lose_records(data, is_txn("w", "complete_commit", 1))
    async with serve(data) as c:
        t.c = c.client
        assert await committed(c, "s") == [] and await uncommitted(c, "s") == [{"n": 1}]
        assert (await status(c, "w"))["status"] == "ongoing"
        retry = await t.send("s", {"n": 1}, commit=1, seq=0)  # the producer never got its answer
        assert retry.status_code == 204 and retry.headers["transaction-committed"] == "true"
        assert await committed(c, "s") == [{"n": 1}]
        await assert_settled(c, "s")
        await c.broker.close()


# ---------------------------------------------------------------------- the client


async def test_the_transactional_producer_commits_with_its_last_append(onceflow: InProcess) -> None:
    await make(onceflow, "a", "b", "in")
    requests: list[str] = []

    async def note(req: httpx.Request) -> None:
        requests.append(f"{req.method} {req.url.path}")

    client = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=onceflow.app), base_url="http://t", event_hooks={"request": [note]}
    )
    p = AsyncTransactionalProducer("http://t", "w", client=client)
    await p.init()
    for n in range(3):
        async with p.transaction():
            await p.extend("a", [{"n": n}, {"n": n, "more": True}])
    assert [r for r in requests if r.startswith("POST")] == ["POST /v1/txn/w/init"] + [
        "POST /v1/stream/a"
    ] * 3  # one request each
    requests.clear()
    async with p.transaction():  # two streams: the first is sent, the second carries the commit
        await p.append("a", {"to": "a"})
        await p.append("b", {"to": "b"})
    assert sorted(r for r in requests if r.startswith("POST")) == ["POST /v1/stream/a", "POST /v1/stream/b"]
    position = (await onceflow.client.head(S + "in")).headers["stream-next-offset"]
    async with p.transaction():  # offsets only: nothing to carry the commit
        await p.send_offsets_to_transaction("g", {"in": position})
    with pytest.raises(RuntimeError):
        async with p.transaction():
            await p.append("a", {"aborted": True})
            await p.flush()
            raise RuntimeError("the step failed")
    async with p.transaction():
        await p.append("a", {"after": "abort"})
    assert await committed(onceflow, "a") == [
        {"n": 0},
        {"n": 0, "more": True},
        {"n": 1},
        {"n": 1, "more": True},
        {"n": 2},
        {"n": 2, "more": True},
        {"to": "a"},
        {"after": "abort"},
    ]
    assert await committed(onceflow, "b") == [{"to": "b"}]
    assert (await onceflow.client.get("/v1/groups/g/offsets")).json()["offsets"] == {"in": position}
    await assert_settled(onceflow, "a", "b")
    body: dict[str, Any] = await status(onceflow, "w")
    assert (body["txn"], body["status"]) == (7, "complete_commit")
    await client.aclose()
