"""Idempotent producers: pipelined, batched, retried without duplicates.

How a message travels
    1. ``append(data)`` encodes it and adds it to the open batch (thread-safe, never blocks, never
       does I/O). A batch is sealed, and given the next sequence number, when it reaches
       ``max_batch_bytes``, when a request slot is free and ``linger_ms`` is 0 (send at once when
       idle; accumulate while ``max_in_flight`` requests are out), after ``linger_ms``, or on flush.
    2. Up to ``max_in_flight`` sealed batches are sent at once, each as one POST carrying
       ``(Producer-Id, Producer-Epoch, Producer-Seq)``.
    3. 200 and 204 (a duplicate: the server already had it) are success. Timeouts, dropped
       connections, 5xx and 429 are retried with the *same* triple after a backoff, until
       ``delivery_timeout``. A 409 sequence gap means a later batch overtook an earlier one on
       another connection: it waits until the earlier ones are acknowledged and is resent, so the
       stream keeps the append order and nothing is skipped.
    4. Anything else (400, 404, 409 closed, 413, a 403 fence) fails the producer: ``on_error`` is
       called for each batch that will never be delivered, and ``append``/``flush`` raise.
    5. A batch still without a definite answer at ``delivery_timeout`` fails the producer too. If
       any of its requests may have reached the server (anything but a refused connection), the
       error is :class:`OutcomeUnknownError`: the batch may be in the stream (its answer was lost)
       or may still land (a request under way). Otherwise it is a plain ``TransportError``: it is not.

``compression`` (``"gzip"`` or ``"zstd"``): each batch of 1 KiB or more is compressed once, before its
first request, and every retry sends the same bytes (the server deduplicates on the sequence number,
and decodes before it looks at the content: a retry would be deduplicated either way).

``idempotent=False`` (Kafka's ``enable.idempotence=false``) sends the same batches without producer
headers: retries are then at-least-once (a lost acknowledgement means a duplicate) and batches in
flight together may land in any order. It exists for comparison; keep the default.

Epochs: a producer id with a stable epoch dedups retries across the producer's own restarts only if
the epoch moves on at each restart (otherwise a restarted producer's seq 0 looks like an old
duplicate and is dropped). So: give ``epoch`` yourself, or ``epoch_file`` (read, bumped and synced at
start), or let onceflow choose a time-based epoch. The id is ``producer_id``, else the environment's
``ONCEFLOW_PRODUCER_ID``, else a fresh random one (then epoch 0).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from .._backoff import backoff
from .._files import replace_file
from ._errors import (
    BadRequestError,
    OnceflowError,
    OutcomeUnknownError,
    ProducerFencedError,
    SequenceGapError,
    TransportError,
    error_from_response,
)
from ._loop import background_loop, run_sync
from .lowlevel import (
    Coding,
    ServerURL,
    async_http_client,
    check_compression,
    encode_body,
    is_json_type,
    request_url,
    server_url,
    stream_url,
)

__all__ = ["AsyncIdempotentProducer", "IdempotentProducer", "ProducerStats"]

# transport errors raised before a byte of the request could have reached the server
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)

ErrorCallback = Callable[[OnceflowError, int], None]


@dataclass(slots=True)
class ProducerStats:
    appended: int = 0  # messages handed to append()
    acked: int = 0  # messages acknowledged (stored)
    batches_sent: int = 0  # POSTs that were acknowledged
    requests: int = 0  # POSTs attempted, retries included
    retries: int = 0
    duplicates: int = 0  # acknowledgements that said "already stored" (a retry of a lost ack)
    gaps: int = 0  # batches resent because an earlier one had not landed yet
    failed: int = 0  # messages that will never be delivered
    body_bytes: int = 0  # request body bytes sent, as sent (compressed with compression=), retries included


class _Batch:
    __slots__ = ("body", "coded", "count", "seq")

    def __init__(self, seq: int, body: bytes, count: int) -> None:
        self.seq = seq
        self.body = body
        self.count = count
        self.coded: dict[str, str] | None = None  # Content-Encoding once the body is as it is sent

    async def encode(self, compression: Coding | None) -> dict[str, str]:
        """Compress the body for its first request (:func:`~onceflow.client.lowlevel.encode_body`),
        on a thread when it is large (zlib and zstd let go of the GIL: the event loop and the
        threads that append go on meanwhile); the headers that say how it is coded."""
        if self.coded is not None:
            return self.coded
        if compression is not None and len(self.body) > _INLINE_CODING:
            body, coded = await asyncio.to_thread(encode_body, self.body, compression)
        else:
            body, coded = encode_body(self.body, compression)
        self.body, self.coded = body, coded
        return coded


_INLINE_CODING = 64 << 10  # a larger batch is compressed off the event loop's thread


def _epoch_from_file(path: Path) -> int:
    """Read the last epoch from ``path``, bump it, persist it durably, return it."""
    try:
        last = int(path.read_text().strip() or "-1")
    except FileNotFoundError:
        last = -1
    epoch = last + 1
    replace_file(path, str(epoch).encode())
    return epoch


class AsyncIdempotentProducer:
    """An idempotent producer for one stream, running on the current event loop.

    ``append`` is synchronous and non-blocking (call it from any thread); ``flush``, ``close`` and the
    sending run on the loop that ``start`` ran on. Use ``async with`` or ``start``/``close``.
    """

    def __init__(
        self,
        url: ServerURL,
        stream: str | None = None,
        *,
        producer_id: str | None = None,
        epoch: int | None = None,
        epoch_file: str | Path | None = None,
        auto_claim: bool = False,
        idempotent: bool = True,
        content_type: str | None = None,
        max_batch_bytes: int = 1 << 20,
        linger_ms: float = 0.0,
        max_in_flight: int = 5,
        retry_backoff: tuple[float, float] = (0.05, 2.0),
        delivery_timeout: float = 120.0,
        request_timeout: float = 30.0,
        on_error: ErrorCallback | None = None,
        client: httpx.AsyncClient | None = None,
        compression: Coding | None = None,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.compression = check_compression(compression)
        url = server_url(url)
        self.url = stream_url(url, stream) if stream is not None else url
        self._target = request_url(self.url)  # what requests are addressed to (the same URL for one server)
        producer_id = producer_id or os.environ.get("ONCEFLOW_PRODUCER_ID") or None
        self.producer_id = producer_id or f"py-{uuid.uuid4()}"
        if epoch is not None:
            self.epoch = epoch
        elif epoch_file is not None:
            self.epoch = _epoch_from_file(Path(epoch_file))
        elif producer_id is not None:
            self.epoch = int(time.time() * 1000)  # a restart of a named producer must not reuse an epoch
        else:
            self.epoch = 0
        self.auto_claim = auto_claim
        self.idempotent = idempotent
        self.content_type = content_type
        self.max_batch_bytes = max_batch_bytes
        self.linger = linger_ms / 1000.0
        self.max_in_flight = max_in_flight
        self.retry_backoff = retry_backoff
        self.delivery_timeout = delivery_timeout
        self.on_error = on_error
        self.stats = ProducerStats()
        self._own_client = client is None
        self._client = client or async_http_client(
            self.url,
            timeout=request_timeout,
            limits=httpx.Limits(max_connections=max_in_flight + 2, max_keepalive_connections=max_in_flight + 2),
        )
        self._lock = threading.Lock()
        self._current: list[bytes] = []
        self._current_bytes = 0
        self._current_since = 0.0
        self._sealed: deque[_Batch] = deque()
        self._next_seq = 0
        self._acked_through = -1  # every seq <= this is acknowledged
        self._acked_above: set[int] = set()
        self._in_flight: dict[asyncio.Task[None], None] = {}  # an ordered set: cancelled in the order sent
        self._flushing = 0
        self._error: OnceflowError | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._wake_event: asyncio.Event | None = None
        self._wake_pending = False
        self._progress: asyncio.Event | None = None
        self._sender: asyncio.Task[None] | None = None
        self._json = content_type is not None and is_json_type(content_type)
        self._acked_in_epoch = False
        self._maybe_stored_in_epoch = False  # a request of this epoch got no definite answer

    def _now(self) -> float:
        """The clock of the loop the producer runs on (monotonic; the simulator's, in a simulation)."""
        loop = self._loop
        return loop.time() if loop is not None else time.monotonic()

    @property
    def _sep(self) -> int:
        return 1 if self._json else 0  # the comma between JSON messages in a batch body

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Bind to the running loop (and learn the stream's content type if not given)."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._wake_event = asyncio.Event()
        self._progress = asyncio.Event()
        if self.content_type is None:
            try:
                resp = await self._client.head(self._target)
            except httpx.TransportError as exc:
                raise TransportError(f"head {self.url}: {exc!r}") from exc
            if resp.status_code != 200:
                raise error_from_response(resp, f"producer for {self.url}")
            self.content_type = resp.headers.get("content-type", "application/octet-stream")
            self._json = is_json_type(self.content_type)
        self._sender = self._loop.create_task(self._send_loop())

    async def __aenter__(self) -> AsyncIdempotentProducer:
        await self.start()
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        await self.close(flush=exc_type is None)

    async def close(self, *, flush: bool = True) -> None:
        """Flush (unless ``flush=False``), stop sending and release the HTTP client.

        Whatever is then still undelivered is reported to ``on_error`` (and counted in
        ``stats.failed``): with ``flush=False``, or after the producer failed.
        """
        try:
            if flush and self._loop is not None and self._error is None:
                await self.flush()
        finally:
            if self._loop is not None:
                self._fail(
                    OnceflowError("the producer was closed before this was acknowledged", code="producer_closed")
                )
            if self._sender is not None:
                self._sender.cancel()
            for t in list(self._in_flight):
                t.cancel()  # each reports its batch as it unwinds (see _send)
            if self._in_flight:
                await asyncio.gather(*self._in_flight, return_exceptions=True)
            if self._own_client:
                await self._client.aclose()

    # ------------------------------------------------------------------ appending

    @property
    def pending_count(self) -> int:
        """Messages appended but not yet acknowledged (queued, batched or in flight)."""
        return self.stats.appended - self.stats.acked - self.stats.failed

    @property
    def in_flight_count(self) -> int:
        """Requests currently out."""
        return len(self._in_flight)

    def _encode(self, data: bytes | str | Any) -> bytes:
        if type(data) is bytes:  # the fast path: pre-encoded messages
            return data
        if isinstance(data, bytearray | memoryview):
            return bytes(data)
        if self._json:
            return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
        if isinstance(data, str):
            return data.encode()
        kind = type(data)
        raise TypeError(f"cannot append {kind.__name__} to a non-JSON stream; pass bytes or str")

    def append(self, data: bytes | str | Any) -> None:
        """Queue one message; never blocks. Bytes are sent as they are (JSON text on JSON streams);
        other values become one JSON message on a JSON stream. Raises the producer's error if it failed."""
        if self._error is not None:
            raise self._error
        encoded = self._encode(data)
        with self._lock:
            if not self._current:
                self._current_since = self._now()
            self._current.append(encoded)
            self._current_bytes += len(encoded) + self._sep
            self.stats.appended += 1
            sealed = self._current_bytes >= self.max_batch_bytes
            if sealed:
                self._seal_locked()
            wake = (sealed or not self._in_flight) and not self._wake_pending
            if wake:
                self._wake_pending = True
        if wake:
            self._wake()

    def extend(self, values: Iterable[bytes | str | Any]) -> None:
        """Queue many messages at once: the same as ``append`` for each, with one lock and wake-up."""
        if self._error is not None:
            raise self._error
        encoded = [self._encode(v) for v in values]
        if not encoded:
            return
        sep = self._sep
        with self._lock:
            if not self._current:
                self._current_since = self._now()
            sealed = False
            for e in encoded:
                self._current.append(e)
                self._current_bytes += len(e) + sep
                if self._current_bytes >= self.max_batch_bytes:
                    self._seal_locked()
                    sealed = True
            self.stats.appended += len(encoded)
            wake = (sealed or not self._in_flight) and not self._wake_pending
            if wake:
                self._wake_pending = True
        if wake:
            self._wake()

    def _wake(self) -> None:
        ev, loop = self._wake_event, self._loop
        if ev is None or loop is None:
            return  # not started yet: start() will send what accumulated
        if threading.get_ident() == self._loop_thread:
            ev.set()
        else:
            loop.call_soon_threadsafe(ev.set)

    def _seal_locked(self) -> None:
        msgs, self._current, self._current_bytes = self._current, [], 0
        if self._json:
            body = b"[" + b",".join(msgs) + b"]"
        else:
            body = b"".join(msgs)
        self._sealed.append(_Batch(self._next_seq, body, len(msgs)))
        self._next_seq += 1

    async def wait_for_capacity(self, max_pending: int) -> None:
        """Wait until at most ``max_pending`` messages are unacknowledged: backpressure for callers
        that produce faster than the server takes (``append`` itself never blocks)."""
        assert self._progress is not None, "start() the producer first"
        while self.pending_count > max_pending:
            if self._error is not None:
                raise self._error
            await self._progress.wait()

    async def flush(self, timeout: float | None = None) -> None:
        """Send everything appended so far and wait until it is acknowledged (or raise)."""
        assert self._progress is not None, "start() the producer first"
        with self._lock:
            target = self.stats.appended
        self._flushing += 1
        try:
            self._wake()
            deadline = None if timeout is None else self._now() + timeout
            while self.stats.acked + self.stats.failed < target:
                if self._error is not None:
                    raise self._error
                ev = self._progress
                if deadline is None:
                    await ev.wait()
                    continue
                remaining = deadline - self._now()
                if remaining <= 0:
                    raise TimeoutError(f"flush: {target - self.stats.acked} message(s) still unacknowledged")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ev.wait(), remaining)
            if self._error is not None:
                raise self._error
        finally:
            self._flushing -= 1

    # ------------------------------------------------------------------ sending

    async def _send_loop(self) -> None:
        assert self._wake_event is not None and self._loop is not None
        while True:
            await self._wake_event.wait()
            self._wake_event.clear()
            with self._lock:
                self._wake_pending = False
                delay = self._dispatch_locked()
            if delay is not None:
                self._loop.call_later(delay, self._wake)

    def _dispatch_locked(self) -> float | None:
        """Start batches while slots are free; the seconds until linger ends, if that must be waited.

        Full batches go whenever a slot is free. The open batch goes when nothing is in flight
        ("send at once when idle"; after ``linger_ms`` if set), while requests are out only once
        ``linger_ms`` (if set) has passed, and always when flushing.
        """
        assert self._loop is not None
        while len(self._in_flight) < self.max_in_flight and self._error is None:
            if not self._sealed:
                if not self._current:
                    return None
                if not self._flushing:
                    if self._in_flight and not self.linger:
                        return None  # accumulate; a completing request wakes us
                    waited = self._now() - self._current_since
                    if self.linger and waited < self.linger:
                        return self.linger - waited
                self._seal_locked()
            batch = self._sealed.popleft()
            task = self._loop.create_task(self._send(batch))
            self._in_flight[task] = None
            task.add_done_callback(self._batch_done)
        return None

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        self._in_flight.pop(task, None)
        self._wake()

    def _signal_progress(self) -> None:
        assert self._progress is not None
        self._progress.set()
        self._progress = asyncio.Event()

    async def _wait_acked(self, seq: int) -> None:
        while self._acked_through < seq and self._error is None:
            assert self._progress is not None
            await self._progress.wait()

    async def _send(self, batch: _Batch) -> None:
        try:
            await self._deliver(batch)
        except asyncio.CancelledError:
            self._fail_batch(batch, self._error or OnceflowError("the producer was closed", code="producer_closed"))
            raise

    async def _deliver(self, batch: _Batch) -> None:
        started = self._now()
        attempt = 0
        reached = False  # some request for this batch may have reached the server unanswered
        task = asyncio.current_task()
        while True:
            if self._error is not None:
                self._fail_batch(batch, self._error)
                return
            epoch = self.epoch
            headers = {
                "content-type": self.content_type or "application/octet-stream",
                **await batch.encode(self.compression),
            }
            if self.idempotent:
                headers["producer-id"] = self.producer_id
                headers["producer-epoch"] = str(epoch)
                headers["producer-seq"] = str(batch.seq)
            self.stats.requests += 1
            self.stats.body_bytes += len(batch.body)
            err: OnceflowError
            try:
                resp = await self._client.post(self._target, content=batch.body, headers=headers)
            except httpx.TransportError as exc:
                err = TransportError(f"append to {self.url}: {exc!r}")
                # a follower's answer (NoServerError.answered) means it was carried to a server
                if not isinstance(exc, _NOT_SENT) or getattr(exc, "answered", False):
                    reached = True
                    self._note_maybe_stored(epoch)
            else:
                if resp.status_code in (200, 204):
                    if task is not None:
                        self._in_flight.pop(task, None)  # before waking flush(), so in_flight_count is 0 then
                    self._ack(batch, duplicate=resp.status_code == 204)
                    return
                err = error_from_response(resp, f"append to {self.url}")
                if isinstance(err, ProducerFencedError) and epoch < self.epoch:
                    continue  # answered for an epoch this producer has since claimed past: resend
                reordered = (isinstance(err, SequenceGapError) and err.expected_seq < batch.seq) or (
                    isinstance(err, BadRequestError) and err.code == "invalid_epoch_seq" and batch.seq > 0
                )
                if reordered and self._acked_through < batch.seq - 1:
                    self.stats.gaps += 1  # overtook an earlier batch: resend once that one has landed
                    await self._wait_acked(batch.seq - 1)
                    continue
                if isinstance(err, ProducerFencedError) and self._claim(err):
                    continue
                if isinstance(err, ProducerFencedError) and self.auto_claim and self._maybe_stored_in_epoch:
                    err = ProducerFencedError(
                        f"{err.message} (not claimed: a request of epoch {epoch} may have been stored unanswered, "
                        "and claiming would send it again)",
                        status=err.status,
                        code=err.code,
                        current_epoch=err.current_epoch,
                    )
                if not err.retriable:
                    self._fail(err)
                    self._fail_batch(batch, err)
                    return
                if err.status is not None and err.status >= 500:
                    reached = True
                    self._note_maybe_stored(epoch)
            if self._now() - started > self.delivery_timeout:
                if reached:
                    err = OutcomeUnknownError(
                        f"gave up after {self.delivery_timeout:g} s without a definite answer ({err.message}): the batch "
                        "may or may not have been stored",
                        status=err.status,
                        code="outcome_unknown",
                    )
                else:
                    err = TransportError(f"gave up after {self.delivery_timeout:g} s: {err.message}", status=err.status)
                self._fail(err)
                self._fail_batch(batch, err)
                return
            attempt += 1
            self.stats.retries += 1
            await asyncio.sleep(backoff(attempt, *self.retry_backoff))

    def _note_maybe_stored(self, epoch: int) -> None:
        if epoch == self.epoch:
            self._maybe_stored_in_epoch = True

    def _claim(self, err: ProducerFencedError) -> bool:
        """Auto-claim (opt-in): before anything was acknowledged in this epoch, move past the
        server's epoch and start again at seq 0. Later it would mean renumbering acknowledged
        history, so a fence after that is final. So is a fence after a request of this epoch got
        no definite answer: it may have been stored, and claiming would store it again."""
        if not self.auto_claim or self._acked_in_epoch or self._maybe_stored_in_epoch or err.current_epoch is None:
            return False
        if self.epoch <= err.current_epoch:
            self.epoch = err.current_epoch + 1
        return True

    def _ack(self, batch: _Batch, *, duplicate: bool) -> None:
        self._acked_in_epoch = True
        self.stats.batches_sent += 1
        self.stats.acked += batch.count
        if duplicate:
            self.stats.duplicates += 1
        if batch.seq == self._acked_through + 1:
            self._acked_through = batch.seq
            while self._acked_through + 1 in self._acked_above:
                self._acked_above.discard(self._acked_through + 1)
                self._acked_through += 1
        else:
            self._acked_above.add(batch.seq)
        self._signal_progress()

    def _fail(self, err: OnceflowError) -> None:
        """Fail the producer: everything not yet sent is reported undeliverable now, and what is
        in flight when its request ends."""
        if self._error is None:
            self._error = err
        with self._lock:
            dropped = list(self._sealed)
            self._sealed.clear()
            if self._current:
                dropped.append(_Batch(-1, b"", len(self._current)))
                self._current, self._current_bytes = [], 0
        for b in dropped:
            self._fail_batch(b, self._error)
        self._signal_progress()

    def _fail_batch(self, batch: _Batch, err: OnceflowError) -> None:
        self.stats.failed += batch.count
        if self.on_error is not None:
            self.on_error(err, batch.count)
        self._signal_progress()


class IdempotentProducer:
    """The blocking twin of :class:`AsyncIdempotentProducer` (same arguments).

    ``append`` never blocks; the sending runs on onceflow's background event loop. Use it as a
    context manager, or call ``close()``: both flush first.
    """

    def __init__(
        self,
        url: ServerURL,
        stream: str | None = None,
        *,
        producer_id: str | None = None,
        epoch: int | None = None,
        epoch_file: str | Path | None = None,
        auto_claim: bool = False,
        idempotent: bool = True,
        content_type: str | None = None,
        max_batch_bytes: int = 1 << 20,
        linger_ms: float = 0.0,
        max_in_flight: int = 5,
        retry_backoff: tuple[float, float] = (0.05, 2.0),
        delivery_timeout: float = 120.0,
        request_timeout: float = 30.0,
        on_error: ErrorCallback | None = None,
        client: httpx.AsyncClient | None = None,
        compression: Coding | None = None,
    ) -> None:
        background_loop()
        self._core = AsyncIdempotentProducer(
            url,
            stream,
            producer_id=producer_id,
            epoch=epoch,
            epoch_file=epoch_file,
            auto_claim=auto_claim,
            idempotent=idempotent,
            content_type=content_type,
            max_batch_bytes=max_batch_bytes,
            linger_ms=linger_ms,
            max_in_flight=max_in_flight,
            retry_backoff=retry_backoff,
            delivery_timeout=delivery_timeout,
            request_timeout=request_timeout,
            on_error=on_error,
            client=client,
            compression=compression,
        )
        run_sync(self._core.start())

    @property
    def producer_id(self) -> str:
        return self._core.producer_id

    @property
    def epoch(self) -> int:
        return self._core.epoch

    @property
    def stats(self) -> ProducerStats:
        return self._core.stats

    @property
    def pending_count(self) -> int:
        return self._core.pending_count

    @property
    def in_flight_count(self) -> int:
        return self._core.in_flight_count

    def append(self, data: bytes | str | Any) -> None:
        self._core.append(data)

    def extend(self, values: Iterable[bytes | str | Any]) -> None:
        self._core.extend(values)

    def wait_for_capacity(self, max_pending: int) -> None:
        run_sync(self._core.wait_for_capacity(max_pending))

    def flush(self, timeout: float | None = None) -> None:
        run_sync(self._core.flush(timeout))

    def close(self, *, flush: bool = True) -> None:
        run_sync(self._core.close(flush=flush))

    def __enter__(self) -> IdempotentProducer:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(flush=exc_type is None)
