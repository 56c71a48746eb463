"""Processors: Cues-style exactly-once stream processors, sinks and sources (seed 000); the
watermark-acknowledged pipeline and parallel consumer (seed 001); kill -9 of a running pipeline."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.servers import InProcess, ServerProcess
from onceflow.client import AsyncStream, Message, OnceflowError, TransportError
from onceflow.processors import (
    AsyncSinkProcessor,
    AsyncSource,
    AsyncStreamProcessor,
    Batch,
    Output,
    ParallelConsumer,
    Pipeline,
    ProcessorError,
    ProcessorFencedError,
    SinkProcessor,
    Source,
    Step,
    StreamProcessor,
    snapshot_hash,
)

URL = "http://testserver"


class Crash(Exception):
    """Stands for the process dying at a chosen point (not an OnceflowError: nothing recovers it)."""


async def make(of: InProcess, *names: str, content_type: str = "application/json") -> None:
    for n in names:
        await AsyncStream.connect(URL, n, client=of.client).create(content_type)


async def fill(of: InProcess, name: str, values: list[Any], per_append: int = 1) -> None:
    s = AsyncStream.connect(URL, name, client=of.client)
    for i in range(0, len(values), per_append):
        await s.append_many(values[i : i + per_append])


async def read_all(of: InProcess, name: str) -> list[Any]:
    out: list[Any] = []
    async for chunk in AsyncStream.connect(URL, name, client=of.client).chunks("-1"):
        out += chunk.messages()
    return out


async def values_of(of: InProcess, name: str) -> list[Any]:
    return [m["value"] for m in await read_all(of, name)]


def fail_append(proc: Any, stream: str, nth: int, *, after: bool, exc: BaseException | None = None) -> None:
    """Make the processor's ``nth`` conditional append to ``stream`` fail: before it reaches the
    server, or after it was stored (the answer lost). ``exc`` defaults to a crash."""
    http = proc._http
    real = http.append
    calls = 0

    async def append(name: str, body: bytes, if_match: str) -> str:
        nonlocal calls
        if name == stream:
            calls += 1
            if calls == nth:
                if after:
                    await real(name, body, if_match)
                raise exc if exc is not None else Crash(f"crash at append {nth} to {stream}")
        result: str = await real(name, body, if_match)
        return result

    http.append = append


def upper(batch: Batch) -> list[Any]:
    return [{"from": r.stream, "v": str(r.value).upper()} for r in batch.records]


def processor(of: InProcess, fn: Callable[[Batch], Any] = upper, **kw: Any) -> AsyncStreamProcessor:
    args: dict[str, Any] = {
        "inputs": ["in/a", "in/b"],
        "output": "out",
        "fn": fn,
        "client": of.client,
        "max_read_bytes": 1,
    }
    args.update(kw)
    return AsyncStreamProcessor(URL, args.pop("processor_id", "up"), **args)


# ---------------------------------------------------------------- stream processors


@pytest.mark.anyio
async def test_stream_processor_reads_many_inputs_and_writes_each_output_once_with_its_hash(
    onceflow: InProcess,
) -> None:
    await make(onceflow, "in/a", "in/b")
    await fill(onceflow, "in/a", ["a1", "a2", "a3"])
    await fill(onceflow, "in/b", ["b1", "b2"])
    seen: list[Batch] = []

    def fn(batch: Batch) -> list[Any]:
        seen.append(batch)
        return upper(batch)

    async with processor(onceflow, fn) as p:
        assert p.recovery is not None and p.recovery.outcome == "fresh"
        assert await p.run() == 3
    out = await read_all(onceflow, "out")
    assert sorted(m["value"]["v"] for m in out) == ["A1", "A2", "A3", "B1", "B2"]
    assert [m["value"]["v"] for m in out if m["value"]["from"] == "in/a"] == ["A1", "A2", "A3"]  # input order kept
    hashes = {b.hash for b in seen}
    assert len(hashes) == 3  # a distinct hash per step
    for b in seen:
        assert b.hash == snapshot_hash("up", b.snapshot.ranges)
        assert {m["meta"]["hash"] for m in out if m["value"]["v"] in {str(v).upper() for v in b.values}} == {b.hash}
    # a second run has nothing left to do, and a restart resumes after the last step
    async with processor(onceflow) as again:
        assert again.recovery is not None and again.recovery.outcome == "resumed"
        assert await again.run() == 0
    assert len(await read_all(onceflow, "out")) == 5


@pytest.mark.anyio
async def test_a_downstream_processor_gets_values_and_metadata_apart(onceflow: InProcess) -> None:
    await make(onceflow, "in/a", "in/b")
    await fill(onceflow, "in/a", ["x", "y"])
    async with processor(onceflow) as p:
        await p.run()
    got: list[Any] = []

    def second(batch: Batch) -> list[Any]:
        got.extend((r.value, dict(r.meta or {})) for r in batch.records)
        return [r.value["v"] + "!" for r in batch.records]

    async with AsyncStreamProcessor(
        URL, "bang", inputs=["out"], output="out2", fn=second, client=onceflow.client
    ) as p2:
        await p2.run()
    assert [v for v, _ in got] == [{"from": "in/a", "v": "X"}, {"from": "in/a", "v": "Y"}]
    assert all(meta["processor"] == "up" and len(meta["hash"]) == 32 for _, meta in got)
    assert await values_of(onceflow, "out2") == ["X!", "Y!"]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("stream", "nth", "after", "outcome"),
    [
        ("_cues/up", 2, False, "reset"),  # the snapshot of step 1 never written: nothing recorded yet
        ("_cues/up", 2, True, "reset"),  # snapshot written, crash before the function ran
        ("_cues/up", 3, True, "reset"),  # attempt written, crash before the output
        ("out", 1, False, "reset"),  # the output write itself never reached the server
        ("out", 1, True, "resumed"),  # output written, crash before the answer
    ],
)
async def test_crash_at_each_point_of_a_step_then_restart_gives_output_exactly_once(
    onceflow: InProcess, stream: str, nth: int, after: bool, outcome: str
) -> None:
    """Appends to the backing stream: 1 = the claim, 2 = step 1's snapshot, 3 = its attempt."""
    await make(onceflow, "in/a", "in/b")
    await fill(onceflow, "in/a", ["a1", "a2"])
    await fill(onceflow, "in/b", ["b1"])
    p = processor(onceflow)
    fail_append(p, stream, nth, after=after)
    await p.start()
    with pytest.raises(Crash):
        await p.run()
    if stream == "_cues/up" and nth == 2 and not after:
        outcome = "fresh"  # nothing of step 1 reached the backing stream
    calls: list[bool] = []

    def fn(batch: Batch) -> list[Any]:
        calls.append(batch.redelivery)
        return upper(batch)

    async with processor(onceflow, fn) as q:
        assert q.recovery is not None and q.recovery.outcome == outcome
        await q.run()
    assert sorted(v["v"] for v in await values_of(onceflow, "out")) == ["A1", "A2", "B1"]
    assert calls[0] is (outcome == "reset")  # a reset processes the recorded range again, as a redelivery


