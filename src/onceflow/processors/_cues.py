"""Cues-style exactly-once processors on onceflow streams (seed 000).

A *stream processor* reads one or more input streams and writes one JSON output stream. Each step:

1. reads the next range of every input (the snapshot: ``{input: [start, end]}``, where ``end`` is
   the offset after the last message read) and hashes it;
2. writes the snapshot map to the processor's backing stream;
3. runs the processor function on the messages of the range;
4. takes the output stream's tail as the index of the write it is about to make;
5. writes the attempt map ``{"hash": h, "index": tail}`` to the backing stream, or a nil-attempt
   ``{"hash": h}`` when the function returned no output;
6. appends the outputs at exactly that index (``If-Match: tail``), each message carrying the hash
   in its metadata: ``{"meta": {"hash": h, ...}, "value": ...}``.

On start (and after any failed or unanswered write) the processor recovers:

1. read back the latest snapshot and the attempt after it from the backing stream;
2. no attempt: the step never finished: reset the inputs to the snapshot's start and process the
   same range again; a nil-attempt: the step finished;
3. an attempt: read the output message at its index; the same hash there means the step finished
   (continue after the range), anything else means the attempt failed (reset and process again).

A *sink processor* runs the same steps with a side effect instead of an output stream: the
function runs at least once per range and sees the range's hash (:attr:`Batch.hash`), the same on
every delivery, to make its effect idempotent. A *source* appends data from outside together with
the position it came from, in one conditional append, and tells that position on restart.

Every write is conditional on the tail the processor last saw, so each backing and output stream
has one writer: an instance that starts claims a new epoch in the backing stream, and an older
instance's next write fails and finds the newer claim (:class:`ProcessorFencedError`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
import logging
import secrets
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self, TypeVar

import httpx

from ..client import AsyncStream, Chunk, OnceflowError, PreconditionFailedError, StreamNotFoundError, TransportError
from ..client.lowlevel import (
    ServerURL,
    async_http_client,
    background_loop,
    error_from_response,
    is_json_type,
    parse_chunk,
    read_params,
    request_url,
    run_sync,
    server_url,
    stream_url,
)
from ._errors import ProcessorError, ProcessorFencedError

__all__ = [
    "AsyncSinkProcessor",
    "AsyncSource",
    "AsyncStreamProcessor",
    "Batch",
    "Record",
    "Recovery",
    "SinkProcessor",
    "Snapshot",
    "Source",
    "StepResult",
    "StreamProcessor",
    "snapshot_hash",
]

log = logging.getLogger("onceflow.processors")

T = TypeVar("T")

RecoveryOutcome = Literal["fresh", "resumed", "reset"]
ProcessFn = Callable[["Batch"], "Iterable[Any] | None | Awaitable[Iterable[Any] | None]"]
SinkFn = Callable[["Batch"], "None | Awaitable[None]"]

JSON = "application/json"
START = "-1"


@dataclass(frozen=True, slots=True)
class Record:
    """One input message. ``meta`` is the metadata of a message another processor or a source
    wrote (``{"hash": ...}`` or ``{"source": ..., "position": ...}``), else None."""

    stream: str
    value: Any
    meta: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The input range of one step: ``ranges[input] == (start, end)`` offsets (equal when the step
    read nothing from that input) and its hash."""

    processor: str
    ranges: Mapping[str, tuple[str, str]]
    hash: str


@dataclass(frozen=True, slots=True)
class Batch:
    """What a processor function receives: the step's snapshot and its input records, in input
    order and, within an input, in stream order. ``redelivery`` is True when the same range was
    recorded before a crash or failed write and is being processed again."""

    snapshot: Snapshot
    records: tuple[Record, ...]
    redelivery: bool = False

    @property
    def hash(self) -> str:
        """The snapshot's hash: the same for every delivery of this range, unique per range."""
        return self.snapshot.hash

    @property
    def values(self) -> list[Any]:
        return [r.value for r in self.records]

    def by_stream(self, stream: str) -> list[Record]:
        return [r for r in self.records if r.stream == stream]


