"""Multi-step pipelines and the parallel consumer, acknowledged by Wallaroo-style watermarks.

::

    input streams ──▶ source ──▶ step A (workers A[0..n]) ──▶ step B (workers B[0..m]) ──▶ sink ──▶ output streams
                        ▲              │ ack                       │ ack                  │ ack
                        └──────────────┴───────────────────────────┴──────────────────────┘

Every node (the source and each worker of each step) is a :class:`~onceflow.processors.Acker`.
Its routes are the workers of the next step (the sink for the last step). A worker handles its
inbox one message at a time, so its acknowledgements on a route arrive in order, as the
watermarking algorithm needs. When a worker finishes a message (all outputs sent on, or none:
filtered) and its downstream acknowledges, the worker's watermark moves and it acknowledges its
senders; the source ends the chain: it learns, per input stream, the highest message all of whose
descendants are done, and commits that stream's offset up to the last read (chunk) that is
entirely done. A message is done at the sink when its output is durable (at-least-once: appended
and acknowledged by the server) or staged for the next transaction (exactly-once: the transaction
carries the outputs of exactly the messages below the committed offsets).

Functions may run concurrently and finish out of order across workers; nothing is committed past
a message that is not done. A function that raises stops the pipeline (:meth:`Pipeline.run`
raises it): what was not committed is processed again by the next run.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from ..client import (
    AsyncConsumer,
    AsyncIdempotentProducer,
    AsyncStream,
    AsyncTransactionalProducer,
    MemoryOffsetStore,
    Message,
    OffsetStore,
    StreamNotFoundError,
    TransportError,
)
from ..client.lowlevel import ServerURL, async_http_client, error_from_response, request_url, server_url, stream_url
from ._errors import ProcessorError
from ._watermark import Acker

__all__ = ["Output", "ParallelConsumer", "Pipeline", "PipelineDelivery", "PipelineStats", "Step"]

PipelineDelivery = Literal["at-least-once", "exactly-once"]
StepFn = Callable[[Any], "Iterable[Any] | None | Awaitable[Iterable[Any] | None]"]


@dataclass(frozen=True, slots=True)
class Output:
    """A value for a named output stream (a plain value goes to the pipeline's ``output``)."""

    stream: str
    value: Any


@dataclass(frozen=True, slots=True)
class Step:
    """One step: ``fn(value)`` returns the values it sends on (an iterable: several for a fan-out,
    none or None to filter the message out); plain or async.

    ``workers`` instances run concurrently, each handling its messages one at a time. ``key(value)``
    picks the worker (by CRC-32 of the key's JSON), which keeps the order of one key's messages;
    without it a message goes to a worker that is waiting for work. ``threads=True`` runs a plain ``fn`` in a
    thread (for blocking calls). The first step receives :class:`onceflow.client.Message` objects,
    every later step the values the step before returned. The last step's values are the outputs.
    """

    name: str
    fn: StepFn
    workers: int = 1
    key: Callable[[Any], Any] | None = None
    threads: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("a step needs a non-empty name")
        if not callable(self.fn):
            raise TypeError(f"step {self.name!r}: fn must be callable, not {type(self.fn).__name__}")
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"step {self.name!r}: workers must be a positive integer, not {self.workers!r}")


@dataclass
class PipelineStats:
    """Counters of one :meth:`Pipeline.run` (``committed``: the last offsets committed)."""

    consumed: int = 0
    outputs: int = 0
    filtered: int = 0
    commits: int = 0
    committed: dict[str, str] = field(default_factory=dict)


SINK: Hashable = "sink"


@dataclass(frozen=True, slots=True)
class _Item:
    sender: _Node
    id: int  # the sender's outgoing id
    origin: tuple[str, int]  # (input stream, message number in that stream)
    value: Any


def _key_index(key: Any, n: int) -> int:
    return zlib.crc32(json.dumps(key, sort_keys=True, default=str).encode()) % n


class _Node:
    """A sender: keeps an Acker and passes acknowledgements upstream."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.acker = Acker()

    def __repr__(self) -> str:
        return self.name

    def on_ack(self, route: Hashable, outgoing_id: int) -> None:
        self.acker.ack_received(route, outgoing_id)
        self._propagate()

    def _propagate(self) -> None:
        raise NotImplementedError


class _Pool:
    """The workers of one step. Unkeyed: a message goes to a worker waiting for work (the sender
    waits for one), so one slow message never holds up others queued behind it. Keyed: to the
    key's worker, queued in its inbox."""

    def __init__(self, step: Step) -> None:
        self.step = step
        self.workers: list[_Worker] = []
        self.idle: asyncio.Queue[_Worker] = asyncio.Queue()

    async def route(self, value: Any) -> _Worker:
        if self.step.key is not None:
            return self.workers[_key_index(self.step.key(value), len(self.workers))]
        return await self.idle.get()


