"""The few onceflow requests the Spark connector makes, synchronous and retried.

The connector runs in Spark's Python workers (a fresh process per task on some set-ups), so this
keeps to plain ``httpx.Client`` calls with no event loop. Every request here is idempotent, so a
transport error or a 5xx is retried until ``deadline`` seconds have passed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from .._backoff import backoff
from ..client import OffsetGoneError, OnceflowError, TransportError
from ..client.lowlevel import Coding, accept_headers, error_from_response, http_client, request_url, stream_url
from ..wire import iter_frames

__all__ = ["Conn", "Frame", "StreamTail", "byte_offset", "record_offset"]

log = logging.getLogger("onceflow.spark")
_ZERO = "0000000000000000_0000000000000000"  # a stream's first offset (a HEAD without Stream-Earliest-Offset)


def record_offset(token: str) -> int:
    """The record offset an onceflow offset token stands for (``-1`` is the start: 0).

    Tokens are ``<record offset>_<byte position>``, both zero-padded (docs/protocol.md); the
    connector uses the record part to count records between two offsets."""
    if token in ("-1", ""):
        return 0
    head, _, _ = token.partition("_")
    if not head.isdigit():
        raise ValueError(f"{token!r} is not an onceflow offset")
    return int(head)


def byte_offset(token: str) -> int:
    """The byte position an onceflow offset token stands for (``-1`` is the start: 0)."""
    if token in ("-1", ""):
        return 0
    _, _, tail = token.partition("_")
    if not tail.isdigit():
        raise ValueError(f"{token!r} is not an onceflow offset")
    return int(tail)


@dataclass(frozen=True)
class StreamTail:
    """A stream's name, content type and tails as the connector reads them (not the client's StreamInfo)."""

    name: str
    content_type: str
    next_offset: str
    stable_offset: str


@dataclass(frozen=True)
class Frame:
    """One appended batch as the ``format=records`` read returns it."""

    base_offset: int
    count: int
    timestamp_ms: int
    payload: bytes


class Conn:
    """A connection to one onceflow server."""

    def __init__(
        self,
        url: str,
        *,
        deadline: float = 60.0,
        timeout: float = 30.0,
        token: str | None = None,
        offset_reset: str = "error",
        compression: Coding | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self._accept = accept_headers(compression)  # of the format=records reads, the connector's data
        self._api = request_url(self.url)  # what requests are addressed to (the same URL for one server)
        self.deadline = deadline
        self.offset_reset = offset_reset  # "error" or "earliest": see _overtaken
        self.client = http_client(self.url, timeout=timeout, token=token)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, method: str, url: str, what: str, *, ok: tuple[int, ...] = (200,), **kw: Any) -> httpx.Response:
        give_up = time.monotonic() + self.deadline
        attempt = 0
        while True:
            try:
                resp = self.client.request(method, url, **kw)
                if resp.status_code in ok:
                    return resp
                err: OnceflowError = error_from_response(resp, what)
                if resp.status_code < 500 and resp.status_code != 429:
                    raise err
            except httpx.TransportError as exc:
                err = TransportError(f"{what}: {exc!r} (is the onceflow server at {self.url} running?)")
            if time.monotonic() > give_up:
                raise err
            attempt += 1
            time.sleep(backoff(attempt))

    # ------------------------------------------------------------------ streams

    def list_streams(self, prefix: str) -> list[StreamTail]:
        resp = self.request(
            "GET", f"{self._api}/v1/streams", f"list streams under {prefix!r}", params={"prefix": prefix}
        )
        return [
            StreamTail(s["name"], s["content_type"], s["next_offset"], s.get("stable_offset", s["next_offset"]))
            for s in resp.json()["streams"]
        ]

    def head(self, stream: str) -> StreamTail | None:
        resp = self.request("HEAD", stream_url(self._api, stream), f"head {stream}", ok=(200, 404))
        if resp.status_code == 404:
            return None
        nxt = resp.headers["stream-next-offset"]
        return StreamTail(
            stream, resp.headers.get("content-type", ""), nxt, resp.headers.get("stream-last-stable-offset", nxt)
        )

    def earliest(self, stream: str) -> str:
        """Where a read of ``stream`` from ``-1`` starts now, as an offset: the earliest offset
        retention kept (``Stream-Earliest-Offset``), or the stream's first one."""
        resp = self.request("HEAD", stream_url(self._api, stream), f"head {stream}")
        return resp.headers.get("stream-earliest-offset") or _ZERO

    def _overtaken(self, exc: OffsetGoneError, stream: str, at: str, until: str) -> str | None:
        """Where a read of ``stream`` from ``at`` whose data retention deleted goes on: the earliest
        offset kept (``offsetReset`` = ``earliest``; None when nothing before ``until`` is kept), or
        the error, saying how to go on."""
        if self.offset_reset != "earliest":
            raise OffsetGoneError(
                f"{exc} (the query can go on from there, skipping what was deleted, with "
                '.option("offsetReset", "earliest"), Kafka\'s failOnDataLoss=false)',
                earliest_offset=exc.earliest_offset,
                status=exc.status,
            )
        log.warning(
            "onceflow stream %s: the data at %s was deleted by retention; reading on from %s (offsetReset=earliest)",
            stream,
            at,
            exc.earliest_offset,
        )
        return exc.earliest_offset if exc.earliest_offset < until else None  # tokens sort as positions

    def read_frames(self, stream: str, start: str, until: str, *, isolation: str) -> Iterator[tuple[list[Frame], str]]:
        """The batches in ``[start, until)``, one response at a time, with each response's next offset."""
        at = start
        while at != until:
            try:
                resp = self.request(
                    "GET",
                    stream_url(self._api, stream),
                    f"read {stream}",
                    params={"offset": at, "until": until, "format": "records", "isolation": isolation},
                    headers=self._accept,
                )
            except OffsetGoneError as exc:
                on = self._overtaken(exc, stream, at, until)
                if on is None:
                    return
                at = on
                continue
            frames = [Frame(*f) for f in iter_frames(resp.content)]
            nxt = resp.headers["stream-next-offset"]
            if nxt == at:
                raise OnceflowError(f"read of {stream} from {at} to {until} made no progress (was the stream deleted?)")
            yield frames, nxt
            at = nxt

    def boundaries(
        self,
        stream: str,
        start: str,
        until: str,
        *,
        isolation: str,
        every: int | None = None,
        max_records: int | None = None,
    ) -> tuple[list[str], str]:
        marks, end, _ = self.boundaries_from(
            stream, start, until, isolation=isolation, every=every, max_records=max_records
        )
        return marks, end

    def boundaries_from(
        self,
        stream: str,
        start: str,
        until: str,
        *,
        isolation: str,
        every: int | None = None,
        max_records: int | None = None,
    ) -> tuple[list[str], str, str]:
        """:meth:`boundaries`, and where the scan began: ``start``, or (``offsetReset`` = ``earliest``,
        retention deleted ``start``) the earliest offset kept, or ``until`` when nothing before it is."""
        params: dict[str, str | int] = {"offset": start, "until": until, "format": "boundaries", "isolation": isolation}
        if every is not None:
            params["every"] = every
        if max_records is not None:
            params["max_records"] = max_records
        try:
            body = self.request("GET", stream_url(self._api, stream), f"boundaries of {stream}", params=params).json()
        except OffsetGoneError as exc:
            on = self._overtaken(exc, stream, start, until)
            if on is None:
                return [], until, until
            params["offset"] = on
            body = self.request("GET", stream_url(self._api, stream), f"boundaries of {stream}", params=params).json()
            return list(body["boundaries"]), str(body["end"]), on
        return list(body["boundaries"]), str(body["end"]), start

    def position_at(self, stream: str, time_ms: int) -> str:
        """The offset of the first batch of ``stream`` appended at or after ``time_ms`` (ms since
        the epoch), or its tail when none was: ``GET ...?format=position`` (docs/protocol.md)."""
        resp = self.request(
            "GET",
            stream_url(self._api, stream),
            f"find the offset of {stream} at time {time_ms}",
            params={"format": "position", "time_ms": time_ms},
        )
        return str(resp.json()["offset"])

    def commit_group(self, group: str, offsets: dict[str, str]) -> None:
        """Record ``offsets`` as consumer group ``group``'s (they only move forward)."""
        real = {name: off for name, off in offsets.items() if off != "-1"}
        if real:
            self.request(
                "POST",
                f"{self._api}/v1/groups/{quote(group, safe='')}/offsets",
                f"commit the offsets of group {group}",
                json={"offsets": real},
            )
