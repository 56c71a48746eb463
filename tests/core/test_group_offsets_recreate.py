"""A stream deleted and created again under the same name starts with no consumer-group offsets.

Group offsets are kept by stream name. A group's offset into a stream that was deleted stayed in
the coordinator, so once a stream of that name was created again its consumers resumed at the old
offset: they silently skipped the new stream's first messages (the offset was a position of the
old one), and a commit of the new stream's real, smaller offset was refused as moving backwards.
Kafka drops a deleted topic's offsets; onceflow drops them when the name is taken again."""

from __future__ import annotations

import asyncio
import errno
from typing import Any

import httpx
import pytest

import onceflow.storage.log as storage_log
from helpers.servers import InProcess
from helpers.txn import JSON, S, T, Txn, after_restart
from onceflow.core.txn import TxnStatus

pytestmark = pytest.mark.anyio


async def _answered(commit: Any) -> int:
    """An offsets commit made straight to the coordinator, as one the server let through while the
    stream existed reaches it: the server now refuses offsets for a stream that does not exist, but
    a delete (and a create) can still come while such a commit's record is being stored."""
    await commit
    return 200


async def _offsets(c: httpx.AsyncClient, group: str) -> dict[str, str]:
    r = await c.get(f"/v1/groups/{group}/offsets")
    assert r.status_code == 200, r.text
    offsets: dict[str, str] = r.json()["offsets"]
    return offsets


async def _fill(c: httpx.AsyncClient, name: str, body: bytes) -> str:
    assert (await c.put(S + name, headers=JSON)).status_code == 201
    r = await c.post(S + name, content=body, headers=JSON)
    assert r.status_code == 204, r.text
    return r.headers["stream-next-offset"]


async def test_a_stream_created_again_has_no_offsets_of_the_one_deleted(onceflow: InProcess) -> None:
    c = onceflow.client
    old_end = await _fill(c, "orders", b"[1,2,3,4,5]")
    other_end = await _fill(c, "refunds", b"[1]")
    r = await c.post("/v1/groups/billing/offsets", json={"offsets": {"orders": old_end, "refunds": other_end}})
    assert r.status_code == 200, r.text
    assert (await c.delete(S + "orders")).status_code == 204
    new_end = await _fill(c, "orders", b"[6]")  # created again: one message, at offset 0
    assert await _offsets(c, "billing") == {"refunds": other_end}  # nothing to skip the new message with
    # a consumer that starts from the beginning of the new stream commits its real offset: accepted
    r = await c.post("/v1/groups/billing/offsets", json={"offsets": {"orders": new_end}})
    assert r.status_code == 200, r.text
    assert await _offsets(c, "billing") == {"orders": new_end, "refunds": other_end}
    # a PUT that confirms an existing stream keeps its offsets
    assert (await c.put(S + "orders", headers=JSON)).status_code == 200
    assert await _offsets(c, "billing") == {"orders": new_end, "refunds": other_end}


async def test_the_dropped_offsets_stay_dropped_after_a_restart(onceflow: InProcess) -> None:
    c = onceflow.client
    old_end = await _fill(c, "s", b"[1,2,3]")
    assert (await c.post("/v1/groups/g/offsets", json={"offsets": {"s": old_end}})).status_code == 200
    assert (await c.delete(S + "s")).status_code == 204
    await _fill(c, "s", b"[9]")
    assert (await _groups_after_restart(onceflow)).get("g", {}) == {}


