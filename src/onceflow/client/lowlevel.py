"""The Durable Streams protocol as pure functions: request headers in, results out (no I/O).

The sync and asyncio clients both call these, so the two can only differ in how they wait. It is also
the client's public low-level layer for onceflow's other packages (processors, sinks, spark), which
speak HTTP themselves: with it come ``error_from_response`` (an error response as the client's
exception) and ``run_sync`` / ``background_loop`` (the client's background event loop).
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from ..wire import CODINGS, COMPRESS_MIN, Coding, compress
from ._errors import OnceflowError, error_from_response
from ._failover import (
    AsyncFailoverTransport,
    FailoverTransport,
    NoServerError,
    ServerURL,
    parse_servers,
    request_url,
    server_url,
)
from ._loop import background_loop, run_sync
from ._transport import LeanAsyncTransport
from ._types import AppendResult, Chunk, Retention, StreamInfo

__all__ = [
    "TOKEN_ENV",
    "Coding",
    "NoServerError",
    "SSEParser",
    "ServerURL",
    "accept_headers",
    "append_headers",
    "async_http_client",
    "auth_headers",
    "background_loop",
    "check_compression",
    "create_headers",
    "encode_body",
    "encode_json_messages",
    "error_from_response",
    "http_client",
    "is_json_type",
    "parse_append",
    "parse_chunk",
    "parse_info",
    "read_params",
    "request_url",
    "run_sync",
    "server_url",
    "stream_url",
    "tls_verify",
]

STREAM_PATH = "/v1/stream/"


def stream_url(base_url: str, name: str) -> str:
    """``http://host:4437`` + ``orders/0`` → ``http://host:4437/v1/stream/orders/0``.

    A ``base_url`` that already names a stream (contains ``/v1/stream/``) is joined as given.
    """
    base = base_url.rstrip("/")
    if STREAM_PATH.rstrip("/") in base:
        return f"{base}/{name}" if name else base
    return f"{base}{STREAM_PATH}{name}"


TOKEN_ENV = "ONCEFLOW_TOKEN"  # noqa: S105 - the name of the variable, not a secret


def auth_headers(token: str | None = None) -> dict[str, str]:
    """``Authorization: Bearer`` for a server run with ``--guard`` (docs/security.md): ``token``,
    else ``$ONCEFLOW_TOKEN``; nothing when neither is set."""
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    return {"authorization": f"Bearer {token}"} if token else {}


def check_compression(compression: str | None) -> Coding | None:
    """``compression`` as the clients take it: ``"gzip"``, ``"zstd"`` or None (a ``ValueError`` else)."""
    if compression is None or compression in CODINGS:
        return compression
    raise ValueError(f"compression must be {' or '.join(repr(c) for c in CODINGS)} or None, got {compression!r}")


def encode_body(body: bytes, compression: Coding | None) -> tuple[bytes, dict[str, str]]:
    """The body of an append or create to send, and its ``Content-Encoding`` header: in
    ``compression`` when the body is at least :data:`~onceflow.wire.COMPRESS_MIN` bytes and the
    coding makes it smaller; as it is otherwise (``{}``). The server decodes it before anything
    else, so a retry may go either way and is deduplicated the same (docs/protocol.md, "Compression")."""
    if compression is None or len(body) < COMPRESS_MIN:
        return body, {}
    packed = compress(body, compression)
    if len(packed) >= len(body):
        return body, {}
    return packed, {"content-encoding": compression}


def accept_headers(compression: Coding | None) -> dict[str, str]:
    """The ``Accept-Encoding`` of a read: ``compression`` when given, else ``identity``, so that a
    client made otherwise than by :func:`http_client` (whose default is httpx's ``gzip, deflate``)
    gets plain answers unless told. httpx decodes gzip, and zstd with ``zstandard`` installed (it is
    onceflow's dependency)."""
    return {"accept-encoding": compression or "identity"}


def _default_headers(token: str | None) -> dict[str, str]:
    """The headers of every request of a client made here: the bearer token, and
    ``Accept-Encoding: identity`` (httpx would ask for gzip, deflate and zstd on every request, and
    the server would compress large answers for it: reads ask for a coding only when told)."""
    return {"accept-encoding": "identity", **auth_headers(token)}


def tls_verify(url: str) -> bool:
    """httpx's ``verify`` for a client of ``url``: plain http needs no CA bundle (loading it costs
    tens of milliseconds per client); https verifies as usual."""
    return not url.startswith("http://")


class _Cookies(httpx.Cookies):
    """httpx's cookie jar without its cost on answers that set no cookie. httpx looks for cookies in
    every response by building two urllib compatibility objects, ~12 us per request here (of a
    producer request's ~100 us of client CPU); onceflow's servers set none. An answer that does
    carry ``Set-Cookie`` (a proxy's, say) is kept as httpx always kept it."""

    def extract_cookies(self, response: httpx.Response) -> None:
        if "set-cookie" in response.headers:
            super().extract_cookies(response)


_C = TypeVar("_C", httpx.Client, httpx.AsyncClient)


def _skip_cookie_parsing(client: _C) -> _C:
    client._cookies = _Cookies(client.cookies)  # noqa: SLF001 - the cookies setter would wrap it back in httpx.Cookies
    return client


def http_client(
    url: str, *, timeout: float | httpx.Timeout, token: str | None = None, limits: httpx.Limits | None = None
) -> httpx.Client:
    """The ``httpx.Client`` for the server(s) ``url`` names, as every part of onceflow makes it:
    ``verify`` by the scheme (:func:`tls_verify`), the bearer token (:func:`auth_headers`), and,
    when ``url`` names several servers (``http://a:4437,b:4437``), the failover transport (see
    docs/client.md, "Several servers"). Address its requests to :func:`request_url` of ``url``.

    With one server it is the plain client it always was. With several, it connects to them
    directly: ``$HTTP_PROXY`` and the like do not apply (a proxy between would hide which server
    is down), nor does ``.netrc``."""
    verify = tls_verify(url)
    more: dict[str, Any] = {} if limits is None else {"limits": limits}
    servers = parse_servers(url)
    if servers is None:
        return _skip_cookie_parsing(
            httpx.Client(timeout=timeout, verify=verify, headers=_default_headers(token), **more)
        )
    transport = FailoverTransport(servers, httpx.HTTPTransport(verify=verify, **more))
    return _skip_cookie_parsing(
        httpx.Client(timeout=timeout, headers=_default_headers(token), transport=transport, trust_env=False)
    )


def async_http_client(
    url: str, *, timeout: float | httpx.Timeout, token: str | None = None, limits: httpx.Limits | None = None
) -> httpx.AsyncClient:
    """The asyncio twin of :func:`http_client`."""
    verify = tls_verify(url)
    more: dict[str, Any] = {} if limits is None else {"limits": limits}
    servers = parse_servers(url)
    plain = url.strip().lower().startswith("http://")  # one scheme, also for several servers
    if servers is None:
        if plain:  # the lean transport (client/_transport.py); https stays with httpx's own
            more = {"transport": LeanAsyncTransport(limits)}
        return _skip_cookie_parsing(
            httpx.AsyncClient(timeout=timeout, verify=verify, headers=_default_headers(token), **more)
        )
    inner = LeanAsyncTransport(limits) if plain else httpx.AsyncHTTPTransport(verify=verify, **more)
    transport = AsyncFailoverTransport(servers, inner)
    return _skip_cookie_parsing(
        httpx.AsyncClient(timeout=timeout, headers=_default_headers(token), transport=transport, trust_env=False)
    )


def is_json_type(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


def encode_json_messages(values: Iterable[Any]) -> bytes:
    """A JSON array body: each value becomes exactly one message (lists included)."""
    return ("[" + ",".join(json.dumps(v, separators=(",", ":"), ensure_ascii=False) for v in values) + "]").encode()


def create_headers(
    content_type: str,
    *,
    ttl: int | None,
    expires_at: str | None,
    closed: bool,
    retention: Retention | None = None,
) -> dict[str, str]:
    h = {"content-type": content_type}
    if retention is not None:
        if retention.seconds is not None:
            h["stream-retention-seconds"] = str(retention.seconds)
        if retention.bytes is not None:
            h["stream-retention-bytes"] = str(retention.bytes)
        if retention.keep_groups:
            h["stream-retention-keep-groups"] = ",".join(retention.keep_groups)
    if ttl is not None:
        h["stream-ttl"] = str(ttl)
    if expires_at is not None:
        h["stream-expires-at"] = expires_at
    if closed:
        h["stream-closed"] = "true"
    return h


def append_headers(
    content_type: str | None,
    *,
    seq: str | None = None,
    close: bool = False,
    if_match: str | None = None,
    producer: tuple[str, int, int] | None = None,
) -> dict[str, str]:
    h: dict[str, str] = {}
    if content_type:
        h["content-type"] = content_type
    if seq is not None:
        h["stream-seq"] = seq
    if close:
        h["stream-closed"] = "true"
    if if_match is not None:
        h["if-match"] = if_match
    if producer is not None:
        h["producer-id"], h["producer-epoch"], h["producer-seq"] = producer[0], str(producer[1]), str(producer[2])
    return h


def _int(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def _closed(resp: httpx.Response) -> bool:
    return bool(resp.headers.get("stream-closed", "").lower() == "true")


def parse_info(resp: httpx.Response, what: str) -> StreamInfo:
    if resp.status_code not in (200, 201):
        raise error_from_response(resp, what)
    h = resp.headers
    return StreamInfo(
        content_type=h.get("content-type", "application/octet-stream"),
        next_offset=h.get("stream-next-offset", ""),
        closed=_closed(resp),
        ttl_seconds=_int(h.get("stream-ttl")),
        expires_at=h.get("stream-expires-at"),
    )


def parse_append(resp: httpx.Response, what: str) -> AppendResult:
    if resp.status_code not in (200, 204):
        raise error_from_response(resp, what)
    h = resp.headers
    has_producer = "producer-epoch" in h
    return AppendResult(
        next_offset=h.get("stream-next-offset"),
        duplicate=has_producer and resp.status_code == 204,
        closed=_closed(resp),
        producer_epoch=_int(h.get("producer-epoch")),
        producer_seq=_int(h.get("producer-seq")),
    )


def read_params(offset: str, live: str | None, cursor: str | None, max_bytes: int | None = None) -> dict[str, str]:
    params = {"offset": offset}
    if max_bytes is not None:
        params["max_bytes"] = str(max_bytes)  # onceflow extension: smaller reads
    if live:
        params["live"] = live
    if cursor:
        params["cursor"] = cursor
    return params


def parse_chunk(name: str, offset: str, resp: httpx.Response, what: str) -> Chunk:
    """A catch-up or long-poll response as a Chunk (204: an empty one at the same offset)."""
    if resp.status_code not in (200, 204):
        raise error_from_response(resp, what)
    h = resp.headers
    data = resp.content if resp.status_code == 200 else b""
    ct = h.get("content-type", "application/octet-stream")
    if resp.status_code == 204 or (is_json_type(ct) and data == b"[]"):
        data = b""
    return Chunk(
        stream=name,
        offset=offset,
        next_offset=h.get("stream-next-offset", offset),
        data=data,
        content_type=ct,
        up_to_date=h.get("stream-up-to-date", "").lower() == "true" or resp.status_code == 204,
        closed=_closed(resp),
        cursor=h.get("stream-cursor"),
    )


@dataclass
class SSEParser:
    """Turns SSE lines into Chunks: each ``data`` event is completed by the ``control`` after it."""

    name: str
    offset: str
    content_type: str
    base64: bool
    _event: str = ""
    _data: list[str] = field(default_factory=list)
    _payloads: list[bytes] = field(default_factory=list)

    def feed(self, line: str) -> Iterator[Chunk]:
        if line == "":
            yield from self._dispatch()
            return
        if line.startswith(":"):
            return
        key, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if key == "event":
            self._event = value
        elif key == "data":
            self._data.append(value)

    def _dispatch(self) -> Iterator[Chunk]:
        event, lines = self._event, self._data
        self._event, self._data = "", []
        if event == "data":
            self._payloads.append(base64.b64decode("".join(lines)) if self.base64 else "\n".join(lines).encode())
        elif event == "control":
            try:
                ctl = json.loads("\n".join(lines))
            except ValueError as exc:
                raise OnceflowError(f"malformed SSE control event: {exc}", retriable=True) from None
            nxt = ctl.get("streamNextOffset", self.offset)
            payloads, self._payloads = self._payloads, []
            if is_json_type(self.content_type) and len(payloads) > 1:  # several data events, one array
                data = encode_json_messages(m for p in payloads for m in json.loads(p))
            else:
                data = b"".join(payloads)
            if data == b"[]":
                data = b""
            chunk = Chunk(
                stream=self.name,
                offset=self.offset,
                next_offset=nxt,
                data=data,
                content_type=self.content_type,
                up_to_date=bool(ctl.get("upToDate") or ctl.get("streamClosed")),
                closed=bool(ctl.get("streamClosed")),
                cursor=ctl.get("streamCursor"),
            )
            self.offset = nxt
            yield chunk