@dataclass(frozen=True, slots=True)
class Recovery:
    """What recovery found. ``fresh``: no snapshot yet; ``resumed``: the last step finished and
    processing continues after its range; ``reset``: the last step did not finish (no attempt, or
    no output with its hash at the attempt's index) and its range is processed again."""

    outcome: RecoveryOutcome
    epoch: int
    hash: str | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    """One step. ``index`` is the output offset the outputs were written at (None for a
    nil-attempt or a sink). ``recovery`` is set when a write failed or went unanswered and the
    processor recovered instead of finishing the step (it may have finished after all: see
    ``recovery.outcome``)."""

    hash: str
    records: int
    outputs: int
    index: str | None = None
    recovery: Recovery | None = None


def snapshot_hash(processor: str, ranges: Mapping[str, tuple[str, str]]) -> str:
    """The hash of a snapshot: SHA-256 of the processor id and its non-empty input ranges (as
    compact, key-sorted JSON), first 32 hex digits. Stable across restarts and machines."""
    used = {s: [a, b] for s, (a, b) in sorted(ranges.items()) if a != b}
    text = json.dumps({"processor": processor, "inputs": used}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _encode(values: Iterable[Any]) -> bytes:
    return ("[" + ",".join(json.dumps(v, separators=(",", ":"), ensure_ascii=False) for v in values) + "]").encode()


def _unwrap(stream: str, value: Any, unwrap: bool) -> Record:
    if unwrap and isinstance(value, dict) and value.keys() == {"meta", "value"} and isinstance(value["meta"], dict):
        return Record(stream, value["value"], value["meta"])
    return Record(stream, value)


def _records(chunk: Chunk, unwrap: bool) -> list[Record]:
    if not chunk.data:
        return []
    if chunk.is_json:
        return [_unwrap(chunk.stream, v, unwrap) for v in chunk.messages()]
    return [Record(chunk.stream, chunk.data)]


def _check_name(what: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, not {value!r}")
    return value


def _is_write_failure(exc: OnceflowError) -> bool:
    """A conditional write that may or may not have happened, or lost a race: recover."""
    return isinstance(exc, PreconditionFailedError) or exc.retriable


class _Http:
    """The few requests the processors make, on one shared ``httpx.AsyncClient``. Reads and
    hints are retried while the server is away (up to ``retry_timeout`` seconds); conditional
    writes are not: the caller recovers instead."""

    def __init__(self, base_url: ServerURL, client: httpx.AsyncClient | None, retry_timeout: float) -> None:
        self.base_url = server_url(base_url).rstrip("/")
        self._api = request_url(self.base_url)  # what requests are addressed to (the same URL for one server)
        self.own = client is None
        self.client = client or async_http_client(self.base_url, timeout=httpx.Timeout(30.0, read=60.0))
        self.retry_timeout = retry_timeout
        self._handles: dict[str, AsyncStream] = {}

    def stream(self, name: str) -> AsyncStream:
        h = self._handles.get(name)
        if h is None:
            h = self._handles[name] = AsyncStream(stream_url(self.base_url, name), client=self.client)
        return h

    async def retry(self, op: Callable[[], Awaitable[T]]) -> T:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retry_timeout
        backoff = 0.05
        while True:
            try:
                return await op()
            except OnceflowError as exc:
                if not exc.retriable or loop.time() > deadline:
                    raise
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    async def ensure_json(self, name: str, what: str) -> str:
        """Create the JSON stream ``name`` if missing; its tail. A non-JSON stream is an error."""

        async def op() -> str:
            h = self.stream(name)
            try:
                info = await h.head()
            except StreamNotFoundError:
                info = await h.create(JSON)
            if not is_json_type(info.content_type):
                raise ProcessorError(f"the {what} {name!r} must be an application/json stream, not {info.content_type}")
            return info.next_offset

        return await self.retry(op)

    async def tail(self, name: str) -> str:
        async def op() -> str:
            return (await self.stream(name).head()).next_offset

        return await self.retry(op)

    async def read(self, name: str, offset: str, max_bytes: int | None = None) -> Chunk:
        url = stream_url(self._api, name)

        async def op() -> Chunk:
            try:
                resp = await self.client.get(url, params=read_params(offset, None, None, max_bytes))
            except httpx.TransportError as exc:
                raise TransportError(f"read {name}: {exc!r}") from exc
            return parse_chunk(name, offset, resp, f"read {name}")

        return await self.retry(op)

    async def wait_for_data(self, name: str, offset: str) -> None:
        """A long-poll read at ``offset`` (returns when data arrives or the poll times out)."""
        with contextlib.suppress(OnceflowError, httpx.TransportError):
            await self.client.get(stream_url(self._api, name), params=read_params(offset, "long-poll", None, 1))

    async def append(self, name: str, body: bytes, if_match: str) -> str:
        """One conditional append; the new tail. Raises on any failure (not retried)."""
        result = await self.stream(name).append(body, if_match=if_match)
        if result.next_offset is None:
            raise OnceflowError(f"append to {name} returned no offset", retriable=True)
        return result.next_offset

    def _group_url(self, group: str) -> str:
        return f"{self._api}/v1/groups/{group}/offsets"

    async def load_hint(self, group: str, stream: str) -> str:
        async def op() -> str:
            try:
                resp = await self.client.get(self._group_url(group))
            except httpx.TransportError as exc:
                raise TransportError(f"load the scan hint of {group}: {exc!r}") from exc
            if resp.status_code == 404:  # a server without group offsets: scan from the start
                return START
            if resp.status_code != 200:
                raise error_from_response(resp, f"load the scan hint of {group}")
            offsets: dict[str, str] = resp.json().get("offsets", {})
            return offsets.get(stream, START)

        return await self.retry(op)

    async def store_hint(self, group: str, stream: str, offset: str) -> bool:
        """Remember where a scan may start (only ever forward). A failure costs a longer scan on
        the next start, nothing else, so it is reported and not raised."""
        try:
            resp = await self.client.post(self._group_url(group), json={"offsets": {stream: offset}})
        except httpx.TransportError as exc:
            log.info("could not store the scan hint of %s: %r", group, exc)
            return False
        if resp.status_code != 200:
            log.info("could not store the scan hint of %s: HTTP %s", group, resp.status_code)
            return False
        return True

    async def close(self) -> None:
        if self.own:
            await self.client.aclose()


@dataclass
class _Scan:
    """The backing stream from the hint to its tail, as recovery needs it."""

    tail: str
    max_epoch: int = 0
    claim_nonce: str | None = None
    snapshot: dict[str, Any] | None = None
    attempt: dict[str, Any] | None = None  # the attempt or nil-attempt after the latest snapshot


class _Core:
    """The step machinery shared by stream and sink processors (both async)."""

    kind = "processor"

    def __init__(
        self,
        base_url: ServerURL,
        processor_id: str,
        *,
        inputs: Sequence[str],
        backing: str | None,
        max_read_bytes: int,
        client: httpx.AsyncClient | None,
        unwrap: bool,
        hint_every: int,
        retry_timeout: float,
        poll_interval: float,
    ) -> None:
        self.processor_id = _check_name("processor_id", processor_id)
        if isinstance(inputs, str) or not inputs:
            raise ValueError("inputs must be a non-empty list of stream names")
        self.inputs = [_check_name("an input", s) for s in inputs]
        if len(set(self.inputs)) != len(self.inputs):
            raise ValueError(f"inputs must be distinct: {self.inputs}")
        self.backing = _check_name("backing", backing or f"_cues/{processor_id}")
        if self.backing in self.inputs:
            raise ValueError(f"the backing stream {self.backing!r} cannot also be an input")
        if max_read_bytes < 1 or hint_every < 1:
            raise ValueError("max_read_bytes and hint_every must be positive")
        self.max_read_bytes = max_read_bytes
        self.unwrap = unwrap
        self.hint_every = hint_every
        self.poll_interval = poll_interval
        self.hint_group = f"cues.{processor_id}"
        self._http = _Http(base_url, client, retry_timeout)
        self._nonce = secrets.token_hex(8)
        self.epoch = 0
        self.positions: dict[str, str] = {s: START for s in self.inputs}
        self.recovery: Recovery | None = None
        self.steps = 0
        self._backing_tail = ""
        self._pinned: tuple[Snapshot, bool] | None = None  # a range to process again
        self._started = False
        self._closed = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.processor_id!r}, epoch={self.epoch})"

    # ------------------------------------------------------------------ start and recovery

    async def start(self) -> Recovery:
        """Claim the processor id (fencing older instances) and recover. Idempotent."""
        if self._closed:
            raise ProcessorError(f"{self!r} is closed")
        if self._started:
            assert self.recovery is not None
            return self.recovery
        await self._http.ensure_json(self.backing, "backing stream")
        await self._prepare()
        self.recovery = await self._recover(claim=True)
        self._started = True
        return self.recovery

    async def _prepare(self) -> None:
        """Hook: check or create the output before recovery."""

    async def _scan(self) -> _Scan:
        offset = await self._http.load_hint(self.hint_group, self.backing)
        scan = _Scan(tail=offset)
        while True:
            chunk = await self._http.read(self.backing, offset)
            before = offset
            for rec in chunk.messages() if chunk.data else []:
                if not isinstance(rec, dict):
                    raise ProcessorError(f"the backing stream {self.backing!r} holds {rec!r}, which no processor wrote")
                scan.max_epoch = max(scan.max_epoch, int(rec.get("epoch", 0)))
                kind = rec.get("type")
                if kind == "claim":
                    scan.claim_nonce = rec.get("nonce")
                elif kind == "snapshot":
                    scan.snapshot, scan.attempt = rec, None
                elif (
                    kind in ("attempt", "nil-attempt")
                    and scan.snapshot is not None
                    and rec.get("hash") == scan.snapshot["hash"]
                ):
                    scan.attempt = rec
            offset = chunk.next_offset
            if chunk.up_to_date or offset == before:
                scan.tail = offset
                return scan

    async def _claim(self) -> _Scan:
        for _ in range(20):
            scan = await self._scan()
            epoch = scan.max_epoch + 1
            body = _encode([{"type": "claim", "processor": self.processor_id, "epoch": epoch, "nonce": self._nonce}])
            try:
                await self._http.append(self.backing, body, scan.tail)
            except OnceflowError as exc:
                if not _is_write_failure(exc):
                    raise
                await asyncio.sleep(0.05)
                continue  # another writer moved the tail, or the answer was lost: look again
            self.epoch = epoch
            return await self._scan()
        raise ProcessorFencedError(
            f"{self.kind} {self.processor_id!r} could not claim its backing stream (other instances keep writing to it)"
        )

    async def _recover(self, *, claim: bool) -> Recovery:
        """Recovery (see the module docstring), numbered as in seed 000."""
        if claim:
            scan = await self._claim()
        else:
            scan = await self._scan()
        if scan.max_epoch > self.epoch:
            raise ProcessorFencedError(
                f"{self.kind} {self.processor_id!r} epoch {self.epoch} was fenced by epoch {scan.max_epoch}",
                epoch=self.epoch,
                current_epoch=scan.max_epoch,
            )
        self._backing_tail = scan.tail
        self._pinned = None
        await self._after_scan()
        # Step 1: the most recent snapshot and attempt maps
        snap = scan.snapshot
        if snap is None:
            self.positions = {s: START for s in self.inputs}
            return Recovery("fresh", self.epoch)
        ranges = {s: (str(r[0]), str(r[1])) for s, r in snap["inputs"].items()}
        snapshot = Snapshot(self.processor_id, ranges, str(snap["hash"]))
        ok = False
        attempt = scan.attempt
        if attempt is not None:
            # Step 1b-ii: a nil-attempt wrote nothing, so the step is done; Steps 2-3 otherwise
            ok = attempt["type"] == "nil-attempt" or await self._output_has(str(attempt["index"]), snapshot.hash)
        # Step 5
        if ok:  # 5a: continue after the range
            self.positions = {s: ranges[s][1] if s in ranges else START for s in self.inputs}
            return Recovery("resumed", self.epoch, snapshot.hash)
        # 5b: reset the inputs to the snapshot and process the same range again
        self.positions = {s: ranges[s][0] if s in ranges else START for s in self.inputs}
        self._pinned = (snapshot, True)
        return Recovery("reset", self.epoch, snapshot.hash)

    async def _after_scan(self) -> None:
        """Hook: refresh the output tail."""

    async def _output_has(self, index: str, hash_: str) -> bool:
        return False

    async def _recover_after(self, exc: OnceflowError) -> Recovery:
        log.info("%s %s: write failed (%r); recovering", self.kind, self.processor_id, exc)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._http.retry_timeout
        while True:
            try:
                return await self._recover(claim=False)
            except ProcessorFencedError:
                raise
            except OnceflowError as again:
                if not again.retriable or loop.time() > deadline:
                    raise
            await asyncio.sleep(0.2)

    # ------------------------------------------------------------------ steps

    def _check(self) -> None:
        if self._closed:
            raise ProcessorError(f"{self!r} is closed")
        if not self._started:
            raise ProcessorError(f"start() {self!r} first")

    async def _read_range(self, stream: str, start: str, end: str) -> list[Record]:
        """The records of exactly [start, end), batch by batch."""
        out: list[Record] = []
        offset = start
        while offset != end:
            chunk = await self._http.read(stream, offset, 1)
            if chunk.next_offset == offset or chunk.next_offset > end:
                raise ProcessorError(
                    f"input {stream!r} no longer holds the recorded range {start}..{end} "
                    f"(reached {chunk.next_offset}); was it deleted or recreated?"
                )
            out.extend(_records(chunk, self.unwrap))
            offset = chunk.next_offset
        return out

    async def _next_batch(self) -> Batch | None:
        if self._pinned is not None:
            snapshot, redelivery = self._pinned
            parts = await asyncio.gather(
                *(self._read_range(s, a, b) for s, (a, b) in snapshot.ranges.items() if s in self.inputs)
            )
            return Batch(snapshot, tuple(r for part in parts for r in part), redelivery)
        chunks = await asyncio.gather(
            *(self._http.read(s, self.positions[s], self.max_read_bytes) for s in self.inputs)
        )
        if not any(c.data for c in chunks):
            for c in chunks:  # moved past aborted or closing batches: nothing to process
                self.positions[c.stream] = c.next_offset
            return None
        ranges = {c.stream: (self.positions[c.stream], c.next_offset) for c in chunks}
        records = tuple(r for c in chunks for r in _records(c, self.unwrap))
        return Batch(Snapshot(self.processor_id, ranges, snapshot_hash(self.processor_id, ranges)), records)

    async def step(self) -> StepResult | None:
        """One processor step; None when no input had anything to process."""
        self._check()
        batch = await self._next_batch()
        if batch is None:
            return None
        snap = batch.snapshot
        snapshot_at = self._backing_tail
        record = {
            "type": "snapshot",
            "epoch": self.epoch,
            "hash": snap.hash,
            "inputs": {s: [a, b] for s, (a, b) in snap.ranges.items()},
        }
        # Steps 1-2: the snapshot map to the backing stream
        try:
            self._backing_tail = await self._http.append(self.backing, _encode([record]), self._backing_tail)
        except OnceflowError as exc:
            if not _is_write_failure(exc):
                raise
            return StepResult(snap.hash, len(batch.records), 0, recovery=await self._recover_after(exc))
        # Step 3: run the processor function (its exceptions propagate; the range is redone)
        self._pinned = (snap, True)  # until the step is complete, this range is what comes next
        outputs, count = await self._run_fn(batch)
        # Steps 4-8
        try:
            index = await self._finish(batch, outputs)
        except OnceflowError as exc:
            if not _is_write_failure(exc):
                raise
            return StepResult(snap.hash, len(batch.records), 0, recovery=await self._recover_after(exc))
        self._pinned = None
        self.positions = {s: snap.ranges[s][1] if s in snap.ranges else self.positions[s] for s in self.inputs}
        self.steps += 1
        if self.steps % self.hint_every == 0:
            await self._http.store_hint(self.hint_group, self.backing, snapshot_at)
        return StepResult(snap.hash, len(batch.records), count, index)

    async def _run_fn(self, batch: Batch) -> tuple[bytes | None, int]:
        """Step 3: run the function; the encoded outputs (None for none) and their number."""
        raise NotImplementedError

    async def _finish(self, batch: Batch, outputs: bytes | None) -> str | None:
        """Steps 4-8: record the attempt and write the outputs; the index written at."""
        raise NotImplementedError

    async def _wait_for_input(self, seconds: float) -> None:
        tasks = [asyncio.ensure_future(self._http.wait_for_data(s, self.positions[s])) for s in self.inputs]
        try:
            await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self, *, live: bool = False, max_steps: int | None = None, stop: asyncio.Event | None = None) -> int:
        """Step until the inputs are exhausted (``live=False``), or forever (``live=True``) until
        ``stop`` is set or ``max_steps`` steps were made; returns the number of steps."""
        await self.start()
        done = 0
        while max_steps is None or done < max_steps:
            if stop is not None and stop.is_set():
                break
            result = await self.step()
            if result is not None:
                done += 1
                continue
            if not live:
                break
            await self._wait_for_input(self.poll_interval)
        return done

    async def close(self) -> None:
        """Release the HTTP client. Never called back afterwards; a half-done step is recovered by
        the next instance."""
        self._closed = True
        await self._http.close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _maybe_await(value: T | Awaitable[T]) -> T:
    if inspect.isawaitable(value):
        return await value
    return value


