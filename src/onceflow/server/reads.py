"""Reads of a stream (``GET /v1/stream/<name>``): catch-up, long-poll and SSE live tails, the
``format=`` answers, their coding and their caching headers (docs/protocol.md). A mixin of
:class:`~onceflow.server.app.App`, which gives it the broker and the configuration; live SSE
readers of a stream share one read of it (:class:`SseEvents`)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import random
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from ..core.broker import Broker, ReadResult, StreamState
from ..core.jsonmode import wrap_payloads
from ..storage.log import InvalidPosition, LogClosed, OffsetGone
from ..storage.position import Position, parse_token
from ..wire import FRAME, MAX_SAFE_INT, RECORDS_MEDIA_TYPE, Coding, compress
from .answering import (
    _DIGITS,
    COMMON,
    BadRequest,
    Receive,
    Scope,
    Send,
    _json_response,
    _sandboxed,
    _send,
)
from .coding import accepted_coding

if TYPE_CHECKING:
    from .app import AppConfig

__all__ = ["CURSOR_EPOCH", "CURSOR_INTERVAL", "Reads", "SseEvents", "make_cursor"]

log = logging.getLogger("onceflow.server")


_LINES = re.compile(r"\r\n|\r|\n")


CURSOR_EPOCH = 1728432000.0  # 2024-10-09T00:00:00Z, the protocol's default cursor epoch


CURSOR_INTERVAL = 20


def make_cursor(client_cursor: str | None) -> str:
    """The protocol's interval cursor, strictly greater than any cursor the client echoes."""
    current = int((time.time() - CURSOR_EPOCH) // CURSOR_INTERVAL)
    if client_cursor and _DIGITS.match(client_cursor):
        given = int(client_cursor)
        if given >= current:
            jitter = random.randint(1, 3600)  # noqa: S311 - cache-busting, not security
            return str(given + max(1, math.ceil(jitter / CURSOR_INTERVAL)))
    return str(current)


@dataclass(frozen=True, slots=True)
class _ReadQuery:
    """A read's checked query parameters."""

    offset: str | None
    live: str | None
    cursor: str | None
    committed: bool
    max_bytes: int | None


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_result(False)


class SseEvents:
    """The SSE events of recent reads, encoded once and shared by every live reader at the same
    place: with a thousand readers following one stream, each new message was read, split and
    encoded a thousand times.

    A read is cached under (stream, start, where reads end, tail, read_committed, text, closed). Data
    below the end of what is visible no longer changes (it is durable, and with read_committed every
    transaction below the last stable offset is decided), so two reads with that key are the same
    read. A read below the earliest offset kept is not cached: the broker answers it (410). Both
    caches are emptied whenever they pass their bounds (entries and bytes)."""

    MAX_ENTRIES = 4096
    MAX_BYTES = 64 << 20

    def __init__(self) -> None:
        self._reads: dict[tuple[object, ...], tuple[Position, bool, bool, bytes]] = {}
        self._bytes = 0
        self._controls: dict[tuple[object, ...], bytes] = {}

    async def read(
        self, broker: Broker, s: StreamState, at: Position, committed: bool, text: bool
    ) -> tuple[Position, bool, bool, bytes] | None:
        """(next, up to date, closed, the data event or b"") of a read at ``at``; None when ``at``
        is not a record boundary. A read that waits for the store (:meth:`Broker.aread`) is kept
        under the key it had when it began: what it returns is the stream as it was then."""
        end = broker.visible_end(s, committed)
        key = (s, at.pos, end.pos, s.tail.pos, committed, text, s.closed)
        hit = self._reads.get(key)
        if hit is not None and at.pos >= s.earliest.pos:
            return hit
        try:
            result = await broker.aread(s, at, committed=committed)
        except InvalidPosition:  # OffsetGone too (retention overtook it): the response ends
            return None
        # a read of only transaction markers (no message: count 0) moves the reader on by its
        # control event alone; a data event of nothing would reach a client as an empty batch
        holds = any(b.header.count for b in result.batches)
        data = _sse_event("data", _sse_payload(s, result, text)) if holds else b""
        value = (result.next, result.up_to_date, result.closed, data)
        if len(self._reads) >= self.MAX_ENTRIES or self._bytes + len(data) > self.MAX_BYTES:
            self._reads.clear()
            self._bytes = 0
        self._reads[key] = value
        self._bytes += len(data)
        return value

    def control(self, nxt: Position, up_to_date: bool, closed: bool, cursor: str) -> bytes:
        """The control event after a read (its cursor made by :func:`make_cursor`). Shared by the
        readers of every stream: keyed by the whole position, as streams that end at one byte
        position may have different record offsets there."""
        key = (nxt.offset, nxt.pos, up_to_date, closed, cursor)
        event = self._controls.get(key)
        if event is None:
            event = _sse_event("control", _control(ReadResult([], nxt, up_to_date, closed), cursor))
            if len(self._controls) >= self.MAX_ENTRIES:
                self._controls.clear()
            self._controls[key] = event
        return event


_VARY = (b"vary", b"accept-encoding")


_INLINE_CODING = 64 << 10  # a larger answer is compressed off the event loop's thread


async def _coded(
    status: int, h: list[tuple[bytes, bytes]], body: bytes, coding: Coding | None
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The answer with its body in ``coding`` and ``Content-Encoding`` saying so; as it is when
    ``coding`` is None or does not make it smaller (random bytes, data compressed before), its
    ETag strong again then.

    A body of more than ``_INLINE_CODING`` bytes (a read answers up to 4 MiB, which gzip takes
    ~20 ms to compress) is compressed on a thread of the default executor, as zlib and zstd let go
    of the GIL while they work: the event loop serves other requests meanwhile."""
    if coding is None or not body:
        return status, h, body
    if len(body) <= _INLINE_CODING:
        packed = compress(body, coding)
    else:
        packed = await asyncio.get_running_loop().run_in_executor(None, compress, body, coding)
    if len(packed) >= len(body):
        return status, [(k, v.removeprefix(b"W/") if k == b"etag" else v) for k, v in h], body
    return status, [*h, (b"content-encoding", coding.encode())], packed


def _etag_matches(if_none_match: str, etag: bytes) -> bool:
    """Whether ``If-None-Match`` names ``etag``, by the weak comparison the RFC prescribes for it
    (9110 13.1.2): ``W/"x"`` matches ``"x"``, so a client that holds the compressed answer (whose
    tag is weak) revalidates it as one that holds the plain one does."""
    tag = etag.decode()
    return any(t.strip().removeprefix("W/") == tag for t in if_none_match.split(","))


def _etag(s: StreamState, start: str, end: Position, closed: bool) -> bytes:
    ident = f"{s.meta.created_ms:x}"
    if start == "-1" and s.log.first != s.log.base:  # retention moved where "-1" begins
        start = s.earliest.token()
    return f'"{ident}:{start}:{end.token()}{":c" if closed else ""}"'.encode()


def _body_of(s: StreamState, result: ReadResult) -> bytes:
    payloads = [b.payload for b in result.batches]
    if s.is_json:
        return wrap_payloads(payloads)
    return payloads[0] if len(payloads) == 1 else b"".join(payloads)


def _sse_payload(s: StreamState, result: ReadResult, text: bool) -> str:
    raw = _body_of(s, result)
    if not text:
        return base64.b64encode(raw).decode()
    return raw.decode("utf-8", "replace")


def _sse_event(kind: str, data: str) -> bytes:
    """One SSE event. Parsers drop one space after ``data:``, so a line that itself starts with a
    space gets an extra one; other lines go as ``data:line`` (the form the conformance suite expects)."""
    lines = _LINES.split(data)
    return (
        f"event: {kind}\n"
        + "".join(f"data: {line}\n" if line[:1] == " " else f"data:{line}\n" for line in lines)
        + "\n"
    ).encode()


def _control(result: ReadResult, cursor: str) -> str:
    """The control event's JSON; ``cursor`` is the one :func:`make_cursor` gave."""
    ctl: dict[str, object] = {"streamNextOffset": result.next.token()}
    if result.closed:
        ctl["streamClosed"] = True
        ctl["upToDate"] = True
    else:
        ctl["streamCursor"] = cursor
        if result.up_to_date:
            ctl["upToDate"] = True
    return json.dumps(ctl, separators=(",", ":"))


class Reads:
    broker: Broker
    config: AppConfig
    _sse_events: SseEvents

    # ------------------------------------------------------------------ GET

    async def _get(self, name: str, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> None:
        send = _sandboxed(send)
        params = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        q = self._read_query(params)
        s = self.broker.get(name)
        if s is None:
            raise BadRequest(f"no stream named {name!r}", 404, "not_found")
        if s.meta.soft_deleted:
            raise BadRequest(f"stream {name!r} was deleted", 410, "gone")
        try:
            # a read of bytes the PostgreSQL store must fetch from its database lets other requests
            # run while it waits (Broker.aread): the stream may change meanwhile, and be deleted
            start = await self.broker.aresolve_start(s, q.offset, committed=q.committed)
            if isinstance(start, str):
                raise BadRequest(start)
            s.touch()
            fmt = params.get("format", [None])[0]
            if fmt is not None:
                if q.live is not None:
                    raise BadRequest("format= reads are not live; leave out the live parameter")
                framed = await self._framed_read(s, start, fmt, params, q.max_bytes, q.committed, headers)
                answer = await _coded(*framed)
            elif q.live == "sse":
                await self._sse(s, start, q.cursor, receive, send, q.committed)
                return
            else:
                visible = self.broker.visible_end(s, q.committed)
                if q.offset == "now" and q.live is None:
                    await _send(send, *self._tail_answer(s, visible))
                    return
                if q.live == "long-poll" and start.pos >= visible.pos:
                    timed_out = await self._long_poll_wait(name, s, start, q)
                    if timed_out is not None:
                        await _send(send, *timed_out)
                        return
                answer = await _coded(*await self._read_answer(s, start, q, headers))
        except LogClosed:
            if not s.deleted:
                raise  # the server is stopping: 503, retry
            # deleted while the read waited: answered as a read that began after the delete is
            raise BadRequest(f"no stream named {name!r}", 404, "not_found") from None
        await _send(send, *answer)

    def _read_query(self, params: dict[str, list[str]]) -> _ReadQuery:
        """Decides whether a read's query parameters (offset, live, cursor, isolation, max_bytes) are well formed."""
        offsets = params.get("offset")
        if offsets is not None and len(offsets) > 1:
            raise BadRequest("give the offset parameter once")
        offset = offsets[0] if offsets else None
        if offset == "":
            raise BadRequest("the offset parameter is empty")
        live = params.get("live", [None])[0]
        if live not in (None, "long-poll", "sse"):
            raise BadRequest(f"live must be long-poll or sse, got {live!r}")
        if live is not None and offset is None:
            raise BadRequest(f"live={live} requires an offset parameter (use -1 for the start or now for the tail)")
        if offset is not None and offset not in ("-1", "now") and parse_token(offset) is None:
            raise BadRequest(f"offset {offset!r} is not an offset this server issued")
        cursor = params.get("cursor", [None])[0]
        isolation = params.get("isolation", ["read_committed"])[0]
        if isolation not in ("read_committed", "read_uncommitted"):
            raise BadRequest(f"isolation must be read_committed or read_uncommitted, got {isolation!r}")
        committed = isolation == "read_committed"
        max_bytes: int | None = None
        raw_max = params.get("max_bytes", [None])[0]
        if raw_max is not None:
            if not _DIGITS.match(raw_max) or not 1 <= int(raw_max) <= self.broker.max_read_bytes:
                raise BadRequest(
                    f"max_bytes must be an integer from 1 to {self.broker.max_read_bytes}, got {raw_max!r}"
                )
            max_bytes = int(raw_max)
        return _ReadQuery(offset=offset, live=live, cursor=cursor, committed=committed, max_bytes=max_bytes)

    @staticmethod
    def _tail_answer(s: StreamState, visible: Position) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """Decides the answer to ``offset=now`` without live: no data, the visible tail as the next offset."""
        h = [
            (b"content-type", s.meta.content_type.encode()),
            (b"stream-next-offset", visible.token().encode()),
            (b"stream-up-to-date", b"true"),
            (b"cache-control", b"no-store"),
        ]
        if s.closed:
            h.append((b"stream-closed", b"true"))
        return 200, h, b"[]" if s.is_json else b""

    async def _long_poll_wait(
        self,
        name: str,
        s: StreamState,
        start: Position,
        q: _ReadQuery,
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """Waits for data past ``start`` and decides whether the long poll ends empty (a 204 to send)
        or goes on to read (None)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.long_poll_timeout
        # wake on every durable change, but answer only once data is visible (a transaction's
        # data moves the tail, not the LSO) or the time is up
        while not s.closed and not s.deleted and self.broker.visible_end(s, q.committed).pos <= start.pos:
            remaining = deadline - loop.time()
            if remaining <= 0 or self.broker.closing:
                break
            await self.broker.wait(s, s.tail, remaining)
            s.touch()
        if s.deleted:
            raise BadRequest(f"stream {name!r} was deleted", 404, "not_found")
        if self.broker.visible_end(s, q.committed).pos <= start.pos:
            h = [
                (b"stream-next-offset", start.token().encode()),
                (b"stream-up-to-date", b"true"),
            ]
            if s.closed:
                h.append((b"stream-closed", b"true"))
            else:
                h.append((b"stream-cursor", make_cursor(q.cursor).encode()))
            return 204, h, b""
        return None

    def _answer_coding(self, headers: dict[str, str], size: int) -> tuple[Coding | None, list[tuple[bytes, bytes]]]:
        """The coding a read answer of about ``size`` bytes goes in (None: as it is), and its ``Vary``.

        Only an answer of ``compress_min_bytes`` or more is compressed: below that a coding saves a
        few hundred bytes at most and costs a compressor's setup on each read. Such an answer
        carries ``Vary: Accept-Encoding`` whatever the request accepted, so that a cache keeps the
        plain and the compressed one apart; a smaller one is the same for every client."""
        least = self.config.compress_min_bytes
        if least is None or size < least:
            return None, []
        return accepted_coding(headers.get("accept-encoding")), [_VARY]

    async def _read_answer(
        self,
        s: StreamState,
        start: Position,
        q: _ReadQuery,
        headers: dict[str, str],
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes, Coding | None]:
        """Reads from ``start`` and decides the answer: 304 for a matching If-None-Match, else 200 with
        the data and the caching headers the read allows; and the coding its body is to go in
        (:meth:`_answer_coding`), whose answer's ETag is the plain one's, weak (RFC 9110 8.8.1: the same
        data in another coding), so that ``If-None-Match`` with either tag revalidates either."""
        try:
            result = await self.broker.aread(s, start, q.max_bytes, committed=q.committed)
        except OffsetGone:
            raise
        except InvalidPosition as exc:
            raise BadRequest(str(exc)) from None
        coding, vary = self._answer_coding(headers, sum(len(b.payload) for b in result.batches))
        start_label = q.offset if q.offset is not None else "-1"
        etag = _etag(s, start_label, result.next, result.closed)
        shown = b"W/" + etag if coding is not None else etag
        inm = headers.get("if-none-match")
        if inm is not None and _etag_matches(inm, etag):
            return 304, [(b"etag", shown), *vary], b"", None
        h = [
            (b"content-type", s.meta.content_type.encode()),
            (b"stream-next-offset", result.next.token().encode()),
            (b"etag", shown),
            *vary,
        ]
        if result.up_to_date:
            h.append((b"stream-up-to-date", b"true"))
        if result.closed:
            h.append((b"stream-closed", b"true"))
        if q.live == "long-poll":
            if not result.closed:
                h.append((b"stream-cursor", make_cursor(q.cursor).encode()))
        elif result.batches:
            h.append((b"cache-control", b"public, max-age=60, stale-while-revalidate=300"))
        else:
            h.append((b"cache-control", b"no-store"))
        return 200, h, _body_of(s, result), coding

    async def _framed_read(
        self,
        s: StreamState,
        start: Position,
        fmt: str,
        params: dict[str, list[str]],
        max_bytes: int | None,
        committed: bool,
        headers: dict[str, str],
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes, Coding | None]:
        """Extension reads for exact-range readers (the Spark source), docs/protocol.md:

        - ``format=records``: the batches from ``offset`` up to ``until`` as frames that keep each
          batch's first record offset, record count and append time; compressed as a catch-up
          read is (:meth:`_answer_coding`).
        - ``format=boundaries``: batch boundaries at least ``every`` records apart, and where a read of
          at most ``max_records`` records ends; no data.
        - ``format=position``: where the first batch appended at or after ``time_ms`` starts, or the
          tail when none was: the lookup of a group reset by time
          (:meth:`~onceflow.core.broker.Broker.position_at_time`), for a reader that starts there.
        """
        if fmt == "position":
            raw_time = params.get("time_ms", [None])[0]
            if raw_time is None or not _DIGITS.match(raw_time) or int(raw_time) > MAX_SAFE_INT:
                raise BadRequest(f"format=position needs time_ms, milliseconds since the epoch, got {raw_time!r}")
            try:
                at = await self.broker.position_at_time(s, int(raw_time))
            except InvalidPosition as exc:
                raise BadRequest(str(exc), 404, "not_found") from None
            status, jh, body = _json_response(200, {"offset": at.token(), "time_ms": int(raw_time)})
            return status, [*jh, (b"cache-control", b"no-store")], body, None
        until: Position | None = None
        raw_until = params.get("until", [None])[0]
        if raw_until is not None:
            resolved = await self.broker.aresolve_start(s, raw_until, committed=committed)
            if isinstance(resolved, str) or raw_until in ("-1", "now"):
                raise BadRequest(f"until must be an offset this server issued for this stream, got {raw_until!r}")
            if resolved.pos < start.pos:
                raise BadRequest(f"until {raw_until!r} is before offset {start.token()!r}")
            until = resolved
        max_records = self._positive_param(params, "max_records")
        h = [(b"cache-control", b"no-store")]
        try:
            if fmt == "records":
                result = await self.broker.aread(
                    s, start, max_bytes, committed=committed, until=until, max_records=max_records
                )
                frames = b"".join(
                    FRAME.pack(b.header.base_offset, b.header.count, b.header.timestamp, len(b.payload)) + b.payload
                    for b in result.batches
                    if b.header.count
                )
                coding, vary = self._answer_coding(headers, len(frames))
                h += [
                    (b"content-type", RECORDS_MEDIA_TYPE),
                    (b"stream-content-type", s.meta.content_type.encode()),
                    (b"stream-next-offset", result.next.token().encode()),
                    *vary,
                ]
                if result.up_to_date:
                    h.append((b"stream-up-to-date", b"true"))
                return 200, h, frames, coding
            if fmt == "boundaries":
                every = self._positive_param(params, "every") or MAX_SAFE_INT
                marks, end = await self.broker.boundaries(
                    s, start, until, every=every, max_records=max_records, committed=committed
                )
                h.append((b"stream-next-offset", end.token().encode()))
                status, jh, body = _json_response(200, {"boundaries": [m.token() for m in marks], "end": end.token()})
                return status, jh + h, body, None
        except OffsetGone:
            raise
        except InvalidPosition as exc:
            raise BadRequest(str(exc)) from None
        raise BadRequest(f"format must be records, boundaries or position, got {fmt!r}")

    @staticmethod
    def _positive_param(params: dict[str, list[str]], key: str) -> int | None:
        raw = params.get(key, [None])[0]
        if raw is None:
            return None
        if not _DIGITS.match(raw) or not 1 <= int(raw) <= MAX_SAFE_INT:
            raise BadRequest(f"{key} must be a positive integer, got {raw!r}")
        return int(raw)

    async def _sse(
        self, s: StreamState, start: Position, cursor: str | None, receive: Receive, send: Send, committed: bool = True
    ) -> None:
        ct = s.meta.content_type.split(";", 1)[0].strip().lower()
        text = ct.startswith("text/") or ct == "application/json"
        h = [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
        ]
        if not text:
            h.append((b"stream-sse-data-encoding", b"base64"))
        await send({"type": "http.response.start", "status": 200, "headers": COMMON + h})
        loop = asyncio.get_running_loop()
        gone = False
        waiting: list[asyncio.Future[None]] = []  # the wake this reader waits for, if any

        async def watch() -> None:
            nonlocal gone
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    gone = True
                    for fut in waiting:
                        if not fut.done():
                            fut.set_result(None)
                    return

        watcher = loop.create_task(watch())
        deadline = time.monotonic() + self.config.sse_max_seconds
        events = self._sse_events
        at = start
        first = True
        try:
            while not gone and not s.deleted and not s.meta.soft_deleted and not self.broker.closing:
                was_closed = s.closed
                try:
                    read = await events.read(self.broker, s, at, committed, text)
                except OSError as exc:  # the store failed or timed out (its read_timeout), or the
                    # stream was deleted meanwhile: the response has begun, so it ends here; the
                    # client resumes from its last offset
                    if not s.deleted:
                        log.error("SSE read of %r at %s: %s", s.name, at.token(), exc)
                    break
                if read is None or gone:
                    break  # not a record boundary; or the client went while the read waited
                nxt, up_to_date, closed, data = read
                out: list[bytes] = []
                if data:
                    out.append(data)
                if data or first or closed or nxt != at:  # a close moves no offset, a marker no message
                    out.append(events.control(nxt, up_to_date, closed, make_cursor(cursor)))
                    first = False
                if out:
                    await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
                at = nxt
                if closed:
                    break
                if not up_to_date:
                    # catching up: other tasks run between two reads (a send need not pause)
                    await asyncio.sleep(0)
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                if (
                    gone
                    or self.broker.visible_end(s, committed) != at
                    or s.closed != was_closed
                    or s.deleted
                    or s.meta.soft_deleted
                    or self.broker.closing
                ):
                    # more became visible, or the stream closed (which moves no offset) or went
                    # away, or the server began to shut down, while the events were sent: their
                    # wake came before this reader's future was there to get it
                    continue
                # one future in the stream's waiters and one timer: the stream's notify (data, an
                # LSO that moved, a close or delete), the timer or a disconnect resolves it (a task
                # per wait cost more than the delivery itself)
                fut: asyncio.Future[None] = loop.create_future()
                s.waiters[fut] = None
                waiting.append(fut)
                timer = loop.call_later(min(self.config.long_poll_timeout, remaining), _expire, fut)
                try:
                    await fut
                finally:
                    timer.cancel()
                    waiting.clear()
                    s.waiters.pop(fut, None)
                if gone:
                    break
                timed_out = fut.result() is False
                s.touch()
                if timed_out and self.broker.visible_end(s, committed) == at and not s.closed:
                    # keep-alive: a control event so proxies and clients see the connection live
                    await send(
                        {
                            "type": "http.response.body",
                            "body": events.control(at, True, False, make_cursor(cursor)),
                            "more_body": True,
                        }
                    )
        finally:
            watcher.cancel()
        if not gone:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