@pytest.mark.anyio
async def test_a_redelivered_range_is_the_same_range_with_the_same_hash(onceflow: InProcess) -> None:
    await make(onceflow, "in/a", "in/b")
    await fill(onceflow, "in/a", ["a1", "a2", "a3"], per_append=3)
    first: list[Batch] = []

    def boom(batch: Batch) -> list[Any]:
        first.append(batch)
        raise Crash("the function died")

    p = processor(onceflow, boom, max_read_bytes=1 << 16)
    await p.start()
    with pytest.raises(Crash):
        await p.step()
    await fill(onceflow, "in/a", ["a4"])  # more data arrived: the redelivery must not include it
    again: list[Batch] = []

    def keep(batch: Batch) -> list[Any]:
        again.append(batch)
        return upper(batch)

    async with processor(onceflow, keep, max_read_bytes=1 << 16) as q:
        assert q.recovery is not None and q.recovery.outcome == "reset"
        await q.run()
    assert again[0].redelivery and again[0].hash == first[0].hash and again[0].values == ["a1", "a2", "a3"]
    assert [v["v"] for v in await values_of(onceflow, "out")] == ["A1", "A2", "A3", "A4"]


@pytest.mark.anyio
async def test_a_lost_answer_is_recovered_in_process_without_a_duplicate(onceflow: InProcess) -> None:
    await make(onceflow, "in/a", "in/b")
    await fill(onceflow, "in/a", ["a1", "a2"])
    p = processor(onceflow)
    fail_append(p, "out", 1, after=True, exc=TransportError("connection reset"))
    async with p:
        first = await p.step()
        assert first is not None and first.recovery is not None and first.recovery.outcome == "resumed"
        await p.run()
    assert [v["v"] for v in await values_of(onceflow, "out")] == ["A1", "A2"]


