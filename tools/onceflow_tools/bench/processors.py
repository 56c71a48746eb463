"""``onceflow bench processors``: processors beside a plain consumer doing the same work, same run.

Every side reads 100-byte JSON messages from its own input stream, turns each into a small JSON
output (``{"n": .., "t": .., "len": ..}``) and writes it to its own output stream, on one
``onceflow serve --fsync always``:

- **plain consumer, at-least-once**: ``AsyncConsumer`` + ``AsyncIdempotentProducer``; per read:
  append the outputs, wait for them, commit the read's offset to the server's group offsets;
- **Cues stream processor, exactly-once**: :class:`~onceflow.processors.AsyncStreamProcessor`
  (snapshot, attempt, output: three conditional appends per step);
- **parallel consumer, at-least-once** and **exactly-once** (outputs and offsets in one
  transaction), ``--concurrency`` handlers.

Throughput: a backlog of ``--messages`` messages, timed until every output is written and the
offsets are committed. Latency: ``--rate`` messages per second for ``--seconds`` with the processor
running live; a long-poll reader of the output measures the time from append to seeing the output
(read_committed, so exactly-once outputs count when their transaction commits).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from onceflow.client import AsyncConsumer, AsyncIdempotentProducer, AsyncStream, MemoryOffsetStore, Message
from onceflow.processors import AsyncStreamProcessor, Batch, ParallelConsumer
from onceflow.testing import onceflow_server

from .append import _run_loop, _say, report

__all__ = ["run"]

PAD = "x" * 60  # with the other fields a message is ~100 bytes of JSON

SIDES = [
    "plain consumer, at-least-once",
    "Cues stream processor, exactly-once",
    "parallel consumer, at-least-once",
    "parallel consumer, exactly-once",
]


@dataclass
class SideResult:
    side: str
    messages: int
    throughput_msg_s: float
    latency_messages: int
    latency_p50_ms: float
    latency_p99_ms: float


def _pct(ordered: list[float], p: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))] if ordered else 0.0


def work(value: dict[str, Any]) -> dict[str, Any]:
    """The same work on every side."""
    return {"n": value["n"], "t": value["t"], "len": len(value["k"])}


class _Side:
    """One way of processing ``in`` into ``out``: ``run(live, stop)`` until idle or stopped."""

    def __init__(self, url: str, name: str, slug: str, client: httpx.AsyncClient, concurrency: int) -> None:
        self.url, self.name, self.slug, self.client, self.concurrency = url, name, slug, client, concurrency
        self.input, self.output = f"bench-proc/{slug}/in", f"bench-proc/{slug}/out"

    async def run(self, live: bool, stop: asyncio.Event, run_id: int) -> None:
        if self.name.startswith("plain"):
            await self._plain(live, stop, run_id)
        elif self.name.startswith("Cues"):
            await self._cues(live, stop, run_id)
        else:
            await self._parallel(
                live, stop, run_id, "exactly-once" if self.name.endswith("exactly-once") else "at-least-once"
            )

    async def _plain(self, live: bool, stop: asyncio.Event, run_id: int) -> None:
        group = f"plain-{run_id}"
        consumer = AsyncConsumer(
            self.url,
            group=group,
            streams=[self.input],
            store=MemoryOffsetStore(),
            delivery="exactly-once",
            live="long-poll" if live else None,
            client=self.client,
            max_read_bytes=64 << 10,
        )
        producer = AsyncIdempotentProducer(self.url, self.output, client=self.client, content_type="application/json")
        await producer.start()
        try:
            while not stop.is_set():
                msgs = await consumer.poll(timeout=0.2 if live else None)
                if not msgs:
                    if live:
                        continue
                    break
                producer.extend(work(m.value) for m in msgs)
                await producer.flush()
                resp = await self.client.post(
                    f"{self.url}/v1/groups/{group}/offsets", json={"offsets": consumer.positions()}
                )
                resp.raise_for_status()
        finally:
            await consumer.close()
            await producer.close()

    async def _cues(self, live: bool, stop: asyncio.Event, run_id: int) -> None:
        def fn(batch: Batch) -> list[Any]:
            return [work(r.value) for r in batch.records]

        proc = AsyncStreamProcessor(
            self.url,
            f"bench-{self.slug}-{run_id}",
            inputs=[self.input],
            output=self.output,
            fn=fn,
            client=self.client,
            max_read_bytes=64 << 10,
            poll_interval=1.0,
        )
        await proc.start()
        try:
            await proc.run(live=live, stop=stop)
        finally:
            await proc.close()

    async def _parallel(self, live: bool, stop: asyncio.Event, run_id: int, delivery: str) -> None:
        def handler(msg: Message) -> list[Any]:
            return [work(msg.value)]

        kw: dict[str, Any] = {"transactional_id": f"bench-{self.slug}-{run_id}"} if delivery == "exactly-once" else {}
        pc = ParallelConsumer(
            self.url,
            group=f"{self.slug}-{run_id}",
            streams=[self.input],
            handler=handler,
            concurrency=self.concurrency,
            delivery=delivery,  # type: ignore[arg-type]
            output=self.output,
            client=self.client,
            live=live,
            commit_interval=0.02,
            max_read_bytes=64 << 10,
            **kw,
        )
        watcher = asyncio.ensure_future(_stop_when(stop, pc.stop))
        try:
            await pc.run()
        finally:
            watcher.cancel()


async def _stop_when(event: asyncio.Event, stop: Callable[[], None]) -> None:
    await event.wait()
    stop()


async def _fill(url: str, client: httpx.AsyncClient, name: str, count: int, start: int = 0) -> None:
    s = AsyncStream.connect(url, name, client=client)
    await s.create("application/json")
    for i in range(start, start + count, 100):
        await s.append_many({"n": n, "t": 0.0, "k": PAD} for n in range(i, min(i + 100, start + count)))


async def _count(url: str, client: httpx.AsyncClient, name: str) -> int:
    total = 0
    async for chunk in AsyncStream.connect(url, name, client=client).chunks("-1"):
        total += len(chunk.messages())
    return total


async def _throughput(side: _Side, messages: int, run_id: int) -> float:
    await _fill(side.url, side.client, side.input, messages)
    await AsyncStream.connect(side.url, side.output, client=side.client).create("application/json")
    t0 = time.perf_counter()
    await side.run(live=False, stop=asyncio.Event(), run_id=run_id)
    elapsed = time.perf_counter() - t0
    written = await _count(side.url, side.client, side.output)
    if written != messages:
        raise RuntimeError(f"{side.name}: {written} outputs for {messages} inputs")
    return messages / elapsed


async def _latency(side: _Side, rate: float, seconds: float, run_id: int) -> list[float]:
    """Append ``rate`` messages/s for ``seconds`` while ``side`` runs live; latencies in seconds."""
    name_in, name_out = side.input + "-live", side.output + "-live"
    side.input, side.output = name_in, name_out
    await AsyncStream.connect(side.url, name_in, client=side.client).create("application/json")
    out = AsyncStream.connect(side.url, name_out, client=side.client)
    tail = (await out.create("application/json")).next_offset
    stop = asyncio.Event()
    runner = asyncio.ensure_future(side.run(live=True, stop=stop, run_id=run_id))
    total = int(rate * seconds)
    latencies: list[float] = []

    async def read() -> None:
        async for chunk in out.chunks(tail, live="long-poll"):
            now = time.perf_counter()
            for m in chunk.messages():
                value = m["value"] if "meta" in m else m
                latencies.append(now - value["t"])
            if len(latencies) >= total:
                return

    reader = asyncio.ensure_future(read())
    await asyncio.sleep(0.5)  # the processor is up and tailing
    inp = AsyncStream.connect(side.url, name_in, client=side.client)
    t0 = time.perf_counter()
    for i in range(total):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await inp.append({"n": i, "t": time.perf_counter(), "k": PAD})
    try:
        await asyncio.wait_for(reader, timeout=30)
    finally:
        stop.set()
        await _settle(runner)
        reader.cancel()
    return latencies


async def _settle(task: Awaitable[Any]) -> None:
    try:
        await asyncio.wait_for(task, timeout=30)
    except TimeoutError:
        _say("a processor did not stop within 30 s")


async def _measure(url: str, args: argparse.Namespace) -> list[SideResult]:
    results = []
    run_id = int(time.time())
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=90.0)) as client:
        for i, name in enumerate(SIDES):
            side = _Side(url, name, f"s{i}", client, args.concurrency)
            _say(f"{name}: throughput over {args.messages:,} messages")
            rate = await _throughput(side, args.messages, run_id)
            _say(f"{name}: latency at {args.rate:.0f} msg/s for {args.seconds:.0f} s")
            lat = sorted(await _latency(side, args.rate, args.seconds, run_id + 1))
            results.append(
                SideResult(
                    name,
                    args.messages,
                    rate,
                    len(lat),
                    statistics.median(lat) * 1e3 if lat else 0.0,
                    _pct(lat, 99) * 1e3,
                )
            )
    return results


def run(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="onceflow-bench-processors-"))
    server = onceflow_server(root / "data")
    try:
        startup = server.start()
        _say(f"onceflow serve ready at {server.url} in {startup * 1e3:,.0f} ms")
        results = _run_loop(_measure(server.url, args))
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    plain = results[0].throughput_msg_s
    lines = [
        f"\nonceflow bench processors: ~100 B JSON messages, fsync always; backlog {args.messages:,} messages; "
        f"live {args.rate:.0f} msg/s for {args.seconds:.0f} s; parallel consumer concurrency {args.concurrency}",
        f"  {'side':<38} {'msg/s':>10} {'vs plain':>9} {'p50 ms':>8} {'p99 ms':>8}",
    ]
    failures = []
    for r in results:
        lines.append(
            f"  {r.side:<38} {r.throughput_msg_s:>10,.0f} {r.throughput_msg_s / plain:>8.2f}x "
            f"{r.latency_p50_ms:>8.1f} {r.latency_p99_ms:>8.1f}"
        )
        if r.latency_messages < int(args.rate * args.seconds):
            failures.append(f"{r.side}: saw {r.latency_messages} of {int(args.rate * args.seconds)} live outputs")
    return report("\n".join(lines), {"results": [asdict(r) for r in results]}, failures, args.out)
