"""Requests that meet an unfinished transaction, late duplicates, and records that fail to reach the disk.

A commit whose decision (``PREPARE_COMMIT``) is durable but whose markers could not all be written
stays unfinished until the sweep (or a retry of the commit) writes them. Every other request of
that transactional id in that window must be refused as retriable (``503 concurrent_transactions``)
and change nothing. A late duplicate of an append is answered as the duplicate it is and never
begins or touches a transaction. A coordinator record that fails to reach the disk leaves memory as
the disk has it, so neither a retry nor a restart sees a state that was never stored.

I/O failures are injected where the disk is written (``storage.log._write_all``): the log rolls the
failed write back as it would after ENOSPC or EIO.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.disk import Disk
from helpers.servers import InProcess
from helpers.txn import JSON, S, T, Txn, assert_settled, committed, kill, make, serve, status, uncommitted
from onceflow.client.transactions import AsyncTransactionalProducer

pytestmark = pytest.mark.anyio


async def offsets_of(c: InProcess, name: str, n: int) -> list[str]:
    """Append ``n`` messages to ``name`` one by one; the offset after each."""
    out = []
    for i in range(n):
        r = await c.client.post(S + name, json=[i], headers=JSON)
        out.append(r.headers["stream-next-offset"])
    return out


async def send_offsets(c: InProcess, t: Txn, group: str, offsets: dict[str, str]) -> httpx.Response:
    return await c.client.post(T + t.tid + "/offsets", json={"epoch": t.epoch, "group": group, "offsets": offsets})


async def group_offsets(c: InProcess, group: str) -> dict[str, str]:
    body: dict[str, dict[str, str]] = (await c.client.get(f"/v1/groups/{group}/offsets")).json()
    return body["offsets"]


def assert_retriable(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "concurrent_transactions" and "retry-after" in r.headers
    assert "being completed" in r.json()["error"]["message"]


def state(body: dict[str, Any]) -> tuple[Any, ...]:
    return body["epoch"], body["txn"], body["status"], body["streams"]


async def decided_but_unfinished(c: InProcess, disk: Disk) -> tuple[Txn, list[str]]:
    """Producer "w" writes {"n": 1} to "a" and {"n": 2} to "b" with group "g"'s offset of "in" in
    transaction 1 and commits; the decision is logged, b's marker fails. Returns the producer and
    two offsets of "in" (the one committed, a later one)."""
    await make(c, "in", "a", "b", "c")
    offs = await offsets_of(c, "in", 2)
    t = Txn(c.client, "w")
    await t.init()
    assert (await t.send("a", {"n": 1})).status_code == 200
    assert (await t.send("b", {"n": 2})).status_code == 200
    assert (await send_offsets(c, t, "g", {"in": offs[0]})).status_code == 200
    disk.fail(c.broker.streams["b"].log)
    r = await t.end(commit=True)
    assert r.status_code == 503, r.text  # the client retries it
    assert (await status(c, "w"))["status"] == "prepare_commit"
    return t, offs


# ---------------------------------------------------------------------- 1. a commit decided, not finished


async def test_offsets_sent_while_a_commit_is_unfinished_do_not_corrupt_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reported scenario, end to end: the next batch's offsets arrive while the commit's
    marker in "b" could not be written. They must neither replace the decided offsets nor drop the
    decision's streams: the sweep then finishes the commit in both streams with the decided
    offsets, and a restart keeps it so."""
    data = tmp_path / "data"
    disk = Disk(monkeypatch)
    async with serve(data, recover=False) as c:  # no background sweep: the test runs it
        t, offs = await decided_but_unfinished(c, disk)
        late = await send_offsets(c, t, "g", {"in": offs[1]})
        disk.heal()
        await c.broker.coordinator.expire()  # the sweep retries the markers
        assert await committed(c, "a") == [{"n": 1}] and await committed(c, "b") == [{"n": 2}]
        await assert_settled(c, "a", "b")
        assert await group_offsets(c, "g") == {"in": offs[0]}
        assert_retriable(late)
        # the retried request now begins the next transaction
        again = await send_offsets(c, t, "g", {"in": offs[1]})
        assert again.status_code == 200 and again.json()["txn"] == 2
        assert (await t.end(commit=True, txn=2)).status_code == 200
        assert await group_offsets(c, "g") == {"in": offs[1]}
        await kill(c.broker)
    async with serve(data) as c:
        assert await committed(c, "a") == [{"n": 1}] and await committed(c, "b") == [{"n": 2}]
        await assert_settled(c, "a", "b")
        assert await group_offsets(c, "g") == {"in": offs[1]}
        await c.broker.close()