class AsyncStreamProcessor(_Core):
    """An exactly-once stream processor: ``fn(batch)`` returns the output values of one step (an
    iterable; None or empty for none) and they are appended to ``output`` exactly once.

    ``fn`` may be a plain or an async function and is called again for a range whose step did not
    finish (``batch.redelivery``), so it should have no side effects outside its return value and
    must return JSON-serialisable values. Each output message is ``{"meta": {"hash": h,
    "processor": id}, "value": v}``; processors reading it get ``value`` and ``meta`` back apart
    (see :class:`Record`). The output stream is created as JSON when missing and must be written
    by this processor only. Nothing is called after :meth:`close`.
    """

    kind = "stream processor"

    def __init__(
        self,
        base_url: ServerURL,
        processor_id: str,
        *,
        inputs: Sequence[str],
        output: str,
        fn: ProcessFn,
        backing: str | None = None,
        max_read_bytes: int = 64 << 10,
        client: httpx.AsyncClient | None = None,
        unwrap: bool = True,
        hint_every: int = 100,
        retry_timeout: float = 60.0,
        poll_interval: float = 1.0,
    ) -> None:
        super().__init__(
            base_url,
            processor_id,
            inputs=inputs,
            backing=backing,
            max_read_bytes=max_read_bytes,
            client=client,
            unwrap=unwrap,
            hint_every=hint_every,
            retry_timeout=retry_timeout,
            poll_interval=poll_interval,
        )
        self.output = _check_name("output", output)
        if output in self.inputs or output == self.backing:
            raise ValueError(f"the output stream {output!r} cannot also be an input or the backing stream")
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        self.fn = fn
        self._output_tail = ""

    async def _prepare(self) -> None:
        self._output_tail = await self._http.ensure_json(self.output, "output stream")

    async def _after_scan(self) -> None:
        self._output_tail = await self._http.tail(self.output)

    async def _output_has(self, index: str, hash_: str) -> bool:
        if index == self._output_tail:  # nothing was written at the index
            return False
        chunk = await self._http.read(self.output, index, 1)
        first = chunk.messages()[0] if chunk.data else None
        return isinstance(first, dict) and isinstance(first.get("meta"), dict) and first["meta"].get("hash") == hash_

    async def _run_fn(self, batch: Batch) -> tuple[bytes | None, int]:
        result = await _maybe_await(self.fn(batch))
        if result is None:
            return None, 0
        if isinstance(result, str | bytes | dict):
            raise TypeError(
                f"{self.processor_id}: fn must return an iterable of output values (or None), "
                f"not {type(result).__name__}; wrap a single value in a list"
            )
        meta = {"hash": batch.hash, "processor": self.processor_id}
        values = list(result)
        try:
            body = _encode({"meta": meta, "value": v} for v in values)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{self.processor_id}: an output value is not JSON-serialisable: {exc}") from exc
        return (body, len(values)) if values else (None, 0)

    async def _finish(self, batch: Batch, outputs: bytes | None) -> str | None:
        # Steps 4-6: the index of the potential write, in the attempt map with the snapshot hash
        if outputs is None:
            attempt: dict[str, Any] = {"type": "nil-attempt", "epoch": self.epoch, "hash": batch.hash}
        else:
            attempt = {"type": "attempt", "epoch": self.epoch, "hash": batch.hash, "index": self._output_tail}
        # Step 7: the attempt map to the backing stream
        self._backing_tail = await self._http.append(self.backing, _encode([attempt]), self._backing_tail)
        if outputs is None:
            return None
        # Step 8: the outputs, at exactly that index, carrying the hash
        index = self._output_tail
        self._output_tail = await self._http.append(self.output, outputs, index)
        return index