async def test_a_create_whose_offsets_could_not_be_dropped_creates_nothing(
    onceflow: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drop is stored before the create: when it cannot be (a full disk), the create is answered
    503 and nothing is created, and a retry once the disk has room does both."""
    c = onceflow.client
    old_end = await _fill(c, "s", b"[1,2,3]")
    assert (await c.post("/v1/groups/g/offsets", json={"offsets": {"s": old_end}})).status_code == 200
    assert (await c.delete(S + "s")).status_code == 204
    coord = onceflow.broker.coordinator
    forget = coord.forget_stream

    async def full_disk(stream: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(coord, "forget_stream", full_disk)
    r = await c.put(S + "s", headers=JSON)
    assert r.status_code == 503, r.text
    assert "could not be dropped" in r.json()["error"]["message"]
    assert (await c.head(S + "s")).status_code == 404
    assert await _offsets(c, "g") == {"s": old_end}
    monkeypatch.setattr(coord, "forget_stream", forget)
    assert (await c.put(S + "s", headers=JSON)).status_code == 201
    assert await _offsets(c, "g") == {}


async def _groups_after_restart(onceflow: InProcess) -> dict[str, dict[str, str]]:
    return await after_restart(onceflow, lambda b: {g: dict(o) for g, o in b.coordinator.groups.items()})


async def _commit_offsets_in_a_transaction(c: httpx.AsyncClient, end: str) -> None:
    t = Txn(c, "copier")
    await t.init()
    r = await c.post(T + "copier/offsets", json={"epoch": t.epoch, "group": "g", "offsets": {"s": end}})
    assert r.status_code == 200, r.text
    r = await c.post(T + "copier/commit", json={"epoch": t.epoch, "txn": r.json()["txn"]})
    assert r.status_code == 200, r.text


async def test_a_compaction_after_the_drop_does_not_bring_back_a_transactions_offsets(onceflow: InProcess) -> None:
    """A compaction writes each transactional id's last transaction, whose replay applies its
    offsets, then the groups' offsets, which can add but not remove: an offset committed in a
    transaction came back after a compaction and a restart (found by review)."""
    c = onceflow.client
    end = await _fill(c, "s", b"[1,2,3]")
    await _commit_offsets_in_a_transaction(c, end)
    assert (await c.delete(S + "s")).status_code == 204
    assert (await c.put(S + "s", headers=JSON)).status_code == 201
    coord = onceflow.broker.coordinator
    assert coord.groups["g"] == {}
    coord.compact_bytes = 0
    assert await coord.maybe_compact()
    assert (await _groups_after_restart(onceflow)).get("g", {}) == {}


async def test_offsets_pending_in_an_open_transaction_are_dropped_too(onceflow: InProcess) -> None:
    """A copier's transaction that holds offsets into the deleted stream and commits after the new
    one is created must not put them back: they are positions of the old stream."""
    c = onceflow.client
    end = await _fill(c, "s", b"[1,2,3]")
    t = Txn(c, "copier")
    await t.init()
    r = await c.post(T + "copier/offsets", json={"epoch": t.epoch, "group": "g", "offsets": {"s": end}})
    assert r.status_code == 200, r.text
    assert (await c.delete(S + "s")).status_code == 204
    assert (await c.put(S + "s", headers=JSON)).status_code == 201
    r = await c.post(T + "copier/commit", json={"epoch": t.epoch, "txn": r.json()["txn"]})
    assert r.status_code == 200, r.text
    assert onceflow.broker.coordinator.groups.get("g", {}) == {}
    assert (await _groups_after_restart(onceflow)).get("g", {}) == {}


async def test_a_commit_completed_while_the_drop_is_written_agrees_with_the_log(onceflow: InProcess) -> None:
    """A commit's completion changes memory when its record is staged. One staged after the drop's
    record but before that record was synced applied its offsets, then the drop removed them: memory
    had none, while the log (drop, then completion) replayed them (found by review)."""
    c = onceflow.client
    coord = onceflow.broker.coordinator
    assert (await c.put(S + "out", headers=JSON)).status_code == 201
    end = await _fill(c, "s", b"[1,2,3]")
    assert (await c.post("/v1/groups/g0/offsets", json={"offsets": {"s": end}})).status_code == 200
    t = Txn(c, "copier")
    await t.init()
    assert (await t.send("out", {"x": 1})).status_code in (200, 204)
    r = await c.post(T + "copier/offsets", json={"epoch": t.epoch, "group": "g", "offsets": {"s": end}})
    assert r.status_code == 200, r.text
    txn = r.json()["txn"]
    assert (await c.delete(S + "s")).status_code == 204
    gate = asyncio.Event()
    write_marker = coord.write_marker

    async def held_marker(*args: Any) -> None:
        await gate.wait()
        await write_marker(*args)

    coord.write_marker = held_marker  # type: ignore[method-assign]
    commit = asyncio.ensure_future(c.post(T + "copier/commit", json={"epoch": t.epoch, "txn": txn}))
    for _ in range(1000):  # the decision is durable; the markers wait
        if coord.txns["copier"].status is TxnStatus.PREPARE_COMMIT:
            break
        await asyncio.sleep(0.01)
    assert coord.txns["copier"].status is TxnStatus.PREPARE_COMMIT
    stage = coord._stage
    completion_staged = asyncio.Event()

    async def after_the_completion(done: asyncio.Future[None]) -> None:
        await done
        await completion_staged.wait()

    def release_the_marker_once_the_drop_is_staged(rec: dict[str, Any]) -> asyncio.Future[None]:
        """The drop's record counts as synced only once the completion is staged: the window."""
        done = stage(rec)
        if rec.get("kind") == "forget":
            gate.set()
            return asyncio.ensure_future(after_the_completion(done))
        if rec.get("tid") == "copier" and rec.get("status") == TxnStatus.COMPLETE_COMMIT.value:
            completion_staged.set()
        return done

    coord._stage = release_the_marker_once_the_drop_is_staged  # type: ignore[method-assign]
    assert (await c.put(S + "s", headers=JSON)).status_code == 201
    assert (await asyncio.wait_for(commit, 30)).status_code == 200
    in_memory = {g: dict(o) for g, o in coord.groups.items()}
    assert await _groups_after_restart(onceflow) == in_memory
    assert in_memory.get("g", {}) == {}


async def test_a_stream_that_expired_before_the_sweep_has_its_offsets_dropped(
    onceflow: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An expired stream stays in the broker until the sweep or the next request that looks it up
    removes it; a create in between found the name taken, dropped nothing, then created the new
    stream over the expired one with its offsets (found by review)."""
    c = onceflow.client
    assert (await c.put(S + "s", headers={**JSON, "stream-ttl": "60"})).status_code == 201
    r = await c.post(S + "s", content=b"[1,2,3]", headers=JSON)
    end = r.headers["stream-next-offset"]
    assert (await c.post("/v1/groups/g/offsets", json={"offsets": {"s": end}})).status_code == 200
    clock = onceflow.broker.streams["s"].clock
    later = clock.monotonic() + 120
    monkeypatch.setattr(clock, "monotonic", lambda: later)
    assert (await c.put(S + "s", headers=JSON)).status_code == 201
    assert await _offsets(c, "g") == {}


async def test_an_offsets_commit_written_just_before_the_drop_is_dropped_in_memory_too(onceflow: InProcess) -> None:
    """A plain offsets commit changes memory once its record is durable. One staged just before the
    drop's record, and so replayed before it, became durable only after the drop had changed memory:
    the drop must be applied again once its own record is durable, or memory keeps what the log
    drops."""
    c = onceflow.client
    coord = onceflow.broker.coordinator
    end = await _fill(c, "s", b"[1,2,3]")
    assert (await c.post("/v1/groups/g0/offsets", json={"offsets": {"s": end}})).status_code == 200
    assert (await c.delete(S + "s")).status_code == 204
    stage = coord._stage
    drop_staged = asyncio.Event()

    async def after_the_drop(done: asyncio.Future[None]) -> None:
        await done
        await drop_staged.wait()

    def hold_the_commit_until_the_drop_is_staged(rec: dict[str, Any]) -> asyncio.Future[None]:
        done = stage(rec)
        if rec.get("kind") == "offsets" and rec.get("group") == "g":
            return asyncio.ensure_future(after_the_drop(done))
        if rec.get("kind") == "forget":
            drop_staged.set()
        return done

    coord._stage = hold_the_commit_until_the_drop_is_staged  # type: ignore[method-assign]
    late = asyncio.ensure_future(_answered(coord.commit_offsets("g", {"s": end})))
    for _ in range(1000):  # its record is staged (and waits)
        if coord._awaiting:
            break
        await asyncio.sleep(0.01)
    assert (await c.put(S + "s", headers=JSON)).status_code == 201
    assert await asyncio.wait_for(late, 30) == 200
    in_memory = {g: dict(o) for g, o in coord.groups.items()}
    assert await _groups_after_restart(onceflow) == in_memory
    assert in_memory.get("g", {}) == {}


def _fail_the_coordinators_next_write(coord: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator log's next write fails once (a full disk); the log rolls it back."""
    failing = [coord.log._segments[-1].file]
    write_all = storage_log._write_all

    def write(f: Any, data: bytes, at: int, sync: bool) -> float | None:
        if any(f is x for x in failing):
            failing.clear()
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_all(f, data, at, sync)

    monkeypatch.setattr(storage_log, "_write_all", write)


async def test_a_drop_whose_record_failed_is_written_again_by_the_next_create(
    onceflow: InProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drop changes memory when its record is staged. When the record then fails, memory no
    longer shows the offsets although the disk still has them: a retried create found nothing to
    drop, created the stream, and a restart brought the old offsets back onto it (found by review).
    A second create while the record is in flight waits for it and shares its outcome."""
    c = onceflow.client
    coord = onceflow.broker.coordinator
    end = await _fill(c, "s", b"[1,2,3]")
    assert (await c.post("/v1/groups/g/offsets", json={"offsets": {"s": end}})).status_code == 200
    assert (await c.delete(S + "s")).status_code == 204
    _fail_the_coordinators_next_write(coord, monkeypatch)
    stage = coord._stage
    gate, staged = asyncio.Event(), asyncio.Event()

    async def held(done: asyncio.Future[None]) -> None:
        await gate.wait()
        await done

    def hold_the_drop(rec: dict[str, Any]) -> asyncio.Future[None]:
        done = stage(rec)
        if rec.get("kind") == "forget":
            staged.set()
            return asyncio.ensure_future(held(done))
        return done

    coord._stage = hold_the_drop  # type: ignore[method-assign]
    calls: list[str] = []
    forget_stream = coord.forget_stream

    async def counted(stream: str) -> None:
        calls.append(stream)
        await forget_stream(stream)

    coord.forget_stream = counted  # type: ignore[method-assign]
    first = asyncio.ensure_future(c.put(S + "s", headers=JSON))
    await asyncio.wait_for(staged.wait(), 30)
    second = asyncio.ensure_future(c.put(S + "s", headers=JSON))
    for _ in range(1000):  # the second create has reached the drop (and waits on it)
        if len(calls) == 2:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # room to create the stream, had it not waited
    assert not second.done()  # it did not create the stream while the record was in flight
    gate.set()
    assert [(await asyncio.wait_for(r, 30)).status_code for r in (first, second)] == [503, 503]
    assert (await c.head(S + "s")).status_code == 404
    coord._stage = stage  # type: ignore[method-assign]
    assert (await c.put(S + "s", headers=JSON)).status_code == 201  # the disk has room again
    in_memory = {g: dict(o) for g, o in coord.groups.items()}
    assert in_memory.get("g", {}) == {}
    assert await _groups_after_restart(onceflow) == in_memory


async def test_an_offsets_commit_in_flight_when_the_create_looks_is_dropped(onceflow: InProcess) -> None:
    """An offsets commit into the deleted stream, sent before the create and not yet durable when the
    create looked for offsets to drop: it found none, wrote no drop, and the commit then landed on
    the new stream (found by review)."""
    c = onceflow.client
    coord = onceflow.broker.coordinator
    end = await _fill(c, "s", b"[1,2,3]")
    assert (await c.delete(S + "s")).status_code == 204
    stage = coord._stage
    gate, staged = asyncio.Event(), asyncio.Event()

    async def held(done: asyncio.Future[None]) -> None:
        await done
        await gate.wait()

    def hold_the_commit(rec: dict[str, Any]) -> asyncio.Future[None]:
        done = stage(rec)
        if rec.get("kind") == "offsets":
            staged.set()
            return asyncio.ensure_future(held(done))
        if rec.get("kind") == "forget":
            gate.set()
        return done

    coord._stage = hold_the_commit  # type: ignore[method-assign]
    early = asyncio.ensure_future(_answered(coord.commit_offsets("g", {"s": end})))
    await asyncio.wait_for(staged.wait(), 30)
    gate_was_needed = not gate.is_set()
    assert (await c.put(S + "s", headers=JSON)).status_code == 201
    assert gate_was_needed and gate.is_set()  # a drop was written
    assert await asyncio.wait_for(early, 30) == 200
    assert coord.groups.get("g", {}) == {}
    assert (await _groups_after_restart(onceflow)).get("g", {}) == {}


async def test_a_transactions_offsets_built_before_the_drop_and_stored_after_it_are_dropped(
    onceflow: InProcess,
) -> None:
    """A transaction's offsets request builds its new offsets, stages its record, and takes them
    into memory once that record is durable. Staged before the drop and durable after the drop was
    staged, it put the old stream's offset back into memory, and the id's next record (staged
    after the drop) wrote it to the log again: a restart and a commit applied it to the new stream
    (found by review)."""
    c = onceflow.client
    coord = onceflow.broker.coordinator
    for name in ("out", "out2"):
        assert (await c.put(S + name, headers=JSON)).status_code == 201
    end = await _fill(c, "s", b"[1,2,3]")
    assert (await c.post("/v1/groups/g0/offsets", json={"offsets": {"s": end}})).status_code == 200
    t = Txn(c, "copier")
    await t.init()
    assert (await t.send("out", {"x": 1})).status_code in (200, 204)
    assert (await c.delete(S + "s")).status_code == 204
    stage = coord._stage
    drop_staged, next_staged, offsets_staged = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def after(done: asyncio.Future[None], event: asyncio.Event) -> None:
        await done
        await event.wait()

    def interleave(rec: dict[str, Any]) -> asyncio.Future[None]:
        done = stage(rec)
        if rec.get("tid") == "copier" and "g" in rec.get("offsets", {}) and not offsets_staged.is_set():
            offsets_staged.set()  # the offsets record: durable only once the drop is staged
            return asyncio.ensure_future(after(done, drop_staged))
        if rec.get("kind") == "forget":
            drop_staged.set()  # durable only once the id's next record is staged
            return asyncio.ensure_future(after(done, next_staged))
        if rec.get("tid") == "copier" and "out2" in rec.get("streams", ()):
            next_staged.set()
        return done

    coord._stage = interleave  # type: ignore[method-assign]
    offsets = asyncio.ensure_future(_answered(coord.add_offsets("copier", t.epoch, "g", {"s": end})))
    await asyncio.wait_for(offsets_staged.wait(), 30)
    put = asyncio.ensure_future(c.put(S + "s", headers=JSON))
    assert await asyncio.wait_for(offsets, 30) == 200
    assert (await t.send("out2", {"y": 1})).status_code in (200, 204)
    assert (await asyncio.wait_for(put, 30)).status_code == 201
    assert coord.txns["copier"].offsets == {"g": {}}
    onceflow.broker.begin_shutdown()
    await onceflow.broker.close()
    again = onceflow.reopen()
    again.open()
    await again.start()
    try:
        assert again.coordinator.txns["copier"].offsets == {"g": {}}
        meta = again.coordinator.txns["copier"]
        await again.coordinator.end("copier", meta.epoch, meta.txn, commit=True)
        assert again.coordinator.groups.get("g", {}) == {}
    finally:
        again.begin_shutdown()
        await again.close()


async def test_what_the_coordinator_remembers_of_drops_does_not_grow_with_them(onceflow: InProcess) -> None:
    """Each drop was remembered for good (for transactions' offsets stored across one), so a
    server that deleted and created streams again for ever grew without bound (found by review)."""
    c = onceflow.client
    coord = onceflow.broker.coordinator
    assert (await c.put(S + "s", headers=JSON)).status_code == 201
    for _ in range(20):
        end = (await c.post(S + "s", content=b"[1]", headers=JSON)).headers["stream-next-offset"]
        r = await c.post("/v1/groups/g/offsets", json={"offsets": {"s": end}, "reset": True})
        assert r.status_code == 200, r.text
        assert (await c.delete(S + "s")).status_code == 204
        assert (await c.put(S + "s", headers=JSON)).status_code == 201
        assert await _offsets(c, "g") == {}
    assert len(coord._forgotten) <= 1