@pytest.mark.anyio
async def test_an_unsent_write_is_recovered_in_process_and_redone(onceflow: InProcess) -> None:
    await make(onceflow, "in/a", "in/b")
    await fill(onceflow, "in/a", ["a1", "a2"])
    p = processor(onceflow)
    fail_append(p, "out", 1, after=False, exc=TransportError("connection refused"))
    async with p:
        first = await p.step()
        assert first is not None and first.recovery is not None and first.recovery.outcome == "reset"
        await p.run()
    assert [v["v"] for v in await values_of(onceflow, "out")] == ["A1", "A2"]


@pytest.mark.anyio
async def test_a_nil_attempt_is_a_finished_step(onceflow: InProcess) -> None:
    await make(onceflow, "in/a", "in/b")
    await fill(onceflow, "in/a", ["drop", "keep"])
    calls: list[Any] = []

    def only_keep(batch: Batch) -> list[Any] | None:
        calls.append(batch.values)
        return [v for v in batch.values if v == "keep"] or None

    p = processor(onceflow, only_keep)
    fail_append(p, "_cues/up", 3, after=True)  # the nil-attempt of step 1 is stored, then the crash
    await p.start()
    with pytest.raises(Crash):
        await p.run()
    async with processor(onceflow, only_keep) as q:
        assert q.recovery is not None and q.recovery.outcome == "resumed"
        await q.run()
    assert calls == [["drop"], ["keep"]]  # "drop" was not processed again
    assert await values_of(onceflow, "out") == ["keep"]


@pytest.mark.anyio
async def test_a_zombie_is_fenced_and_its_late_write_is_not_duplicated(onceflow: InProcess) -> None:
    await make(onceflow, "in/a", "in/b")
    await fill(onceflow, "in/a", ["a1", "a2"])
    zombie = processor(onceflow)
    await zombie.start()
    # the zombie gets as far as its attempt for step 1, then stalls before writing the output
    gate = asyncio.Event()
    real = zombie._http.append

    async def stall(name: str, body: bytes, if_match: str) -> str:
        if name == "out":
            await gate.wait()
        return await real(name, body, if_match)

    zombie._http.append = stall  # type: ignore[method-assign]
    zombie_step = asyncio.ensure_future(zombie.step())
    while zombie._backing_tail == "" or not zombie._pinned:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    # a new instance claims, finds the attempt without output, and redoes the range
    fresh = processor(onceflow)
    rec = await fresh.start()
    assert rec.outcome == "reset" and rec.epoch == zombie.epoch + 1
    gate.set()  # the zombie's output write lands first, at the index both recorded
    with pytest.raises(ProcessorFencedError):
        await zombie_step  # ... it succeeds, but its next write finds the newer claim
        await zombie.step()
    await fresh.run()  # its own write of the same range fails, and recovery finds the hash there
    assert [v["v"] for v in await values_of(onceflow, "out")] == ["A1", "A2"]
    await zombie.close()
    await fresh.close()


@pytest.mark.anyio
async def test_a_live_processor_picks_up_new_input_and_stops_when_told(onceflow: InProcess) -> None:
    await make(onceflow, "in/a", "in/b")
    stop = asyncio.Event()
    p = processor(onceflow, poll_interval=0.2)
    task = asyncio.ensure_future(p.run(live=True, stop=stop))
    await asyncio.sleep(0.3)  # idle, tailing both inputs
    await fill(onceflow, "in/b", ["late"])

    async def arrived() -> bool:
        return len(await read_all(onceflow, "out")) == 1

    await wait_for(arrived)
    stop.set()
    assert await asyncio.wait_for(task, 5) == 1
    await p.close()
    assert [v["v"] for v in await values_of(onceflow, "out")] == ["LATE"]


