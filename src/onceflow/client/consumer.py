"""Consumers: read many streams from committed offsets, with a chosen delivery guarantee.

Delivery
    ``at-most-once``   the read's end offset is committed *before* its messages are handed over: a
                       crash while processing skips them, never repeats them.
    ``at-least-once``  it is committed when the next ``poll()`` starts (or on ``commit()``), i.e.
                       after the application processed the messages: a crash repeats, never skips.
    ``exactly-once``   the consumer never commits: a TransactionalProducer commits its positions in
                       the same transaction as the output (``send_offsets_to_transaction(group,
                       consumer.positions())``). Offsets then live on the server (GroupOffsetStore,
                       the default for this mode); reads are read_committed. When that transaction
                       aborts, the positions have still moved past its input: call ``rewind()``
                       before going on (or end the process), or that input is skipped.

Offsets live in an :class:`OffsetStore`. ``FileOffsetStore`` keeps them in a local JSON file
(durably replaced on each commit); server-side consumer groups plug in through the same protocol.
Committed offsets only move forward.

Retention
    When a stream's retention deleted the data at a reader's offset (its group fell that far
    behind), ``offset_reset`` decides: ``"error"`` (the default) hands ``poll()`` an
    :class:`OffsetGoneError` naming the earliest offset kept; ``"earliest"`` logs a warning and
    goes on from there, skipping what was deleted (Kafka's ``auto.offset.reset=earliest``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import httpx

from .._files import replace_file
from ._errors import OffsetGoneError, OnceflowError, TransportError, error_from_response
from ._loop import run_sync
from ._types import Chunk, Delivery, Message
from .lowlevel import (
    Coding,
    ServerURL,
    accept_headers,
    async_http_client,
    check_compression,
    parse_chunk,
    read_params,
    request_url,
    server_url,
    stream_url,
)

__all__ = [
    "AsyncConsumer",
    "AsyncOffsetStore",
    "Consumer",
    "FileOffsetStore",
    "MemoryOffsetStore",
    "OffsetStore",
    "list_streams",
]

StartPolicy = Literal["earliest", "latest"]
OffsetReset = Literal["error", "earliest"]

log = logging.getLogger("onceflow.client")


class OffsetStore(Protocol):
    """Where a consumer group's positions are kept: the next offset to read, per stream."""

    def load(self, group: str, stream: str) -> str | None: ...

    def commit(self, group: str, offsets: Mapping[str, str]) -> None: ...


@runtime_checkable
class AsyncOffsetStore(Protocol):
    """An :class:`OffsetStore` that also speaks asyncio over the consumer's own client
    (:class:`~onceflow.client.GroupOffsetStore`): an :class:`AsyncConsumer` then loads and commits
    through its client, on its event loop, instead of a blocking call in a thread."""

    async def aload(self, group: str, stream: str, client: httpx.AsyncClient) -> str | None: ...

    async def acommit(self, group: str, offsets: Mapping[str, str], client: httpx.AsyncClient) -> None: ...


class MemoryOffsetStore:
    """Offsets in memory (tests, throwaway consumers)."""

    def __init__(self) -> None:
        self._data: dict[str, dict[str, str]] = {}
        self._lock = threading.Lock()

    def load(self, group: str, stream: str) -> str | None:
        with self._lock:
            return self._data.get(group, {}).get(stream)

    def commit(self, group: str, offsets: Mapping[str, str]) -> None:
        with self._lock:
            g = self._data.setdefault(group, {})
            for stream, off in offsets.items():
                if stream not in g or off > g[stream]:
                    g[stream] = off