class AsyncSinkProcessor(_Core):
    """A sink processor: ``fn(batch)`` writes the batch somewhere onceflow cannot see.

    At least once: ``fn`` runs once per input range, and again for a range whose completion was
    not recorded (after a crash, ``batch.redelivery`` is True). ``batch.hash`` is the same on every
    delivery of a range and different for every other range, so the target can store it with the
    data (a unique key, a conditional write) and skip a range it already has. Nothing is called
    after :meth:`close`.
    """

    kind = "sink processor"

    def __init__(
        self,
        base_url: ServerURL,
        processor_id: str,
        *,
        inputs: Sequence[str],
        fn: SinkFn,
        backing: str | None = None,
        max_read_bytes: int = 64 << 10,
        client: httpx.AsyncClient | None = None,
        unwrap: bool = True,
        hint_every: int = 100,
        retry_timeout: float = 60.0,
        poll_interval: float = 1.0,
    ) -> None:
        super().__init__(
            base_url,
            processor_id,
            inputs=inputs,
            backing=backing,
            max_read_bytes=max_read_bytes,
            client=client,
            unwrap=unwrap,
            hint_every=hint_every,
            retry_timeout=retry_timeout,
            poll_interval=poll_interval,
        )
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__}")
        self.fn = fn

    async def _run_fn(self, batch: Batch) -> tuple[bytes | None, int]:
        await _maybe_await(self.fn(batch))
        return None, 0

    async def _finish(self, batch: Batch, outputs: bytes | None) -> str | None:
        done = {"type": "nil-attempt", "epoch": self.epoch, "hash": batch.hash}
        self._backing_tail = await self._http.append(self.backing, _encode([done]), self._backing_tail)
        return None


