"""Stream handles: :class:`Stream` (blocking) and :class:`AsyncStream` (asyncio), method for method.

Naming: ``close_stream()`` closes the *stream* (the protocol's EOF, for every reader); ``close()``
releases the handle's HTTP connections (what ``with`` does on exit).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import httpx

from ._errors import OnceflowError, TransportError, error_from_response
from ._types import AppendResult, Chunk, LiveMode, Retention, StreamInfo
from .lowlevel import (
    Coding,
    ServerURL,
    SSEParser,
    accept_headers,
    append_headers,
    async_http_client,
    check_compression,
    create_headers,
    encode_body,
    encode_json_messages,
    http_client,
    is_json_type,
    parse_append,
    parse_chunk,
    parse_info,
    read_params,
    request_url,
    server_url,
    stream_url,
)

__all__ = ["AsyncStream", "Stream"]

DEFAULT_TIMEOUT = httpx.Timeout(30.0, read=60.0)
# A live SSE read that hears nothing for this long gives up (TransportError): the server sends a
# keep-alive event every --long-poll-timeout (20 s by default) while the stream is idle, so such
# silence is a server that is gone or frozen (SIGSTOP, a paused VM), whose kernel keeps the
# connection open (issue 30). Keep --long-poll-timeout well below it.
SSE_SILENCE = 45.0


def _name_of(url: str) -> str:
    marker = "/v1/stream/"
    return url.split(marker, 1)[1] if marker in url else url.rsplit("/", 1)[-1]


def _body(data: bytes | str | Any, json_stream: bool) -> bytes:
    """Bytes go as they are; for JSON streams anything else is one JSON message."""
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    if json_stream:
        return encode_json_messages([data])
    if isinstance(data, str):
        return data.encode()
    raise TypeError(f"cannot append {type(data).__name__} to a non-JSON stream; pass bytes or str")


def _sse_parser(name: str, offset: str, content_type: str, resp: httpx.Response) -> SSEParser:
    return SSEParser(
        name=name,
        offset=offset,
        content_type=content_type,
        base64=resp.headers.get("stream-sse-data-encoding", "").lower() == "base64",
    )


class _Base:
    def __init__(self, url: ServerURL, content_type: str | None, compression: Coding | None) -> None:
        self.url = server_url(url)
        self.name = _name_of(self.url)
        self._content_type = content_type
        self._target = request_url(self.url)  # what requests are addressed to (the same URL for one server)
        self.compression = check_compression(compression)
        self._accept = accept_headers(self.compression)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def _json(self) -> bool:
        return self._content_type is not None and is_json_type(self._content_type)


class Stream(_Base):
    """A handle on one stream at ``url`` (e.g. ``http://127.0.0.1:4437/v1/stream/orders``).

    Use :meth:`connect` to build the URL from a server address and a name. The handle is cheap; it
    holds an ``httpx.Client`` (yours if you pass one, closed by :meth:`close` otherwise).

    ``compression`` (``"gzip"`` or ``"zstd"``; default None): appends (and a create's data) of 1 KiB
    or more go compressed, and catch-up and long-poll reads ask for compressed answers
    (``Accept-Encoding``), which httpx decodes; live SSE reads are never compressed
    (docs/client.md, "Compression").

    Several servers (``http://a:4437,b:4437/v1/stream/orders``, or a list of server URLs given to
    :meth:`connect`): the handle's own client fails over between them, and ``url`` keeps them all,
    so it can be handed to another handle or producer as it is. A client of yours fails over only
    if it was made by :func:`onceflow.client.lowlevel.http_client` for the same servers.
    """

    def __init__(
        self,
        url: ServerURL,
        *,
        client: httpx.Client | None = None,
        content_type: str | None = None,
        compression: Coding | None = None,
    ) -> None:
        super().__init__(url, content_type, compression)
        self._own = client is None
        self._client = client or http_client(self.url, timeout=DEFAULT_TIMEOUT)

    @classmethod
    def connect(
        cls,
        base_url: ServerURL,
        name: str,
        *,
        client: httpx.Client | None = None,
        content_type: str | None = None,
        compression: Coding | None = None,
    ) -> Stream:
        return cls(
            stream_url(server_url(base_url), name), client=client, content_type=content_type, compression=compression
        )

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the HTTP client (if this handle created it). The stream itself stays open."""
        if self._own:
            self._client.close()

    def _request(self, method: str, what: str, **kw: Any) -> httpx.Response:
        try:
            return self._client.request(method, self._target, **kw)
        except httpx.TransportError as exc:
            raise TransportError(f"{what} {self.url}: {exc!r}") from exc

    # -- lifecycle

    def create(
        self,
        content_type: str = "application/octet-stream",
        *,
        ttl: int | None = None,
        expires_at: str | None = None,
        closed: bool = False,
        data: bytes | None = None,
        retention: Retention | None = None,
    ) -> StreamInfo:
        """Create the stream, or confirm an identical one exists (idempotent). ``retention``: how
        long and how much of it the server keeps (its default otherwise; docs/operations.md)."""
        body, coded = encode_body(data or b"", self.compression)
        headers = create_headers(content_type, ttl=ttl, expires_at=expires_at, closed=closed, retention=retention)
        resp = self._request("PUT", "create", headers={**headers, **coded}, content=body)
        info = parse_info(resp, f"create {self.name}")
        self._content_type = info.content_type
        return info

    def head(self) -> StreamInfo:
        resp = self._request("HEAD", "head")
        if resp.status_code != 200:
            raise error_from_response(resp, f"head {self.name}")
        info = parse_info(resp, f"head {self.name}")
        self._content_type = info.content_type
        return info

    def exists(self) -> bool:
        try:
            self.head()
        except OnceflowError as exc:
            if exc.status in (404, 410):
                return False
            raise
        return True

    def delete(self) -> None:
        resp = self._request("DELETE", "delete")
        if resp.status_code != 204:
            raise error_from_response(resp, f"delete {self.name}")

    def close_stream(self) -> AppendResult:
        """Close the stream: readers see EOF after the current tail; appends are refused."""
        return parse_append(
            self._request("POST", "close", headers=append_headers(None, close=True)), f"close {self.name}"
        )

    # -- writes

    def _ensure_type(self) -> str:
        if self._content_type is None:
            self.head()
        assert self._content_type is not None
        return self._content_type

    def append(
        self,
        data: bytes | str | Any,
        *,
        seq: str | None = None,
        close: bool = False,
        if_match: str | None = None,
        producer: tuple[str, int, int] | None = None,
    ) -> AppendResult:
        """Append one message (any JSON value for JSON streams; bytes or str otherwise).

        ``if_match`` appends only if the tail is still that offset (else PreconditionFailedError);
        ``producer`` is ``(id, epoch, seq)`` for a single idempotent append (see IdempotentProducer).
        """
        ct = self._ensure_type()
        body, coded = encode_body(_body(data, is_json_type(ct)), self.compression)
        headers = append_headers(ct, seq=seq, close=close, if_match=if_match, producer=producer)
        return parse_append(
            self._request("POST", "append", headers={**headers, **coded}, content=body), f"append to {self.name}"
        )

    def append_many(
        self,
        values: Iterable[Any],
        *,
        seq: str | None = None,
        close: bool = False,
        if_match: str | None = None,
        producer: tuple[str, int, int] | None = None,
    ) -> AppendResult:
        """Append many JSON messages in one request (atomically: all or none)."""
        ct = self._ensure_type()
        if not is_json_type(ct):
            raise TypeError("append_many needs a JSON stream; concatenate bytes for byte streams")
        headers = append_headers(ct, seq=seq, close=close, if_match=if_match, producer=producer)
        body, coded = encode_body(encode_json_messages(values), self.compression)
        return parse_append(
            self._request("POST", "append", headers={**headers, **coded}, content=body), f"append to {self.name}"
        )

    # -- reads

    def read(self, offset: str = "-1") -> Chunk:
        """One catch-up read from ``offset`` (``-1``: the start, ``now``: the tail)."""
        resp = self._request("GET", "read", params=read_params(offset, None, None), headers=self._accept)
        return parse_chunk(self.name, offset, resp, f"read {self.name}")

    def chunks(self, offset: str = "-1", *, live: LiveMode | None = None) -> Iterator[Chunk]:
        """Chunks from ``offset`` on. Without ``live``: until caught up. With ``live``: forever (or
        until the stream is closed), tailing by long-poll or SSE; resumable from any ``next_offset``."""
        if live == "sse":
            yield from self._sse(offset)
            return
        cursor: str | None = None
        while True:
            resp = self._request("GET", "read", params=read_params(offset, live, cursor), headers=self._accept)
            chunk = parse_chunk(self.name, offset, resp, f"read {self.name}")
            if chunk.data or chunk.closed or live is None:
                yield chunk
            offset, cursor = chunk.next_offset, chunk.cursor
            if chunk.closed or (live is None and chunk.up_to_date):
                return

    def messages(self, offset: str = "-1", *, live: LiveMode | None = None) -> Iterator[Any]:
        """The JSON messages from ``offset`` on (see :meth:`chunks`)."""
        for chunk in self.chunks(offset, live=live):
            yield from chunk.messages()

    def _sse(self, offset: str) -> Iterator[Chunk]:
        ct = self._ensure_type()
        while True:
            try:
                with self._client.stream(
                    "GET", self._target, params=read_params(offset, "sse", None), timeout=_sse_timeout()
                ) as resp:
                    if resp.status_code != 200:
                        resp.read()
                        raise error_from_response(resp, f"read {self.name}")
                    parser = _sse_parser(self.name, offset, ct, resp)
                    for line in resp.iter_lines():
                        for chunk in parser.feed(line):
                            offset = chunk.next_offset
                            if chunk.data or chunk.closed:
                                yield chunk
                            if chunk.closed:
                                return
            except httpx.TransportError as exc:
                raise TransportError(f"live read of {self.name}: {exc!r}") from exc
            # the server ends SSE connections about once a minute; resume where we are


def _sse_timeout() -> httpx.Timeout:
    return httpx.Timeout(30.0, read=SSE_SILENCE)


class AsyncStream(_Base):
    """The asyncio twin of :class:`Stream`: the same methods, awaited."""

    def __init__(
        self,
        url: ServerURL,
        *,
        client: httpx.AsyncClient | None = None,
        content_type: str | None = None,
        compression: Coding | None = None,
    ) -> None:
        super().__init__(url, content_type, compression)
        self._own = client is None
        self._client = client or async_http_client(self.url, timeout=DEFAULT_TIMEOUT)

    @classmethod
    def connect(
        cls,
        base_url: ServerURL,
        name: str,
        *,
        client: httpx.AsyncClient | None = None,
        content_type: str | None = None,
        compression: Coding | None = None,
    ) -> AsyncStream:
        return cls(
            stream_url(server_url(base_url), name), client=client, content_type=content_type, compression=compression
        )

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own:
            await self._client.aclose()

    async def _request(self, method: str, what: str, **kw: Any) -> httpx.Response:
        try:
            return await self._client.request(method, self._target, **kw)
        except httpx.TransportError as exc:
            raise TransportError(f"{what} {self.url}: {exc!r}") from exc

    async def create(
        self,
        content_type: str = "application/octet-stream",
        *,
        ttl: int | None = None,
        expires_at: str | None = None,
        closed: bool = False,
        data: bytes | None = None,
        retention: Retention | None = None,
    ) -> StreamInfo:
        body, coded = encode_body(data or b"", self.compression)
        headers = create_headers(content_type, ttl=ttl, expires_at=expires_at, closed=closed, retention=retention)
        resp = await self._request("PUT", "create", headers={**headers, **coded}, content=body)
        info = parse_info(resp, f"create {self.name}")
        self._content_type = info.content_type
        return info

    async def head(self) -> StreamInfo:
        resp = await self._request("HEAD", "head")
        if resp.status_code != 200:
            raise error_from_response(resp, f"head {self.name}")
        info = parse_info(resp, f"head {self.name}")
        self._content_type = info.content_type
        return info

    async def exists(self) -> bool:
        try:
            await self.head()
        except OnceflowError as exc:
            if exc.status in (404, 410):
                return False
            raise
        return True

    async def delete(self) -> None:
        resp = await self._request("DELETE", "delete")
        if resp.status_code != 204:
            raise error_from_response(resp, f"delete {self.name}")

    async def close_stream(self) -> AppendResult:
        return parse_append(
            await self._request("POST", "close", headers=append_headers(None, close=True)), f"close {self.name}"
        )

    async def _ensure_type(self) -> str:
        if self._content_type is None:
            await self.head()
        assert self._content_type is not None
        return self._content_type

    async def append(
        self,
        data: bytes | str | Any,
        *,
        seq: str | None = None,
        close: bool = False,
        if_match: str | None = None,
        producer: tuple[str, int, int] | None = None,
    ) -> AppendResult:
        ct = await self._ensure_type()
        body, coded = encode_body(_body(data, is_json_type(ct)), self.compression)
        headers = append_headers(ct, seq=seq, close=close, if_match=if_match, producer=producer)
        return parse_append(
            await self._request("POST", "append", headers={**headers, **coded}, content=body), f"append to {self.name}"
        )

    async def append_many(
        self,
        values: Iterable[Any],
        *,
        seq: str | None = None,
        close: bool = False,
        if_match: str | None = None,
        producer: tuple[str, int, int] | None = None,
    ) -> AppendResult:
        ct = await self._ensure_type()
        if not is_json_type(ct):
            raise TypeError("append_many needs a JSON stream; concatenate bytes for byte streams")
        headers = append_headers(ct, seq=seq, close=close, if_match=if_match, producer=producer)
        body, coded = encode_body(encode_json_messages(values), self.compression)
        return parse_append(
            await self._request("POST", "append", headers={**headers, **coded}, content=body), f"append to {self.name}"
        )

    async def read(self, offset: str = "-1") -> Chunk:
        resp = await self._request("GET", "read", params=read_params(offset, None, None), headers=self._accept)
        return parse_chunk(self.name, offset, resp, f"read {self.name}")

    async def chunks(self, offset: str = "-1", *, live: LiveMode | None = None) -> AsyncIterator[Chunk]:
        if live == "sse":
            async for chunk in self._sse(offset):
                yield chunk
            return
        cursor: str | None = None
        while True:
            resp = await self._request("GET", "read", params=read_params(offset, live, cursor), headers=self._accept)
            chunk = parse_chunk(self.name, offset, resp, f"read {self.name}")
            if chunk.data or chunk.closed or live is None:
                yield chunk
            offset, cursor = chunk.next_offset, chunk.cursor
            if chunk.closed or (live is None and chunk.up_to_date):
                return

    async def messages(self, offset: str = "-1", *, live: LiveMode | None = None) -> AsyncIterator[Any]:
        async for chunk in self.chunks(offset, live=live):
            for m in chunk.messages():
                yield m

    async def _sse(self, offset: str) -> AsyncIterator[Chunk]:
        ct = await self._ensure_type()
        while True:
            try:
                async with self._client.stream(
                    "GET", self._target, params=read_params(offset, "sse", None), timeout=_sse_timeout()
                ) as resp:
                    if resp.status_code != 200:
                        await resp.aread()
                        raise error_from_response(resp, f"read {self.name}")
                    parser = _sse_parser(self.name, offset, ct, resp)
                    async for line in resp.aiter_lines():
                        for chunk in parser.feed(line):
                            offset = chunk.next_offset
                            if chunk.data or chunk.closed:
                                yield chunk
                            if chunk.closed:
                                return
            except httpx.TransportError as exc:
                raise TransportError(f"live read of {self.name}: {exc!r}") from exc