class _Worker(_Node):
    def __init__(self, pipeline: Pipeline, pool: _Pool, index: int, inbox_size: int) -> None:
        super().__init__(f"{pool.step.name}[{index}]")
        self.pipeline = pipeline
        self.pool = pool
        self.step = pool.step
        self.inbox: asyncio.Queue[_Item] = asyncio.Queue(maxsize=inbox_size)
        self.next: _Pool | None = None  # None: the last step, which sends to the sink
        self._emitting = False

    def connect(self, next_pool: _Pool | None) -> None:
        self.next = next_pool
        for r in next_pool.workers if next_pool is not None else [SINK]:
            self.acker.add_route(r)

    def _propagate(self) -> None:
        if self._emitting:
            # the outputs of the current message are not all tracked yet ("1 to many"): the
            # acknowledgement is recorded, and passed on once they are
            return
        for sender, incoming_id in self.acker.acks_to_send().items():
            assert isinstance(sender, _Node)
            sender.on_ack(self, incoming_id)

    async def _call(self, value: Any) -> list[Any]:
        if self.step.threads and not inspect.iscoroutinefunction(self.step.fn):
            result = await asyncio.to_thread(self.step.fn, value)
        else:
            result = self.step.fn(value)
        if inspect.isawaitable(result):
            result = await result
        if result is None:
            return []
        if isinstance(result, str | bytes | dict) or not isinstance(result, Iterable):
            raise TypeError(
                f"step {self.step.name!r} must return an iterable of values (or None), "
                f"not {type(result).__name__}; wrap a single value in a list"
            )
        return list(result)

    async def run(self) -> None:
        pipeline = self.pipeline
        while True:
            if self.step.key is None and self.inbox.empty():
                self.pool.idle.put_nowait(self)
            item = await self.inbox.get()
            outs = await self._call(item.value)
            self._emitting = True
            if not outs:
                self.acker.filtered(self.acker.next_id(), item.sender, item.id)
                pipeline.stats.filtered += 1
            for v in outs:
                if self.next is None:
                    o = self.acker.next_id()
                    self.acker.sent(SINK, o, item.sender, item.id)
                    pipeline.sink.put(self, o, item.origin, v)
                else:
                    route = await self.next.route(v)
                    o = self.acker.next_id()
                    self.acker.sent(route, o, item.sender, item.id)
                    await route.inbox.put(_Item(self, o, item.origin, v))
            self._emitting = False
            self._propagate()


class _Source(_Node):
    """Reads the inputs, numbers each stream's messages and keeps, per stream, its reads (chunks)
    in order so that a committed offset is always the end of a read that is entirely done."""

    def __init__(self, pipeline: Pipeline) -> None:
        super().__init__("source")
        self.pipeline = pipeline
        self.first: _Pool | None = None
        self.counters: dict[str, int] = {}
        self.done: dict[str, int] = {}  # per input stream: every message up to this number is done
        self.chunks: dict[str, deque[tuple[int, str]]] = {}  # (last message number, next offset)
        self.staged: dict[str, dict[int, list[Output]]] = {}  # exactly-once outputs by origin
        self.progress = asyncio.Event()

    def connect(self, first: _Pool) -> None:
        self.first = first
        for w in first.workers:
            self.acker.add_route(w)

    def _propagate(self) -> None:
        for stream, number in self.acker.acks_to_send().items():
            assert isinstance(stream, str)
            self.done[stream] = number
        self.progress.set()

    async def dispatch(self, msgs: list[Message]) -> None:
        stream = msgs[0].stream
        first = self.counters.get(stream, 0) + 1
        self.counters[stream] = last = first + len(msgs) - 1
        self.chunks.setdefault(stream, deque()).append((last, msgs[0].next_offset))
        assert self.first is not None
        for number, m in enumerate(msgs, first):
            route = await self.first.route(m)
            o = self.acker.next_id()
            self.acker.sent(route, o, stream, number)
            await route.inbox.put(_Item(self, o, (stream, number), m))
        self.pipeline.stats.consumed += len(msgs)

    def stage(self, origin: tuple[str, int], output: Output) -> None:
        self.staged.setdefault(origin[0], {}).setdefault(origin[1], []).append(output)

    def take_committable(self) -> tuple[dict[str, str], dict[str, list[Any]]]:
        """The offsets that may be committed now and (exactly-once) the outputs of exactly the
        messages they cover, per output stream in input order."""
        offsets: dict[str, str] = {}
        outputs: dict[str, list[Any]] = {}
        for stream in sorted(self.chunks):
            chunks, done = self.chunks[stream], self.done.get(stream, 0)
            last = 0
            while chunks and chunks[0][0] <= done:
                last, offsets[stream] = chunks.popleft()
            staged = self.staged.get(stream)
            if last and staged:
                for number in sorted(n for n in staged if n <= last):
                    for out in staged.pop(number):
                        outputs.setdefault(out.stream, []).append(out.value)
        return offsets, outputs