class AsyncSource:
    """The entry of outside data: each :meth:`emit` appends values together with the position
    they came from (a file offset, an upstream cursor: any JSON value), in one conditional append.

    :meth:`start` returns the position of the last emit that reached the stream (None on a fresh
    stream), so the caller resumes reading its origin right after it: no value is lost or written
    twice as long as the origin can be re-read from a position. The source must be the only writer
    of ``output``; another writer's append makes the next emit fail with
    :class:`ProcessorFencedError`. Messages are ``{"meta": {"source": id, "position": p, "token":
    t}, "value": v}``.
    """

    def __init__(
        self,
        base_url: ServerURL,
        source_id: str,
        output: str,
        *,
        client: httpx.AsyncClient | None = None,
        hint_every: int = 100,
        retry_timeout: float = 60.0,
    ) -> None:
        self.source_id = _check_name("source_id", source_id)
        self.output = _check_name("output", output)
        if hint_every < 1:
            raise ValueError("hint_every must be positive")
        self.hint_every = hint_every
        self.hint_group = f"cues.{source_id}"
        self._http = _Http(base_url, client, retry_timeout)
        self._nonce = secrets.token_hex(8)
        self._count = 0
        self._tail = ""
        self.position: Any = None
        self._started = False

    def __repr__(self) -> str:
        return f"AsyncSource({self.source_id!r} -> {self.output!r})"

    async def start(self) -> Any:
        """Find the last position emitted (scanning from a stored hint to the tail)."""
        if self._started:
            return self.position
        await self._http.ensure_json(self.output, "output stream")
        offset = await self._http.load_hint(self.hint_group, self.output)
        while True:
            chunk = await self._http.read(self.output, offset)
            before = offset
            for msg in chunk.messages() if chunk.data else []:
                meta = msg.get("meta") if isinstance(msg, dict) else None
                if isinstance(meta, dict) and meta.get("source") == self.source_id:
                    self.position = meta.get("position")
            offset = chunk.next_offset
            if chunk.up_to_date or offset == before:
                break
        self._tail = offset
        self._started = True
        return self.position

    async def emit(self, values: Iterable[Any], position: Any) -> str:
        """Append ``values`` (at least one) with ``position``, atomically; returns the new tail."""
        if not self._started:
            raise ProcessorError(f"start() {self!r} first")
        self._count += 1
        token = f"{self._nonce}:{self._count}"
        meta = {"source": self.source_id, "position": position, "token": token}
        try:
            body = _encode({"meta": meta, "value": v} for v in values)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"source {self.source_id}: a value or the position is not JSON-serialisable: {exc}"
            ) from exc
        if body == b"[]":
            raise ValueError("emit() needs at least one value")
        before = self._tail
        while True:
            try:
                self._tail = await self._http.append(self.output, body, before)
                break
            except OnceflowError as exc:
                if not _is_write_failure(exc):
                    raise
            # the append was refused or its answer lost: what is at our tail now?
            chunk = await self._http.read(self.output, before, 1)
            first = chunk.messages()[0] if chunk.data else None
            if isinstance(first, dict) and isinstance(first.get("meta"), dict) and first["meta"].get("token") == token:
                self._tail = await self._http.tail(self.output)  # ours arrived (we are the only writer)
                break
            if chunk.data:
                raise ProcessorFencedError(f"source {self.source_id!r}: another writer appended to {self.output!r}")
            await asyncio.sleep(0.1)
        self.position = position
        if self._count % self.hint_every == 0:
            await self._http.store_hint(self.hint_group, self.output, before)
        return self._tail

    async def close(self) -> None:
        await self._http.close()

    async def __aenter__(self) -> AsyncSource:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _Blocking:
    """Runs an async processor's coroutines on the client's background loop."""

    _core: _Core

    @property
    def epoch(self) -> int:
        return self._core.epoch

    @property
    def positions(self) -> dict[str, str]:
        return dict(self._core.positions)

    def start(self) -> Recovery:
        return run_sync(self._core.start())

    def step(self) -> StepResult | None:
        return run_sync(self._core.step())

    def run(self, *, live: bool = False, max_steps: int | None = None) -> int:
        return run_sync(self._core.run(live=live, max_steps=max_steps))

    def close(self) -> None:
        run_sync(self._core.close())

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StreamProcessor(_Blocking):
    """The blocking twin of :class:`AsyncStreamProcessor` (same arguments); ``fn`` runs on the
    client's background thread."""

    def __init__(
        self,
        base_url: ServerURL,
        processor_id: str,
        *,
        inputs: Sequence[str],
        output: str,
        fn: ProcessFn,
        backing: str | None = None,
        max_read_bytes: int = 64 << 10,
        client: httpx.AsyncClient | None = None,
        unwrap: bool = True,
        hint_every: int = 100,
        retry_timeout: float = 60.0,
        poll_interval: float = 1.0,
    ) -> None:
        background_loop()
        self._core = AsyncStreamProcessor(
            base_url,
            processor_id,
            inputs=inputs,
            output=output,
            fn=fn,
            backing=backing,
            max_read_bytes=max_read_bytes,
            client=client,
            unwrap=unwrap,
            hint_every=hint_every,
            retry_timeout=retry_timeout,
            poll_interval=poll_interval,
        )