@pytest.mark.anyio
async def test_processor_restarts_from_the_scan_hint(onceflow: InProcess) -> None:
    await make(onceflow, "in/a", "in/b")
    await fill(onceflow, "in/a", [f"m{i}" for i in range(7)])
    async with processor(onceflow, hint_every=2) as p:
        await p.run()
    r = await onceflow.client.get(f"{URL}/v1/groups/cues.up/offsets")
    hint = r.json()["offsets"]["_cues/up"]
    assert hint > "0000000000000000_0000000000000000"
    await fill(onceflow, "in/a", ["late"])
    q = processor(onceflow, hint_every=2)
    backing_reads: list[str] = []
    real_read = q._http.read

    async def read(name: str, offset: str, max_bytes: int | None = None) -> Any:
        if name == "_cues/up":
            backing_reads.append(offset)
        return await real_read(name, offset, max_bytes)

    q._http.read = read  # type: ignore[method-assign]
    async with q:
        assert q.recovery is not None and q.recovery.outcome == "resumed"
        await q.run()
    assert backing_reads[0] == hint  # the scan started at the hint, not at the beginning
    assert [v["v"] for v in await values_of(onceflow, "out")] == [f"M{i}" for i in range(7)] + ["LATE"]


@pytest.mark.anyio
async def test_processor_misuse_gives_clear_errors(onceflow: InProcess) -> None:
    await make(onceflow, "in/a", "in/b")
    await make(onceflow, "bytes-out", content_type="text/plain")
    await fill(onceflow, "in/a", ["a"])
    with pytest.raises(ValueError, match="non-empty list"):
        AsyncStreamProcessor(URL, "x", inputs="in/a", output="o", fn=upper)
    with pytest.raises(ValueError, match="distinct"):
        AsyncStreamProcessor(URL, "x", inputs=["in/a", "in/a"], output="o", fn=upper)
    with pytest.raises(ValueError, match="cannot also be an input"):
        AsyncStreamProcessor(URL, "x", inputs=["in/a"], output="in/a", fn=upper)
    with pytest.raises(TypeError, match="callable"):
        AsyncStreamProcessor(URL, "x", inputs=["in/a"], output="o", fn="upper")  # type: ignore[arg-type]
    p = processor(onceflow)
    with pytest.raises(ProcessorError, match="start"):
        await p.step()
    await p.close()
    with pytest.raises(ProcessorError, match="application/json"):
        await processor(onceflow, output="bytes-out").start()
    bad = processor(onceflow, lambda b: {"one": "dict"})
    await bad.start()
    with pytest.raises(TypeError, match="iterable of output values"):
        await bad.step()
    unserialisable = processor(onceflow, lambda b: [object()])
    await unserialisable.start()
    with pytest.raises(TypeError, match="JSON-serialisable"):
        await unserialisable.step()


def test_blocking_stream_processor(server: ServerProcess) -> None:
    with httpx.Client() as c:
        for n in ("b/in", "b/out"):
            c.put(f"{server.url}/v1/stream/{n}", headers={"content-type": "application/json"}).raise_for_status()
        c.post(
            f"{server.url}/v1/stream/b/in", content=b"[1,2,3]", headers={"content-type": "application/json"}
        ).raise_for_status()
    with StreamProcessor(
        server.url, "double", inputs=["b/in"], output="b/out", fn=lambda b: [v * 2 for v in b.values]
    ) as p:
        assert p.run() == 1
        assert p.epoch == 1
    with httpx.Client() as c:
        out = c.get(f"{server.url}/v1/stream/b/out", params={"offset": "-1"}).json()
    assert [m["value"] for m in out] == [2, 4, 6]


# ---------------------------------------------------------------- sinks and sources


@pytest.mark.anyio
async def test_sink_is_at_least_once_with_a_stable_hash_for_idempotency(onceflow: InProcess) -> None:
    await make(onceflow, "in/a", "in/b")
    await fill(onceflow, "in/a", ["a1", "a2", "a3"])
    table: dict[str, list[Any]] = {}  # the target: keyed by the batch hash, so a redelivery overwrites
    deliveries: list[tuple[str, bool]] = []

    def write(batch: Batch) -> None:
        deliveries.append((batch.hash, batch.redelivery))
        table[batch.hash] = batch.values

    sink = AsyncSinkProcessor(URL, "table", inputs=["in/a", "in/b"], fn=write, client=onceflow.client, max_read_bytes=1)
    fail_append(sink, "_cues/table", 3, after=False)  # step 1's completion never recorded
    await sink.start()
    with pytest.raises(Crash):
        await sink.run()
    async with AsyncSinkProcessor(
        URL, "table", inputs=["in/a", "in/b"], fn=write, client=onceflow.client, max_read_bytes=1
    ) as again:
        assert again.recovery is not None and again.recovery.outcome == "reset"
        await again.run()
    assert deliveries[0] == (deliveries[1][0], False) and deliveries[1][1] is True  # at least once, same hash
    assert len(deliveries) == 4
    assert sorted(v for vals in table.values() for v in vals) == ["a1", "a2", "a3"]