class _Sink:
    """The terminus of the last step. Exactly-once: stage the output with the source and
    acknowledge at once. At-least-once: append through idempotent producers and acknowledge each
    worker up to the last id once the server has acknowledged the append."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.pending: list[tuple[_Worker, int, Output]] = []
        self.wake = asyncio.Event()
        self.producers: dict[str, AsyncIdempotentProducer] = {}

    def _resolve(self, value: Any) -> Output:
        if isinstance(value, Output):
            return value
        if self.pipeline.output is None:
            raise ProcessorError(
                "the last step returned a plain value, but the pipeline has no default output; "
                "return Output(stream, value) or pass output=..."
            )
        return Output(self.pipeline.output, value)

    def put(self, worker: _Worker, outgoing_id: int, origin: tuple[str, int], value: Any) -> None:
        out = self._resolve(value)
        self.pipeline.stats.outputs += 1
        if self.pipeline.delivery == "exactly-once":
            self.pipeline.source.stage(origin, out)
            worker.on_ack(SINK, outgoing_id)
        else:
            self.pending.append((worker, outgoing_id, out))
            self.wake.set()

    async def _producer(self, stream: str) -> AsyncIdempotentProducer:
        p = self.producers.get(stream)
        if p is None:
            p = AsyncIdempotentProducer(self.pipeline.base_url, stream, client=self.pipeline._client)
            await p.start()
            self.producers[stream] = p
        return p

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            batch, self.pending = self.pending, []
            used = []
            for _, _, out in batch:
                p = await self._producer(out.stream)
                p.append(out.value)
                used.append(p)
            await asyncio.gather(*(p.flush() for p in set(used)))
            acks: dict[_Worker, int] = {}
            for worker, o, _ in batch:
                acks[worker] = o
            for worker, o in acks.items():
                worker.on_ack(SINK, o)

    @property
    def idle(self) -> bool:
        return not self.pending

    async def close(self) -> None:
        for p in self.producers.values():
            await p.close(flush=False)


class Pipeline:
    """Source -> steps -> output streams, with watermark acknowledgements (see the module
    docstring).

    ``delivery="exactly-once"`` (needs ``transactional_id``) commits the outputs of the messages
    below the new offsets and those offsets in one transaction every ``commit_interval`` seconds;
    consumers of the outputs should read read_committed (the default). ``"at-least-once"`` appends
    outputs as they come and commits offsets to ``store`` (default: the server's group offsets);
    a crash repeats what came after the last commit. ``live=False`` stops once the inputs are
    exhausted and everything read is committed. At most ``max_in_flight`` messages are between the
    source and their commit. Run one instance per ``group`` (and ``transactional_id``).
    """

    def __init__(
        self,
        base_url: ServerURL,
        *,
        group: str,
        inputs: Sequence[str],
        steps: Sequence[Step],
        output: str | None = None,
        delivery: PipelineDelivery = "exactly-once",
        transactional_id: str | None = None,
        store: OffsetStore | None = None,
        live: bool = False,
        commit_interval: float = 0.1,
        max_in_flight: int = 10_000,
        inbox_size: int = 16,
        max_read_bytes: int = 64 << 10,
        txn_timeout_ms: int = 60_000,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        if delivery not in ("at-least-once", "exactly-once"):
            raise ValueError(f"delivery must be at-least-once or exactly-once, not {delivery!r}")
        if delivery == "exactly-once" and not transactional_id:
            raise ValueError("exactly-once delivery needs a transactional_id (one per pipeline instance)")
        if delivery == "exactly-once" and store is not None:
            raise ValueError("exactly-once delivery commits offsets in the transaction; store= is for at-least-once")
        if not group or not isinstance(group, str):
            raise ValueError("group must be a non-empty string")
        if isinstance(inputs, str) or not inputs:
            raise ValueError("inputs must be a non-empty list of stream names")
        if not steps:
            raise ValueError("a pipeline needs at least one step")
        if not all(isinstance(s, Step) for s in steps):
            raise TypeError("steps must be Step(...) objects")
        if len({s.name for s in steps}) != len(steps):
            raise ValueError("step names must be distinct")
        if commit_interval <= 0 or max_in_flight < 1 or inbox_size < 1:
            raise ValueError("commit_interval, max_in_flight and inbox_size must be positive")
        self.base_url = server_url(base_url).rstrip("/")
        self.group = group
        self.inputs = list(inputs)
        self.steps = list(steps)
        self.output = output
        self.delivery = delivery
        self.transactional_id = transactional_id
        self.store = store
        self.live = live
        self.commit_interval = commit_interval
        self.max_in_flight = max_in_flight
        self.inbox_size = inbox_size
        self.max_read_bytes = max_read_bytes
        self.txn_timeout_ms = txn_timeout_ms
        self.stats = PipelineStats()
        self._own_client = client is None
        self._client = client or async_http_client(self.base_url, timeout=httpx.Timeout(30.0, read=90.0))
        self._stop = asyncio.Event()
        self._commit_lock = asyncio.Lock()
        self._ran = False

    def __repr__(self) -> str:
        return f"Pipeline({' -> '.join(['source', *(s.name for s in self.steps)])}, {self.delivery})"

    def stop(self) -> None:
        """Stop reading; :meth:`run` returns once what was read is done and committed."""
        self._stop.set()

    # ------------------------------------------------------------------ offsets

    def _group_url(self) -> str:
        return f"{request_url(self.base_url)}/v1/groups/{self.group}/offsets"

    async def _load_offsets(self) -> dict[str, str]:
        if self.store is not None:
            found = {}
            for s in self.inputs:
                off = await asyncio.to_thread(self.store.load, self.group, s)
                if off is not None:
                    found[s] = off
            return found
        try:
            resp = await self._client.get(self._group_url())
        except httpx.TransportError as exc:
            raise TransportError(f"load offsets of {self.group}: {exc!r}") from exc
        if resp.status_code != 200:
            raise error_from_response(resp, f"load offsets of {self.group}")
        offsets: dict[str, str] = resp.json()["offsets"]
        return {s: off for s, off in offsets.items() if s in self.inputs}

    async def _store_offsets(self, offsets: Mapping[str, str]) -> None:
        if self.store is not None:
            await asyncio.to_thread(self.store.commit, self.group, dict(offsets))
            return
        try:
            resp = await self._client.post(self._group_url(), json={"offsets": dict(offsets)})
        except httpx.TransportError as exc:
            raise TransportError(f"commit offsets of {self.group}: {exc!r}") from exc
        if resp.status_code != 200:
            raise error_from_response(resp, f"commit offsets of {self.group}")

    # ------------------------------------------------------------------ running

    def _build(self) -> None:
        self.source = _Source(self)
        self.sink = _Sink(self)
        pools = [_Pool(step) for step in self.steps]
        for pool in pools:
            pool.workers = [_Worker(self, pool, i, self.inbox_size) for i in range(pool.step.workers)]
        for pool, nxt in zip(pools, [*pools[1:], None], strict=True):
            for w in pool.workers:
                w.connect(nxt)
        self.source.connect(pools[0])
        self.workers = [w for pool in pools for w in pool.workers]

    async def _commit(self, producer: AsyncTransactionalProducer | None) -> None:
        """One commit, in order:

        1. take the offsets up to the last read whose messages are all done (per input stream),
           and, exactly-once, the staged outputs of exactly those messages;
        2. exactly-once: write those outputs and the offsets in one transaction and commit it;
           at-least-once: the outputs are already durable, so commit the offsets to the store.
        """
        # Step 1
        offsets, outputs = self.source.take_committable()
        if not offsets:
            return
        # Step 2
        if producer is not None:
            async with producer.transaction():
                for stream, values in outputs.items():
                    await producer.extend(stream, values)
                await producer.send_offsets_to_transaction(self.group, offsets)
        else:
            await self._store_offsets(offsets)
        self.stats.commits += 1
        self.stats.committed.update(offsets)

    async def _committer(self, producer: AsyncTransactionalProducer | None) -> None:
        while True:
            await asyncio.sleep(self.commit_interval)
            async with self._commit_lock:  # shutdown takes the lock: never cancelled mid-transaction
                await self._commit(producer)

    async def _read(self, consumer: AsyncConsumer) -> None:
        """The source: read, dispatch, and at the end wait until everything read is done."""
        src = self.source
        while not self._stop.is_set():
            while src.acker.pending >= self.max_in_flight:
                src.progress.clear()
                await src.progress.wait()
            msgs = await consumer.poll(timeout=0.2 if self.live else None)
            if msgs:
                await src.dispatch(msgs)
            elif not self.live:
                break
        while src.acker.pending:
            src.progress.clear()
            await src.progress.wait()

    async def run(self) -> PipelineStats:
        """Run until the inputs are exhausted (``live=False``) or :meth:`stop`; returns the stats.
        Raises what a step function or the server raised (nothing more is committed then)."""
        if self._ran:
            raise ProcessorError("a Pipeline runs once; make a new one")
        self._ran = True
        self._build()
        if self.output is not None:
            await self._ensure_json(self.output)
        producer: AsyncTransactionalProducer | None = None
        if self.delivery == "exactly-once":
            assert self.transactional_id is not None
            producer = AsyncTransactionalProducer(
                self.base_url, self.transactional_id, client=self._client, timeout_ms=self.txn_timeout_ms
            )
            await producer.init()  # fences an older instance; aborts what it left open
        start = MemoryOffsetStore()
        start.commit(self.group, await self._load_offsets())
        consumer = AsyncConsumer(
            self.base_url,
            group=self.group,
            streams=self.inputs,
            store=start,
            delivery="exactly-once",
            live="long-poll" if self.live else None,
            client=self._client,
            max_read_bytes=self.max_read_bytes,
        )
        await consumer.start()
        main = asyncio.ensure_future(self._read(consumer))
        helpers = [asyncio.ensure_future(w.run()) for w in self.workers]
        helpers.append(asyncio.ensure_future(self._committer(producer)))
        if self.delivery == "at-least-once":
            helpers.append(asyncio.ensure_future(self.sink.run()))
        try:
            await asyncio.wait([main, *helpers], return_when=asyncio.FIRST_COMPLETED)
            for t in helpers:
                if t.done():
                    main.cancel()
                    t.result()  # raises what stopped it
            main.result()
            async with self._commit_lock:
                await _cancel_all(helpers)
                await self._commit(producer)
        finally:
            await _cancel_all([main, *helpers])
            await consumer.close()
            await self.sink.close()
            if producer is not None:
                await producer.close()
            if self._own_client:
                await self._client.aclose()
        return self.stats

    async def _ensure_json(self, name: str) -> None:
        h = AsyncStream(stream_url(self.base_url, name), client=self._client)
        try:
            await h.head()
        except StreamNotFoundError:
            await h.create("application/json")


async def _cancel_all(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Cancel the tasks and wait until they are finished. Cancelling again until they are: on
    Python 3.11 ``asyncio.wait_for`` (inside the consumer's poll) can swallow a cancellation that
    coincides with its result."""
    while True:
        pending = [t for t in tasks if not t.done()]
        if not pending:
            break
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=0.1)
    for t in tasks:  # retrieve outcomes so none is reported as never retrieved
        if not t.cancelled():
            t.exception()