@pytest.mark.parametrize(
    "request_kind",
    [
        "offsets",
        "append",
        "append to another stream",
        "commit append of the next",
        "commit of the next",
        "abort of the next",
        "abort of the decided",
    ],
)
async def test_every_request_meeting_an_unfinished_commit_is_retriable_and_changes_nothing(
    onceflow: InProcess,
    monkeypatch: pytest.MonkeyPatch,
    request_kind: str,
) -> None:
    disk = Disk(monkeypatch)
    t, offs = await decided_but_unfinished(onceflow, disk)
    before = state(await status(onceflow, "w"))
    raw_before = {n: await uncommitted(onceflow, n) for n in ("a", "b", "c")}

    async def send() -> httpx.Response:
        if request_kind == "offsets":
            return await send_offsets(onceflow, t, "g", {"in": offs[1]})
        if request_kind == "append":
            return await t.send("a", {"n": 3})
        if request_kind == "append to another stream":
            return await t.send("c", {"n": 3})
        if request_kind == "commit append of the next":
            return await t.send("c", {"n": 3}, commit=2)
        if request_kind == "commit of the next":
            return await t.end(commit=True, txn=2)
        if request_kind == "abort of the next":
            return await t.end(commit=False, txn=2)
        return await t.end(commit=False, txn=1)

    assert_retriable(await send())
    assert state(await status(onceflow, "w")) == before
    assert {n: await uncommitted(onceflow, n) for n in ("a", "b", "c")} == raw_before
    disk.heal()
    await onceflow.broker.coordinator.expire()
    assert await committed(onceflow, "a") == [{"n": 1}] and await committed(onceflow, "b") == [{"n": 2}]
    await assert_settled(onceflow, "a", "b", "c")
    assert await group_offsets(onceflow, "g") == {"in": offs[0]}
    # the retry gets the answer the request deserves now that the commit is complete
    again = await send()
    if request_kind == "offsets":
        assert again.status_code == 200 and again.json()["txn"] == 2
    elif request_kind in ("append", "append to another stream"):
        assert again.status_code == 200 and t.txn == 2
    elif request_kind == "commit append of the next":
        assert again.status_code == 200 and again.headers["transaction-committed"] == "true"
        assert await committed(onceflow, "c") == [{"n": 3}]
    else:
        assert again.status_code == 409, again.text  # not the current transaction / already committed


@pytest.mark.parametrize("how", ["commit", "commit append", "init"])
async def test_a_commit_whose_decision_is_logged_is_finished_by_its_retry(
    onceflow: InProcess,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
) -> None:
    """The retry of the commit itself (or an init, which must end what the old epoch left) finishes
    the decided commit: while the disk still fails it is 503 and changes nothing, once it works the
    markers are written and the answer is committed, without waiting for the sweep."""
    disk = Disk(monkeypatch)
    await make(onceflow, "a", "b")
    t = Txn(onceflow.client, "w")
    await t.init()
    assert (await t.send("a", {"n": 1})).status_code == 200
    disk.fail(onceflow.broker.streams["a"].log)
    if how == "commit append":  # the last append carries the commit; its data is stored, a's marker fails
        first = await t.send("b", {"n": 2}, commit=1)
    else:
        assert (await t.send("b", {"n": 2})).status_code == 200
        first = await t.end(commit=True)
    assert first.status_code == 503, first.text
    before = state(await status(onceflow, "w"))
    assert before[2] == "prepare_commit"

    async def retry() -> httpx.Response:
        if how == "commit":
            return await t.end(commit=True, txn=1)
        if how == "commit append":
            return await t.send("b", {"n": 2}, commit=1, seq=0)
        return await onceflow.client.post(T + "w/init", json={"request_id": "another instance"})

    still = await retry()
    assert still.status_code == 503 and still.headers.get("retry-after"), still.text
    assert state(await status(onceflow, "w")) == before
    disk.heal()
    done = await retry()
    assert done.status_code in (200, 204), done.text
    if how == "commit":
        assert done.json()["status"] == "complete_commit"
    elif how == "commit append":
        assert done.status_code == 204 and done.headers["transaction-committed"] == "true"
        assert done.headers["transaction-number"] == "1"
    else:
        assert done.json()["epoch"] == t.epoch + 1
    assert await committed(onceflow, "a") == [{"n": 1}] and await committed(onceflow, "b") == [{"n": 2}]
    await assert_settled(onceflow, "a", "b")
    assert "decided" in first.json()["error"]["message"]  # the first answer said the outcome is fixed