class FileOffsetStore:
    """Offsets in a JSON file, replaced atomically and synced on every commit."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def _read(self) -> dict[str, dict[str, str]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        if not isinstance(data, dict):
            raise ValueError(f"{self.path} is not an offsets file")
        return data

    def load(self, group: str, stream: str) -> str | None:
        with self._lock:
            return self._read().get(group, {}).get(stream)

    def commit(self, group: str, offsets: Mapping[str, str]) -> None:
        with self._lock:
            data = self._read()
            g = data.setdefault(group, {})
            changed = False
            for stream, off in offsets.items():
                if stream not in g or off > g[stream]:  # offsets of one stream sort as strings
                    g[stream] = off
                    changed = True
            if not changed:
                return
            replace_file(self.path, json.dumps(data).encode())


async def list_streams(client: httpx.AsyncClient, base_url: str, prefix: str = "") -> list[str]:
    """Names of the streams whose names start with ``prefix`` (onceflow's ``/v1/streams``)."""
    try:
        resp = await client.get(request_url(base_url.rstrip("/")) + "/v1/streams", params={"prefix": prefix})
    except httpx.TransportError as exc:
        raise TransportError(f"list streams: {exc!r}") from exc
    if resp.status_code != 200:
        raise error_from_response(resp, "list streams")
    return [s["name"] for s in resp.json()["streams"]]


class AsyncConsumer:
    """Reads ``streams`` (or every stream under ``prefix``) for consumer group ``group``.

    ``poll()`` returns the messages of one read (from one stream; streams are read concurrently and
    each keeps its order). ``live=None`` stops once every stream is caught up; ``"long-poll"``
    tails for new data (and, with a prefix, for new streams every ``discover_interval`` seconds).
    ``compression`` (``"gzip"`` or ``"zstd"``): reads ask for answers in that coding, which the
    server sends for answers of 1 KiB or more and httpx decodes.
    """

    def __init__(
        self,
        base_url: ServerURL,
        *,
        group: str,
        streams: Sequence[str] | None = None,
        prefix: str | None = None,
        store: OffsetStore | None = None,
        delivery: Delivery = "at-least-once",
        start: StartPolicy = "earliest",
        live: Literal["long-poll"] | None = "long-poll",
        discover_interval: float = 5.0,
        client: httpx.AsyncClient | None = None,
        buffer: int = 4,
        max_read_bytes: int | None = None,
        offset_reset: OffsetReset = "error",
        compression: Coding | None = None,
    ) -> None:
        self._accept = accept_headers(check_compression(compression))
        if offset_reset not in ("error", "earliest"):
            raise ValueError(f"offset_reset must be error or earliest, not {offset_reset!r}")
        if delivery not in ("at-most-once", "at-least-once", "exactly-once"):
            raise ValueError(f"delivery must be at-most-once, at-least-once or exactly-once, not {delivery!r}")
        if (streams is None) == (prefix is None):
            raise ValueError("give either streams=[...] or prefix=...")
        base_url = server_url(base_url)
        self.base_url = base_url.rstrip("/")
        self.group = group
        self.streams = list(streams or [])
        self.prefix = prefix
        if store is None:
            from .transactions import GroupOffsetStore

            store = GroupOffsetStore(base_url) if delivery == "exactly-once" else MemoryOffsetStore()
        self.store: OffsetStore = store
        self.delivery = delivery
        self.start_policy = start
        self.live = live
        self.discover_interval = discover_interval
        self.max_read_bytes = max_read_bytes  # onceflow only: bound each read (and so each poll)
        self.offset_reset: OffsetReset = offset_reset
        self._own_client = client is None
        self._client = client or async_http_client(base_url, timeout=httpx.Timeout(30.0, read=90.0))
        self._queue: asyncio.Queue[Chunk | OnceflowError] = asyncio.Queue(maxsize=buffer)
        self._readers: dict[str, asyncio.Task[None]] = {}
        self._uncommitted: dict[str, str] = {}
        self._positions: dict[str, str] = {}
        self._discoverer: asyncio.Task[None] | None = None
        self._started = False
        self._caught_up: set[str] = set()

    async def __aenter__(self) -> AsyncConsumer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        if self.prefix is not None:
            self.streams = await list_streams(self._client, self.base_url, self.prefix)
            if self.live:
                self._discoverer = asyncio.get_running_loop().create_task(self._discover())
        for name in self.streams:
            self._add_reader(name)

    def _add_reader(self, name: str) -> None:
        if name not in self._readers:
            self._readers[name] = asyncio.get_running_loop().create_task(self._read(name))

    async def _discover(self) -> None:
        assert self.prefix is not None
        while True:
            await asyncio.sleep(self.discover_interval)
            with contextlib.suppress(OnceflowError):
                for name in await list_streams(self._client, self.base_url, self.prefix):
                    if name not in self._readers:
                        self.streams.append(name)
                        self._add_reader(name)

    async def _read(self, name: str) -> None:
        """One stream's reader task. Retriable failures are retried here; anything else is handed
        to ``poll()`` through the queue, so a reader never dies unseen."""
        try:
            await self._read_stream(name)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - delivered to the application by poll()
            err = exc if isinstance(exc, OnceflowError) else OnceflowError(f"reader of {name} failed: {exc!r}")
            await self._queue.put(err)

    async def _start_offset(self, name: str, url: str) -> str:
        """Where the group left off, or the start policy's offset; retried while the server is away."""
        backoff = 0.1
        while True:
            try:
                offset = await self._load(name)
                if offset is not None or self.start_policy == "earliest":
                    return offset or "-1"
                resp = await self._client.get(url, params={"offset": "now"})
                return parse_chunk(name, "now", resp, f"read {name}").next_offset
            except (httpx.TransportError, OnceflowError) as exc:
                if isinstance(exc, OnceflowError) and not exc.retriable:
                    raise
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _load(self, stream: str) -> str | None:
        if isinstance(self.store, AsyncOffsetStore):
            return await self.store.aload(self.group, stream, self._client)
        return await asyncio.to_thread(self.store.load, self.group, stream)  # a store of the user's may block

    async def _commit(self, offsets: Mapping[str, str]) -> None:
        if isinstance(self.store, AsyncOffsetStore):
            await self.store.acommit(self.group, offsets, self._client)
        else:
            self.store.commit(self.group, offsets)

    async def _read_stream(self, name: str) -> None:
        url = request_url(stream_url(self.base_url, name))
        offset = await self._start_offset(name, url)
        self._positions[name] = offset
        cursor: str | None = None
        backoff = 0.1
        while True:
            live = self.live if name in self._caught_up else None
            try:
                resp = await self._client.get(
                    url, params=read_params(offset, live, cursor, self.max_read_bytes), headers=self._accept
                )
                chunk = parse_chunk(name, offset, resp, f"read {name}")
            except (httpx.TransportError, OnceflowError) as exc:
                err = exc if isinstance(exc, OnceflowError) else TransportError(f"read {name}: {exc!r}")
                if isinstance(err, OffsetGoneError) and self.offset_reset == "earliest":
                    log.warning(
                        "group %r: the data of %s at %s was deleted by retention; going on from the earliest "
                        "offset kept, %s (offset_reset='earliest')",
                        self.group,
                        name,
                        offset,
                        err.earliest_offset,
                    )
                    offset, cursor = err.earliest_offset, None
                    continue
                if not err.retriable:
                    await self._queue.put(err)
                    return
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                continue
            backoff = 0.1
            if chunk.data:
                await self._queue.put(chunk)
            offset, cursor = chunk.next_offset, chunk.cursor
            if chunk.up_to_date:
                self._caught_up.add(name)
            if chunk.closed or (chunk.up_to_date and self.live is None):
                return

    def _all_done(self) -> bool:
        return bool(self._readers) and all(t.done() for t in self._readers.values()) and self._queue.empty()

    async def poll(self, timeout: float | None = None) -> list[Message]:
        """The next read's messages (empty when nothing arrived within ``timeout``, or when every
        stream is caught up and the consumer is not live)."""
        await self.start()
        if self.delivery == "at-least-once":
            await self.commit()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if self._all_done() or (not self._readers and self.live is None):
                return []
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                item = (
                    await asyncio.wait_for(self._queue.get(), remaining)
                    if remaining is not None
                    else await self._get_or_finish()
                )
            except TimeoutError:
                return []
            if item is None:
                return []
            if isinstance(item, OnceflowError):
                raise item
            if not item.data:
                continue
            messages = self._messages(item)
            self._positions[item.stream] = item.next_offset
            if self.delivery == "at-most-once":
                await self._commit({item.stream: item.next_offset})
            elif self.delivery == "at-least-once":
                self._uncommitted[item.stream] = item.next_offset
            return messages

    async def _get_or_finish(self) -> Chunk | OnceflowError | None:
        """Wait for the next item; None once all readers are finished and nothing is queued."""
        while True:
            if self._all_done():
                return None
            try:
                return await asyncio.wait_for(self._queue.get(), 0.5)
            except TimeoutError:
                continue

    @staticmethod
    def _messages(chunk: Chunk) -> list[Message]:
        values: list[Any] = chunk.messages() if chunk.is_json else [chunk.data]
        return [Message(chunk.stream, v, chunk.offset, chunk.next_offset, i) for i, v in enumerate(values)]

    def hold_back(self, stream: str, offset: str) -> None:
        """Commit no further than ``offset`` on ``stream`` next time (a read not fully processed)."""
        if stream in self._uncommitted:
            self._uncommitted[stream] = offset

    async def commit(self) -> None:
        """Commit the end offsets of everything ``poll()`` returned so far."""
        if self.delivery == "exactly-once":
            raise OnceflowError(
                "an exactly-once consumer's offsets are committed by the transactional producer "
                "(send_offsets_to_transaction(group, consumer.positions()))"
            )
        if self._uncommitted:
            pending, self._uncommitted = self._uncommitted, {}
            try:
                await self._commit(pending)
            except BaseException:
                # not stored (cancelled, timed out, refused): the next commit sends them again,
                # unless a later poll has moved a stream on already
                for stream, off in pending.items():
                    self._uncommitted.setdefault(stream, off)
                raise

    def positions(self) -> dict[str, str]:
        """The next offset this consumer will read, per stream it has reached (real offsets only)."""
        return {s: off for s, off in self._positions.items() if off not in ("-1", "now")}

    async def rewind(self) -> None:
        """Go back to the offsets the store holds (the last committed), as a restarted consumer
        would: everything read and not committed is dropped and read again by the next polls.

        For ``exactly-once`` after the transaction that was to carry ``positions()`` aborted
        (Kafka's "seek to the committed offsets"): without it the next transaction would commit
        positions past input whose output was aborted, and that input would be lost."""
        readers = list(self._readers.values())
        for t in readers:
            t.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        self._readers.clear()
        while not self._queue.empty():
            self._queue.get_nowait()
        self._positions.clear()
        self._uncommitted.clear()
        self._caught_up.clear()
        if self._started:
            for name in self.streams:
                self._add_reader(name)

    def __aiter__(self) -> AsyncConsumer:
        return self

    async def __anext__(self) -> list[Message]:
        batch = await self.poll()
        if not batch and (self._all_done() or self.live is None):
            raise StopAsyncIteration
        return batch

    async def close(self) -> None:
        """Stop reading. Offsets of delivered but uncommitted messages are *not* committed."""
        for t in [*self._readers.values(), *([self._discoverer] if self._discoverer else [])]:
            t.cancel()
        await asyncio.gather(*self._readers.values(), return_exceptions=True)
        if self._own_client:
            await self._client.aclose()


class Consumer:
    """The blocking twin of :class:`AsyncConsumer` (same arguments); iterate it for messages."""

    def __init__(
        self,
        base_url: ServerURL,
        *,
        group: str,
        streams: Sequence[str] | None = None,
        prefix: str | None = None,
        store: OffsetStore | None = None,
        delivery: Delivery = "at-least-once",
        start: StartPolicy = "earliest",
        live: Literal["long-poll"] | None = "long-poll",
        discover_interval: float = 5.0,
        client: httpx.AsyncClient | None = None,
        buffer: int = 4,
        max_read_bytes: int | None = None,
        offset_reset: OffsetReset = "error",
        compression: Coding | None = None,
    ) -> None:
        def make() -> AsyncConsumer:  # on the background loop: the consumer's queue belongs to it
            return AsyncConsumer(
                base_url,
                group=group,
                streams=streams,
                prefix=prefix,
                store=store,
                delivery=delivery,
                start=start,
                live=live,
                discover_interval=discover_interval,
                client=client,
                buffer=buffer,
                max_read_bytes=max_read_bytes,
                offset_reset=offset_reset,
                compression=compression,
            )

        self._core: AsyncConsumer = run_sync(_start_consumer(make))
        self._buffer: list[Message] = []

    def poll(self, timeout: float | None = None) -> list[Message]:
        return run_sync(self._core.poll(timeout))

    def commit(self) -> None:
        """Commit what the iterator handed out (not for exactly-once: see AsyncConsumer.commit). A read only partly iterated is committed up to
        its start, so its remaining messages are not lost (at-least-once may repeat its first ones)."""
        if self._buffer:
            held = self._buffer[0]
            self._core.hold_back(held.stream, held.offset)
        run_sync(self._core.commit())

    def positions(self) -> dict[str, str]:
        return self._core.positions()

    def rewind(self) -> None:
        """Go back to the committed offsets (see :meth:`AsyncConsumer.rewind`); messages read but
        not yet iterated are dropped too."""
        self._buffer.clear()
        run_sync(self._core.rewind())

    def __iter__(self) -> Consumer:
        return self

    def __next__(self) -> Message:
        while True:
            if self._buffer:
                return self._buffer.pop(0)
            batch = self.poll()  # at-least-once: commits the read just finished
            if not batch:
                raise StopIteration
            self._buffer = batch

    def close(self) -> None:
        run_sync(self._core.close())

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _start_consumer(make: Callable[[], AsyncConsumer]) -> AsyncConsumer:
    consumer = make()
    await consumer.start()
    return consumer