class ParallelConsumer:
    """A consumer that handles messages concurrently and commits only the offset below which
    every message is done.

    ``handler(message)`` (plain or async; :class:`onceflow.client.Message`) returns the values to
    write (to ``output``, or :class:`Output` objects to any stream), or None. ``concurrency``
    handlers run at once and may finish in any order; messages with the same ``key(message)`` go
    to the same handler slot, one after another. ``delivery``: ``"at-least-once"`` (outputs
    appended as they come; offsets committed to ``store`` or the server's group offsets) or
    ``"exactly-once"`` (outputs and offsets in one transaction; needs ``transactional_id``). It is
    a one-step :class:`Pipeline`; see there for the other arguments.
    """

    def __init__(
        self,
        base_url: ServerURL,
        *,
        group: str,
        streams: Sequence[str],
        handler: StepFn,
        concurrency: int = 8,
        key: Callable[[Any], Any] | None = None,
        threads: bool = False,
        delivery: PipelineDelivery = "at-least-once",
        **kw: Any,
    ) -> None:
        step = Step("handler", handler, workers=concurrency, key=key, threads=threads)
        self.pipeline = Pipeline(base_url, group=group, inputs=streams, steps=[step], delivery=delivery, **kw)

    @property
    def stats(self) -> PipelineStats:
        return self.pipeline.stats

    def stop(self) -> None:
        self.pipeline.stop()

    async def run(self) -> PipelineStats:
        return await self.pipeline.run()