async def test_the_transactional_producer_rides_out_a_marker_write_that_fails_once(
    onceflow: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = Disk(monkeypatch)
    await make(onceflow, "a", "b")
    p = AsyncTransactionalProducer("http://testserver", "w", client=onceflow.client, retry_backoff=(0.01, 0.05))
    await p.init()
    async with p.transaction():
        await p.append("a", {"n": 1})
        await p.flush()
        await p.append("b", {"n": 2})
        disk.fail(onceflow.broker.streams["a"].log, times=1)  # a's commit marker
    assert disk.failed == 1
    async with p.transaction():
        await p.append("a", {"n": 3})
    assert await committed(onceflow, "a") == [{"n": 1}, {"n": 3}] and await committed(onceflow, "b") == [{"n": 2}]
    await assert_settled(onceflow, "a", "b")


# ---------------------------------------------------------------------- 2. late duplicates


@pytest.mark.parametrize("ended", ["commit", "abort"])
async def test_a_late_duplicate_opens_no_phantom_transaction(onceflow: InProcess, ended: str) -> None:
    """The delayed original of an append of a transaction that already ended is a duplicate: it
    must not begin the next transaction, which would time out and fence the healthy producer."""
    await make(onceflow, "s")
    t = Txn(onceflow.client, "w")
    await t.init(timeout_ms=100)
    first = {"producer-id": "txn:w", "producer-epoch": str(t.epoch), "producer-seq": "0", "transaction-id": "w"}
    assert (await onceflow.client.post(S + "s", json=[{"n": 1}], headers=first)).status_code == 200
    assert (await t.end(commit=ended == "commit", txn=1)).status_code == 200
    late = await onceflow.client.post(S + "s", json=[{"n": 1}], headers=first)
    assert late.status_code == 204, late.text
    assert "transaction-number" not in late.headers  # its transaction ended: it belongs to no open one
    body = await status(onceflow, "w")
    assert (body["txn"], body["status"]) == (1, f"complete_{ended}")
    await asyncio.sleep(0.15)  # past the timeout: a phantom transaction would be aborted, the id fenced
    assert await onceflow.broker.coordinator.expire() == []
    t.seqs["s"] = 1
    nxt = await t.send("s", {"n": 2})
    assert nxt.status_code == 200 and t.txn == 2, nxt.text
    assert (await t.end(commit=True)).status_code == 200
    assert await committed(onceflow, "s") == ([{"n": 1}] if ended == "commit" else []) + [{"n": 2}]


async def test_a_duplicate_is_answered_as_such_and_touches_no_transaction(onceflow: InProcess) -> None:
    await make(onceflow, "s", "u")
    t = Txn(onceflow.client, "w")
    await t.init()
    assert (await t.send("s", {"n": 1})).status_code == 200
    # its own transaction still open: the duplicate carries its number
    again = await t.send("s", {"n": 1}, seq=0)
    assert again.status_code == 204 and again.headers["transaction-number"] == "1"
    assert state(await status(onceflow, "w")) == (t.epoch, 1, "ongoing", ["s"])
    assert (await t.end(commit=True)).status_code == 200
    # transaction 2 writes to "u" only; a late duplicate in "s" belongs to transaction 1
    assert (await t.send("u", {"n": 2})).status_code == 200 and t.txn == 2
    late = await onceflow.client.post(
        S + "s",
        json=[{"n": 1}],
        headers={
            "producer-id": "txn:w",
            "producer-epoch": str(t.epoch),
            "producer-seq": "0",
            "transaction-id": "w",
        },
    )
    assert late.status_code == 204 and "transaction-number" not in late.headers
    assert state(await status(onceflow, "w")) == (t.epoch, 2, "ongoing", ["u"])
    assert (await t.end(commit=True)).status_code == 200
    assert await uncommitted(onceflow, "s") == [{"n": 1}] and await committed(onceflow, "u") == [{"n": 2}]
    # a fenced epoch's duplicate is still refused as fenced
    fresh = Txn(onceflow.client, "w")
    await fresh.init()
    zombie = await t.send("s", {"n": 1}, seq=0)
    assert zombie.status_code == 403


async def test_a_transactional_append_to_a_closed_stream_begins_no_transaction(onceflow: InProcess) -> None:
    """Refused before the coordinator: it must not open a transaction it never writes to (which
    would hold nothing, time out and fence the producer)."""
    await make(onceflow, "s", "shut")
    t = Txn(onceflow.client, "w")
    await t.init()
    assert (await onceflow.client.post(S + "shut", headers={"stream-closed": "true"})).status_code == 204
    r = await t.send("shut", {"n": 1})
    assert r.status_code == 409 and r.json()["error"]["code"] == "stream_closed"
    assert state(await status(onceflow, "w")) == (t.epoch, 0, "empty", [])
    assert (await t.send("s", {"n": 2})).status_code == 200 and t.txn == 1


# ---------------------------------------------------------------------- 3. suspicions


async def test_a_timed_out_transaction_whose_abort_marker_failed_still_fences_its_producer(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """3a: the sweep aborts a transaction open past its timeout; its abort marker fails. Once the
    sweep finishes the abort, the producer is fenced all the same, also after a restart: its next
    append must not begin a new transaction that a commit would publish without the aborted part."""
    data = tmp_path / "data"
    disk = Disk(monkeypatch)
    async with serve(data, recover=False) as c:
        await make(c, "s")
        t = Txn(c.client, "w")
        await t.init(timeout_ms=100)
        assert (await t.send("s", {"n": "part 1"})).status_code == 200
        await asyncio.sleep(0.15)
        disk.fail(c.broker.streams["s"].log)
        await c.broker.coordinator.expire()  # the abort is decided, its marker fails: logged, tried again
        assert (await status(c, "w"))["status"] == "prepare_abort"
        disk.heal()
        await c.broker.coordinator.expire()
        assert await committed(c, "s") == []
        await assert_settled(c, "s")
        late = await t.send("s", {"n": "part 2"})
        assert late.status_code == 403, late.text
        await kill(c.broker)
    async with serve(data) as c:
        t.c = c.client
        assert (await t.send("s", {"n": "part 2"})).status_code == 403
        assert (await t.end(commit=True, txn=2)).status_code == 403
        assert await committed(c, "s") == []
        await assert_settled(c, "s")
        await c.broker.close()


async def test_an_init_whose_record_failed_is_not_answered_by_its_retry_with_that_epoch(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """3b: the record of a new epoch fails to reach the disk. Its retry (same request id) must not
    be answered with the epoch only memory holds: after a restart that epoch would be unknown and
    the zombie of the old one unfenced."""
    data = tmp_path / "data"
    disk = Disk(monkeypatch)
    async with serve(data, recover=False) as c:
        await make(c, "s")
        zombie = Txn(c.client, "w")
        await zombie.init()
        disk.fail(c.broker.coordinator.log)
        failed = await c.client.post(T + "w/init", json={"request_id": "new"})
        assert failed.status_code == 503
        disk.heal()
        retry = await c.client.post(T + "w/init", json={"request_id": "new"})
        assert retry.status_code == 200
        fresh = Txn(c.client, "w")
        fresh.epoch = retry.json()["epoch"]
        assert fresh.epoch == zombie.epoch + 1
        await kill(c.broker)
    async with serve(data) as c:
        zombie.c = fresh.c = c.client
        assert (await status(c, "w"))["epoch"] == fresh.epoch
        assert (await zombie.send("s", {"from": "zombie"})).status_code == 403
        assert (await fresh.send("s", {"from": "fresh"}, commit=1)).status_code == 200
        assert await committed(c, "s") == [{"from": "fresh"}]
        await c.broker.close()


@pytest.mark.parametrize("open_before", [True, False])
async def test_offsets_whose_record_failed_are_not_part_of_the_transaction(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    open_before: bool,
) -> None:
    """An offsets request answered 503 (its record failed) left nothing behind: not in the open
    transaction (a commit publishes only acknowledged offsets), and with no transaction open, no
    new transaction number (a retried commit of the last one is still answered) and nothing a
    compaction would write down as committed."""
    data = tmp_path / "data"
    disk = Disk(monkeypatch)
    async with serve(data, recover=False) as c:
        await make(c, "in", "s")
        offs = await offsets_of(c, "in", 2)
        t = Txn(c.client, "w")
        await t.init()
        assert (await send_offsets(c, t, "g", {"in": offs[0]})).status_code == 200
        assert (await t.send("s", {"n": 1})).status_code == 200
        if not open_before:
            assert (await t.end(commit=True)).status_code == 200
        before = state(await status(c, "w"))
        disk.fail(c.broker.coordinator.log)
        assert (await send_offsets(c, t, "g", {"in": offs[1]})).status_code == 503
        disk.heal()
        assert state(await status(c, "w")) == before
        assert (await t.end(commit=True, txn=1)).status_code == 200  # the commit (or its retry)
        assert await group_offsets(c, "g") == {"in": offs[0]}
        coord = c.broker.coordinator
        coord.compact_bytes = 0
        assert await coord.maybe_compact()
        await kill(c.broker)
    async with serve(data) as c:
        assert await group_offsets(c, "g") == {"in": offs[0]}
        assert (await status(c, "w"))["txn"] == 1
        await c.broker.close()


async def test_a_plain_append_cannot_use_a_transactional_producer_id(onceflow: InProcess) -> None:
    """3c: ``txn:<id>`` belongs to the transactional producer; a plain append under it would use up
    its sequence numbers (its next append then looks like a duplicate, or a gap)."""
    await make(onceflow, "s")
    t = Txn(onceflow.client, "w")
    await t.init()
    for close in (False, True):
        headers = {"producer-id": "txn:w", "producer-epoch": str(t.epoch), "producer-seq": "0", **JSON}
        if close:
            headers["stream-closed"] = "true"
        plain = await onceflow.client.post(S + "s", json=[{"n": "plain"}], headers=headers)
        assert plain.status_code == 400 and "Transaction-Id" in plain.json()["error"]["message"], plain.text
    r = await t.send("s", {"n": 1})
    assert r.status_code == 200
    assert (await t.end(commit=True)).status_code == 200
    assert await uncommitted(onceflow, "s") == [{"n": 1}]


# ---------------------------------------------------------------------- a fence meeting an unfinished abort (found by the simulator)


async def test_fencing_a_task_whose_abort_is_unfinished_writes_the_abort_first(
    onceflow: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by ``onceflow sim`` (seed 28 of the first version with the sink protocol): a task's
    abort was decided but its marker could not be written; the batch's next commit fenced the task
    by moving its id to a new epoch, dropping the unfinished abort. The task's rows stayed open in
    the stream with no marker, held the last stable offset, and were published by the next commit
    marker of that id. Fencing must first finish the decision that is logged."""
    from onceflow.client._errors import OnceflowError
    from onceflow.spark.protocol import (
        SinkTask,
        TaskSpec,
        WriterSettings,
        abort_batch,
        commit_batch,
        run_task,
        task_name,
    )

    disk = Disk(monkeypatch)
    await make(onceflow, "out")
    st = WriterSettings(url="http://testserver", sink="f", request_deadline=0.5, retry_backoff=(0.01, 0.05))
    first = await run_task(onceflow.client, st, TaskSpec(0, "Q", 0, task_name("r1", 0, 1)), [{"out": [b'{"id": 1}']}])
    late = await SinkTask.begin(onceflow.client, st, TaskSpec(0, "Q", 1, task_name("r1", 0, 2)))  # still running
    await late.write({"out": [b'{"id": 2}']})
    await late._producer.flush()  # type: ignore[union-attr]
    disk.fail(onceflow.broker.streams["out"].log)
    with contextlib.suppress(OnceflowError):  # the driver's abort: decided, its markers fail
        await abort_batch(onceflow.client, st, 0, [first])
    assert disk.failed
    disk.heal()
    again = await run_task(onceflow.client, st, TaskSpec(0, "Q", 0, task_name("r2", 0, 3)), [{"out": [b'{"id": 1}']}])
    assert (await commit_batch(onceflow.client, st, 0, [again])).status == "committed"  # fences the late task
    await late.abandon()
    head = await onceflow.client.head(S + "out")
    assert head.headers["stream-last-stable-offset"] == head.headers["stream-next-offset"], (
        "a transaction was left open"
    )
    assert sorted(m["id"] for m in await committed(onceflow, "out")) == [1]


async def test_a_late_duplicate_of_an_offsets_request_cannot_rewind_the_next_transaction(onceflow: InProcess) -> None:
    """Found by ``onceflow sim`` (a copier, seed 735 of an early version): the network delivered a
    copy of transaction N's offsets request late, while transaction N+1 was open with newer offsets;
    it replaced them, N+1 committed the old offsets, and the copier's restart copied that input
    again. An offsets request names its transaction (``txn``) like commit and abort do; one naming
    another transaction is refused and changes nothing."""
    c = onceflow
    await make(c, "in", "out")
    offs = await offsets_of(c, "in", 3)
    t = Txn(c.client, "copier")
    await t.init()
    first = {"epoch": t.epoch, "txn": 1, "group": "g", "offsets": {"in": offs[0]}}
    assert (await c.client.post(T + "copier/offsets", json=first)).status_code == 200
    assert (await t.send("out", {"n": 0}, commit=1)).status_code == 200
    second = {"epoch": t.epoch, "txn": 2, "group": "g", "offsets": {"in": offs[1]}}
    assert (await c.client.post(T + "copier/offsets", json=second)).status_code == 200
    late = await c.client.post(T + "copier/offsets", json=first)  # the copy of the first, delivered now
    assert late.status_code == 409, late.text
    assert late.json()["error"]["code"] == "txn_refused"
    assert (await t.send("out", {"n": 1}, commit=2)).status_code == 200
    assert await group_offsets(c, "g") == {"in": offs[1]}
    ahead = {"epoch": t.epoch, "txn": 5, "group": "g", "offsets": {"in": offs[2]}}
    assert (await c.client.post(T + "copier/offsets", json=ahead)).status_code == 409
    assert await group_offsets(c, "g") == {"in": offs[1]}


async def test_an_init_naming_the_epoch_it_replaces_cannot_fence_a_newer_holder(onceflow: InProcess) -> None:
    """KIP-360's InitProducerId(epoch): a producer that must move past its own epoch (an append
    with no answer) names that epoch; if another instance took the id over meanwhile, the init is
    refused (403 with the current epoch) instead of fencing that instance. A retry of the init that
    did the bump is answered with its epoch."""
    c = onceflow.client
    await make(onceflow, "a")
    old, new = Txn(c, "w"), Txn(c, "w")
    await old.init()
    assert (await old.send("a", {"n": 1})).status_code == 200
    bump = {"expected_epoch": old.epoch, "request_id": "bump-1"}
    r = await c.post(T + "w/init", json=bump)
    assert r.status_code == 200 and r.json()["epoch"] == old.epoch + 1
    again = await c.post(T + "w/init", json=bump)  # its answer was lost: the retry gets the same epoch
    assert again.status_code == 200 and again.json()["epoch"] == old.epoch + 1
    await new.init()  # another instance takes the id over
    stale = await c.post(T + "w/init", json={"expected_epoch": old.epoch + 1, "request_id": "bump-2"})
    assert stale.status_code == 403, stale.text
    assert stale.headers["producer-epoch"] == str(new.epoch)
    assert (await new.send("a", {"n": 2}, commit=1)).status_code == 200  # the newer holder was not fenced
    assert await committed(onceflow, "a") == [{"n": 2}]


async def test_a_completion_record_that_fails_does_not_lose_the_commits_offsets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by ``onceflow sim`` (seed 18050 of the 100,000-seed soak). A commit's completion
    record is not waited for: recovery redoes a decision whose completion is missing. But when
    that record's write fails (EIO, ENOSPC) the log rolls it back, while the next transaction's
    records of the same id reach the disk. After a restart the id's last record is the next
    transaction's, the decision is no longer pending, and the committed transaction's group offsets
    must still be there: else a copier copies its input again (every row twice in its outputs)."""
    data = tmp_path / "data"
    disk = Disk(monkeypatch)
    async with serve(data, recover=False) as c:
        await make(c, "in", "a", "b")
        offs = await offsets_of(c, "in", 2)
        coord = c.broker.coordinator
        real_marker = coord.write_marker
        assert real_marker is not None

        async def marker_then_fail(stream: str, pid: str, epoch: int, txn: int, commit: bool) -> None:
            await real_marker(stream, pid, epoch, txn, commit)
            disk.fail(coord.log, times=1)  # the next coordinator write: the completion record

        t = Txn(c.client, "w")
        await t.init()
        assert (await t.send("a", {"n": 1})).status_code == 200
        assert (await t.send("b", {"n": 2})).status_code == 200
        assert (await send_offsets(c, t, "g", {"in": offs[0]})).status_code == 200
        coord.write_marker = marker_then_fail
        assert (await t.end(commit=True)).status_code == 200
        coord.write_marker = real_marker
        await asyncio.sleep(0.05)  # the completion record's write fails in the background
        assert disk.failed == 1
        assert await group_offsets(c, "g") == {"in": offs[0]}
        # the next transaction: its offsets record is durable and names the same id
        nxt = await send_offsets(c, t, "g", {"in": offs[1]})
        assert nxt.status_code == 200 and nxt.json()["txn"] == 2
        await kill(c.broker)
    async with serve(data) as c:
        assert await committed(c, "a") == [{"n": 1}] and await committed(c, "b") == [{"n": 2}]
        assert await group_offsets(c, "g") == {"in": offs[0]}
        await c.broker.close()


async def test_the_producers_abort_that_finishes_the_sweeps_fenced_abort_is_told_it_was_fenced(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sweep aborts a transaction open past its timeout, with a fence; its marker fails, so the
    abort stays unfinished. The producer's own abort of that transaction then finishes it, which
    moves the id to a new epoch: the answer must say the producer was fenced (403, with the new
    epoch), as it would had the sweep finished first. Answered 200, the producer would begin its
    next transaction in the old epoch and meet the fence there (found by ``onceflow sim``, seed 23705)."""
    disk = Disk(monkeypatch)
    async with serve(tmp_path / "data", recover=False) as c:
        await make(c, "s")
        t = Txn(c.client, "w")
        await t.init(timeout_ms=100)
        assert (await t.send("s", {"n": "part 1"})).status_code == 200
        await asyncio.sleep(0.15)
        disk.fail(c.broker.streams["s"].log)
        await c.broker.coordinator.expire()  # the fenced abort is decided; its marker fails
        assert (await status(c, "w"))["status"] == "prepare_abort"
        disk.heal()
        r = await t.end(commit=False)
        assert r.status_code == 403, r.text
        error = r.json()["error"]
        assert error["code"] == "stale_epoch" and "timeout" in error["message"], error
        assert (await status(c, "w"))["epoch"] == t.epoch + 1  # the abort is finished, fence included
        assert await committed(c, "s") == []
        await assert_settled(c, "s")
        late = await t.send("s", {"n": "part 2"})
        assert late.status_code == 403, late.text
        await c.broker.close()


async def test_a_late_copy_of_an_init_that_a_later_init_replaced_fences_nothing(tmp_path: Path) -> None:
    """A producer's init is carried out but its answer never arrives (the server dies); the
    producer, or its replacement, inits again with a new request id and goes to work. A copy of
    the first init that the network delivers late must not begin yet another epoch: that would
    fence the producer that is working. It is refused (403), also after a restart (found by
    ``onceflow sim``, seed 26411)."""

    async def init(c: InProcess, request_id: str) -> httpx.Response:
        return await c.client.post(T + "w/init", json={"request_id": request_id})

    data = tmp_path / "data"
    async with serve(data) as c:
        await make(c, "s")
        assert (await init(c, "first")).json()["epoch"] == 0  # its answer is lost
        t = Txn(c.client, "w")
        t.epoch = (await init(c, "second")).json()["epoch"]
        assert t.epoch == 1
        assert (await t.send("s", {"n": 1})).status_code == 200
        late = await init(c, "first")
        assert late.status_code == 403, late.text
        assert "later init" in late.json()["error"]["message"]
        assert (await status(c, "w"))["epoch"] == 1
        assert (await t.end(commit=True)).status_code == 200
        await kill(c.broker)
    async with serve(data) as c:
        t.c = c.client
        assert (await init(c, "first")).status_code == 403  # the coordinator's log remembers
        assert (await init(c, "second")).json()["epoch"] == 1  # the retry of the current one, as before
        assert (await t.send("s", {"n": 2})).status_code == 200
        assert (await t.end(commit=True, txn=2)).status_code == 200
        assert await committed(c, "s") == [{"n": 1}, {"n": 2}]
        await c.broker.close()


async def test_a_retried_append_meeting_the_sweeps_unfinished_fenced_abort_is_told_to_retry(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sweep aborts a transaction open past its timeout, with a fence, and the abort's marker
    fails, so it stays unfinished. A retry of the producer's last append (its answer was lost) is
    a duplicate, but its transaction is being aborted: answered as a plain duplicate, the producer
    took its append as stored in an open transaction and began the next one in the fenced epoch
    (found by ``onceflow sim``, seed 30221). It is refused as retriable until the abort is
    finished, then as fenced."""
    disk = Disk(monkeypatch)
    async with serve(tmp_path / "data", recover=False) as c:
        await make(c, "s")
        t = Txn(c.client, "w")
        await t.init(timeout_ms=100)
        assert (await t.send("s", {"n": 1})).status_code == 200
        assert (await t.send("s", {"n": 2})).status_code == 200  # its answer is lost; the producer retries
        await asyncio.sleep(0.15)
        disk.fail(c.broker.streams["s"].log)
        await c.broker.coordinator.expire()  # the fenced abort is decided; its marker fails
        assert (await status(c, "w"))["status"] == "prepare_abort"
        retry = await t.send("s", {"n": 2}, seq=1)
        assert_retriable(retry)
        disk.heal()
        await c.broker.coordinator.expire()  # the sweep finishes the abort, fence included
        retry = await t.send("s", {"n": 2}, seq=1)
        assert retry.status_code == 403, retry.text
        assert await committed(c, "s") == []
        await c.broker.close()


@pytest.mark.parametrize("commit", [True, False])
async def test_a_decision_whose_record_failed_leaves_the_transaction_open_for_its_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, commit: bool
) -> None:
    """The decision is applied to memory when its record is staged (requests after it see it), and
    taken back when that record does not reach the log: the answer is a retriable 503, the id is
    still open with its streams and offsets (as the disk has it), and the retry decides it; a
    restart agrees. Before issue 29 this was TxnMeta.moving; now Coordinator._transition."""
    data = tmp_path / "data"
    disk = Disk(monkeypatch)
    async with serve(data, recover=False) as c:
        await make(c, "in", "a", "b")
        offs = await offsets_of(c, "in", 1)
        t = Txn(c.client, "w")
        await t.init()
        assert (await t.send("a", {"n": 1})).status_code == 200
        assert (await t.send("b", {"n": 2})).status_code == 200
        assert (await send_offsets(c, t, "g", {"in": offs[0]})).status_code == 200
        before = state(await status(c, "w"))
        disk.fail(c.broker.coordinator.log)
        assert (await t.end(commit=commit)).status_code == 503
        disk.heal()
        assert state(await status(c, "w")) == before and before[2] == "ongoing"
        assert (await t.end(commit=commit)).status_code == 200
        assert await group_offsets(c, "g") == ({"in": offs[0]} if commit else {})
        await kill(c.broker)
    async with serve(data) as c:
        expected = [[{"n": 1}], [{"n": 2}]] if commit else [[], []]
        assert [await committed(c, "a"), await committed(c, "b")] == expected
        assert (await status(c, "w"))["status"] == ("complete_commit" if commit else "complete_abort")
        assert await group_offsets(c, "g") == ({"in": offs[0]} if commit else {})
        await c.broker.close()