def test_blocking_sink(server: ServerProcess) -> None:
    with httpx.Client() as c:
        c.put(f"{server.url}/v1/stream/s/in", headers={"content-type": "application/json"}).raise_for_status()
        c.post(
            f"{server.url}/v1/stream/s/in", content=b'["x","y"]', headers={"content-type": "application/json"}
        ).raise_for_status()
    got: list[Any] = []
    with SinkProcessor(server.url, "s", inputs=["s/in"], fn=lambda b: got.extend(b.values)) as sink:
        assert sink.run() == 1
    assert got == ["x", "y"]


@pytest.mark.anyio
async def test_source_resumes_from_the_last_position_it_wrote(onceflow: InProcess) -> None:
    origin = [f"line {i}" for i in range(10)]

    async def feed(crash_after: int | None) -> None:
        async with AsyncSource(URL, "lines", "src", client=onceflow.client, hint_every=2) as src:
            pos = src.position
            i = 0 if pos is None else pos + 1
            while i < len(origin):
                chunk = origin[i : i + 3]
                await src.emit(chunk, i + len(chunk) - 1)
                i += len(chunk)
                if crash_after is not None and i >= crash_after:
                    return

    await feed(crash_after=4)
    await feed(crash_after=None)
    out = await read_all(onceflow, "src")
    assert [m["value"] for m in out] == origin
    assert all(m["meta"]["source"] == "lines" for m in out)


@pytest.mark.anyio
async def test_source_lost_answer_is_not_a_duplicate_and_a_second_writer_fences(onceflow: InProcess) -> None:
    src = AsyncSource(URL, "feed", "src", client=onceflow.client)
    await src.start()
    fail_append(src, "src", 1, after=True, exc=TransportError("reset"))
    await src.emit(["a"], 1)
    await src.emit(["b"], 2)
    assert await values_of(onceflow, "src") == ["a", "b"]
    await AsyncStream.connect(URL, "src", client=onceflow.client).append({"meta": {}, "value": "intruder"})
    with pytest.raises(ProcessorFencedError):
        await src.emit(["c"], 3)
    with pytest.raises(ValueError, match="at least one"):
        await src.emit([], 4)
    await src.close()


def test_blocking_source(server: ServerProcess) -> None:
    with Source(server.url, "s1", "src") as s:
        assert s.position is None
        s.emit([{"n": 1}], {"file": "a", "line": 1})
    with Source(server.url, "s1", "src") as s:
        assert s.position == {"file": "a", "line": 1}


# ---------------------------------------------------------------- parallel consumer and pipelines


async def group_offsets(of: InProcess, group: str) -> dict[str, str]:
    r = await of.client.get(f"{URL}/v1/groups/{group}/offsets")
    offsets: dict[str, str] = r.json()["offsets"]
    return offsets


async def chunk_ends(of: InProcess, name: str) -> list[str]:
    """The offsets after each batch of ``name`` (one message per append here)."""
    ends: list[str] = []
    offset = "-1"
    while True:
        r = await of.client.get(f"{URL}/v1/stream/{name}", params={"offset": offset, "max_bytes": "1"})
        if r.headers["stream-next-offset"] == offset:
            return ends
        offset = r.headers["stream-next-offset"]
        ends.append(offset)
        if r.headers.get("stream-up-to-date") == "true":
            return ends