class SinkProcessor(_Blocking):
    """The blocking twin of :class:`AsyncSinkProcessor` (same arguments); ``fn`` runs on the
    client's background thread."""

    def __init__(
        self,
        base_url: ServerURL,
        processor_id: str,
        *,
        inputs: Sequence[str],
        fn: SinkFn,
        backing: str | None = None,
        max_read_bytes: int = 64 << 10,
        client: httpx.AsyncClient | None = None,
        unwrap: bool = True,
        hint_every: int = 100,
        retry_timeout: float = 60.0,
        poll_interval: float = 1.0,
    ) -> None:
        background_loop()
        self._core = AsyncSinkProcessor(
            base_url,
            processor_id,
            inputs=inputs,
            fn=fn,
            backing=backing,
            max_read_bytes=max_read_bytes,
            client=client,
            unwrap=unwrap,
            hint_every=hint_every,
            retry_timeout=retry_timeout,
            poll_interval=poll_interval,
        )


class Source:
    """The blocking twin of :class:`AsyncSource` (same arguments)."""

    def __init__(
        self,
        base_url: ServerURL,
        source_id: str,
        output: str,
        *,
        client: httpx.AsyncClient | None = None,
        hint_every: int = 100,
        retry_timeout: float = 60.0,
    ) -> None:
        background_loop()
        self._core = AsyncSource(
            base_url, source_id, output, client=client, hint_every=hint_every, retry_timeout=retry_timeout
        )

    @property
    def position(self) -> Any:
        return self._core.position

    def start(self) -> Any:
        return run_sync(self._core.start())

    def emit(self, values: Iterable[Any], position: Any) -> str:
        return run_sync(self._core.emit(list(values), position))

    def close(self) -> None:
        run_sync(self._core.close())

    def __enter__(self) -> Source:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