async def wait_for(cond: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.mark.anyio
@pytest.mark.parametrize("delivery", ["at-least-once", "exactly-once"])
async def test_parallel_consumer_commits_only_below_an_unfinished_message(onceflow: InProcess, delivery: str) -> None:
    await make(onceflow, "pc/in", "pc/out")
    await fill(onceflow, "pc/in", list(range(20)))  # one message per batch: one per read
    ends = await chunk_ends(onceflow, "pc/in")
    release = asyncio.Event()
    finished: list[int] = []

    async def handle(msg: Message) -> list[Any]:
        if msg.value == 5:
            await release.wait()  # message 5 is slow; the others finish around it
        else:
            await asyncio.sleep(random.random() * 0.01)
        finished.append(msg.value)
        return [msg.value * 10]

    kw: dict[str, Any] = {"transactional_id": "pc-1"} if delivery == "exactly-once" else {}
    pc = ParallelConsumer(
        URL,
        group="pc",
        streams=["pc/in"],
        handler=handle,
        concurrency=4,
        delivery=delivery,  # type: ignore[arg-type]
        output="pc/out",
        client=onceflow.client,
        max_read_bytes=1,
        commit_interval=0.02,
        **kw,
    )
    run = asyncio.ensure_future(pc.run())

    async def others_done() -> bool:
        return len(finished) == 19

    await wait_for(others_done)
    assert finished != sorted(finished)  # completed out of order
    await asyncio.sleep(0.1)  # several commit rounds
    committed = (await group_offsets(onceflow, "pc")).get("pc/in")
    assert committed is None or committed <= ends[4]  # never past message 5 (the 6th)
    if delivery == "exactly-once":  # visible outputs are those of exactly the committed messages
        below = 0 if committed is None else ends.index(committed) + 1
        assert sorted(await read_all(onceflow, "pc/out")) == [v * 10 for v in range(below)]
    release.set()
    stats = await run
    assert (await group_offsets(onceflow, "pc"))["pc/in"] == ends[-1]
    out = await read_all(onceflow, "pc/out")
    assert sorted(out) == [v * 10 for v in range(20)]
    if delivery == "exactly-once":
        assert out == [v * 10 for v in range(20)]  # a transaction writes in input order
    assert stats.consumed == 20 and stats.outputs == 20


@pytest.mark.anyio
async def test_parallel_consumer_exactly_once_survives_a_crash_mid_run(onceflow: InProcess) -> None:
    await make(onceflow, "eo/in", "eo/out")
    await fill(onceflow, "eo/in", list(range(200)), per_append=4)

    async def slow(msg: Message) -> list[Any]:
        await asyncio.sleep(0.01)
        return [{"n": msg.value}]

    def consumer() -> ParallelConsumer:
        return ParallelConsumer(
            URL,
            group="eo",
            streams=["eo/in"],
            handler=slow,
            concurrency=4,
            delivery="exactly-once",
            transactional_id="eo-1",
            output="eo/out",
            client=onceflow.client,
            max_read_bytes=64,
            commit_interval=0.01,
        )

    first = consumer()
    task = asyncio.ensure_future(first.run())

    async def some_committed() -> bool:
        return first.stats.commits >= 3

    await wait_for(some_committed)
    assert not task.done()
    task.cancel()  # the process dies: staged outputs and an open transaction are lost
    with pytest.raises(asyncio.CancelledError):
        await task
    assert 0 < len(await read_all(onceflow, "eo/out")) < 200
    await consumer().run()  # init fences the old instance and aborts what it left open
    out = [m["n"] for m in await read_all(onceflow, "eo/out")]
    assert sorted(out) == list(range(200)) and out == list(range(200))


@pytest.mark.anyio
async def test_pipeline_fan_out_filter_and_keyed_workers(onceflow: InProcess) -> None:
    await make(onceflow, "p/in1", "p/in2", "p/out", "p/odd")
    await fill(onceflow, "p/in1", list(range(0, 60)), per_append=5)
    await fill(onceflow, "p/in2", list(range(100, 130)), per_append=3)
    seen_by: dict[int, set[str]] = {}

    async def split(msg: Message) -> list[Any]:
        if msg.value % 10 == 9:
            return []  # filtered
        await asyncio.sleep(random.random() * 0.002)
        return [{"n": msg.value, "part": k} for k in range(3)]  # fan-out: 1 to 3

    def finish(value: dict[str, Any]) -> list[Any]:
        return [Output("p/odd", value) if value["n"] % 2 else value]

    async def b(value: dict[str, Any]) -> list[Any]:
        await asyncio.sleep(random.random() * 0.002)
        seen_by.setdefault(value["n"], set()).add(value["part"])
        return finish(value)

    pipe = Pipeline(
        URL,
        group="p",
        inputs=["p/in1", "p/in2"],
        transactional_id="p-1",
        output="p/out",
        steps=[Step("A", split, workers=3), Step("B", b, workers=2, key=lambda v: v["n"])],
        client=onceflow.client,
        max_read_bytes=256,
        commit_interval=0.01,
    )
    stats = await pipe.run()
    expected = [n for n in [*range(60), *range(100, 130)] if n % 10 != 9]
    got = await read_all(onceflow, "p/out") + await read_all(onceflow, "p/odd")
    assert Counter((v["n"], v["part"]) for v in got) == Counter((n, k) for n in expected for k in range(3))
    assert all(v["n"] % 2 == 0 for v in await read_all(onceflow, "p/out"))
    assert stats.filtered == 9 and stats.consumed == 90 and stats.outputs == 3 * len(expected)
    offsets = await group_offsets(onceflow, "p")
    assert set(offsets) == {"p/in1", "p/in2"}


@pytest.mark.anyio
async def test_pipeline_step_failure_stops_the_run_and_commits_nothing_past_it(onceflow: InProcess) -> None:
    await make(onceflow, "f/in", "f/out")
    await fill(onceflow, "f/in", list(range(10)))

    def fragile(msg: Message) -> list[Any]:
        if msg.value == 3:
            raise RuntimeError("bad record")
        return [msg.value]

    pipe = Pipeline(
        URL,
        group="f",
        inputs=["f/in"],
        steps=[Step("A", fragile)],
        delivery="at-least-once",
        output="f/out",
        client=onceflow.client,
        max_read_bytes=1,
        commit_interval=0.01,
    )
    with pytest.raises(RuntimeError, match="bad record"):
        await pipe.run()
    committed = (await group_offsets(onceflow, "f")).get("f/in")
    assert committed is None or committed <= (await chunk_ends(onceflow, "f/in"))[2]


def test_pipeline_misuse_gives_clear_errors() -> None:
    step = Step("A", lambda m: [m])
    with pytest.raises(ValueError, match="transactional_id"):
        Pipeline(URL, group="g", inputs=["i"], steps=[step])
    with pytest.raises(ValueError, match="at least one step"):
        Pipeline(URL, group="g", inputs=["i"], steps=[], delivery="at-least-once")
    with pytest.raises(ValueError, match="distinct"):
        Pipeline(URL, group="g", inputs=["i"], steps=[step, step], delivery="at-least-once")
    with pytest.raises(ValueError, match="workers"):
        Step("A", lambda m: [m], workers=0)
    with pytest.raises(ValueError, match="delivery"):
        Pipeline(URL, group="g", inputs=["i"], steps=[step], delivery="exactly-twice")  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_pipeline_without_a_default_output_refuses_plain_values(onceflow: InProcess) -> None:
    await make(onceflow, "n/in")
    await fill(onceflow, "n/in", [1])
    pipe = Pipeline(
        URL,
        group="n",
        inputs=["n/in"],
        steps=[Step("A", lambda m: [m.value])],
        delivery="at-least-once",
        client=onceflow.client,
    )
    with pytest.raises(ProcessorError, match="no default output"):
        await pipe.run()


# ---------------------------------------------------------------- kill -9


PIPELINE_CHILD = r"""
import asyncio, sys
from onceflow.processors import Pipeline, Step

url = sys.argv[1]

async def a(msg):
    if msg.value % 7 == 0:
        return []                                              # filtered
    return [{"n": msg.value, "k": k} for k in range(3)]        # fan-out

def b(v):
    return [{"n": v["n"], "k": v["k"], "sq": v["n"] * v["n"]}]

async def main():
    p = Pipeline(url, group="kill", inputs=["k/in"], output="k/out", transactional_id="kill-1",
                 steps=[Step("A", a, workers=2), Step("B", b, workers=3)],
                 max_read_bytes=1, commit_interval=0.02, txn_timeout_ms=2000)
    await p.run()

asyncio.run(main())
"""

CUES_CHILD = r"""
import sys
from onceflow.processors import StreamProcessor

url = sys.argv[1]
StreamProcessor(url, "inc", inputs=["c/in"], output="c/mid", max_read_bytes=1,
                fn=lambda b: [v + 1 for v in b.values]).run()
StreamProcessor(url, "dbl", inputs=["c/mid"], output="c/out", max_read_bytes=1,
                fn=lambda b: [v * 2 for v in b.values]).run()
"""


def _read_stream(url: str, name: str) -> list[Any]:
    out: list[Any] = []
    offset = "-1"
    with httpx.Client(timeout=30) as c:
        while True:
            r = c.get(f"{url}/v1/stream/{name}", params={"offset": offset})
            r.raise_for_status()
            out += r.json()
            offset = r.headers["stream-next-offset"]
            if r.headers.get("stream-up-to-date") == "true":
                return out


def _records_written(url: str, *names: str) -> int:
    """Records in the streams' logs, committed or not (white-box: the first half of an offset)."""
    total = 0
    with httpx.Client(timeout=5) as c:
        for n in names:
            r = c.head(f"{url}/v1/stream/{n}")
            if r.status_code == 200:  # not created yet: nothing written
                total += int(r.headers["stream-next-offset"].split("_")[0])
    return total


def _fill(url: str, name: str, total: int, per_append: int) -> None:
    with httpx.Client(timeout=30) as c:
        c.put(f"{url}/v1/stream/{name}", headers={"content-type": "application/json"}).raise_for_status()
        for i in range(0, total, per_append):
            body = json.dumps(list(range(i, i + per_append))).encode()
            c.post(
                f"{url}/v1/stream/{name}", content=body, headers={"content-type": "application/json"}
            ).raise_for_status()


def run_with_kills(
    srv: ServerProcess, script: Path, progress: Callable[[], int], kill_at: list[int], server_kill_at: int
) -> int:
    """Run ``script`` and SIGKILL it each time ``progress()`` passes the next of ``kill_at`` (and
    kill and restart the server too at kill number ``server_kill_at``), then run it to the end.
    Returns how many kills happened mid-run."""
    kills = 0
    for point in [*kill_at, None]:
        child = subprocess.Popen([sys.executable, str(script), srv.url], stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while child.poll() is None and time.monotonic() < deadline:
                if point is not None and progress() >= point:
                    child.send_signal(signal.SIGKILL)
                    child.wait()
                    kills += 1
                    if kills == server_kill_at:  # the server dies too and comes back on the same data
                        srv.kill()
                        srv.start()
                    break
                time.sleep(0.01)
            else:
                assert child.wait(5) == 0, child.stderr.read() if child.stderr else ""
                if point is None:
                    return kills
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            if child.stderr is not None:
                child.stderr.close()
    return kills


@pytest.fixture
def quiet_server(tmp_path: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(tmp_path / "data", "--log-level", "error")
    s.start()
    try:
        yield s
    finally:
        s.kill()


@pytest.mark.slow
def test_pipeline_output_exactly_once_through_kill9_of_pipeline_and_server(
    quiet_server: ServerProcess, tmp_path: Path
) -> None:
    srv = quiet_server
    total = 3000
    _fill(srv.url, "k/in", total, 50)
    script = tmp_path / "child.py"
    script.write_text(PIPELINE_CHILD)
    rng = random.Random(int(os.environ.get("ONCEFLOW_TEST_SEED", "7")))
    expected = Counter((n, k) for n in range(total) if n % 7 for k in range(3))
    points = sorted(rng.sample(range(len(expected) // 20, len(expected) * 9 // 10), 4))
    kills = run_with_kills(srv, script, lambda: _records_written(srv.url, "k/out"), points, server_kill_at=2)
    assert kills >= 3, "the pipeline finished before it could be killed; make the input larger"
    out = _read_stream(srv.url, "k/out")
    got = Counter((v["n"], v["k"]) for v in out)
    assert got == expected, f"duplicates: {sum((got - expected).values())}, missing: {sum((expected - got).values())}"
    assert all(v["sq"] == v["n"] ** 2 for v in out)
    with httpx.Client() as c:
        committed = c.get(f"{srv.url}/v1/groups/kill/offsets").json()["offsets"]["k/in"]
        assert committed == c.head(f"{srv.url}/v1/stream/k/in").headers["stream-next-offset"]


@pytest.mark.slow
def test_chained_stream_processors_exactly_once_through_kill9(quiet_server: ServerProcess, tmp_path: Path) -> None:
    srv = quiet_server
    total = 1500
    _fill(srv.url, "c/in", total, 25)
    script = tmp_path / "cues_child.py"
    script.write_text(CUES_CHILD)
    rng = random.Random(int(os.environ.get("ONCEFLOW_TEST_SEED", "11")))
    points = sorted(rng.sample(range(total // 10, total * 19 // 10), 5))

    kills = run_with_kills(srv, script, lambda: _records_written(srv.url, "c/mid", "c/out"), points, server_kill_at=3)
    assert kills >= 3, "the processors finished before they could be killed; make the input larger"
    assert [m["value"] for m in _read_stream(srv.url, "c/mid")] == [n + 1 for n in range(total)]
    assert [m["value"] for m in _read_stream(srv.url, "c/out")] == [(n + 1) * 2 for n in range(total)]  # once, in order


def test_public_surface() -> None:
    import onceflow.processors as p

    assert sorted(p.__all__) == sorted(name for name in dir(p) if not name.startswith("_"))
    assert issubclass(ProcessorFencedError, ProcessorError) and issubclass(ProcessorError, OnceflowError)
