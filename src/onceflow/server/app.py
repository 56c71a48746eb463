"""The Durable Streams protocol over HTTP, as an ASGI application.

Streams live at ``/v1/stream/<name>``. This module parses requests, calls the broker and turns its
:class:`~onceflow.core.broker.Outcome` into a response in one place (:func:`_outcome_response`, with the
status table of :mod:`onceflow.server.answers`).
It knows nothing of files. Extensions beyond the protocol are documented in ``docs/protocol.md``.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import importlib.resources
import json
import logging
import math
import random
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote_to_bytes

from ..core.broker import (
    MAX_NAME_BYTES,
    Broker,
    Outcome,
    ProducerHeaders,
    ReadResult,
    StreamState,
    parse_retention,
    txn_outcome,
    unstored,
    validate_name,
)
from ..core.jsonmode import parse_control, wrap_payloads
from ..core.refusal import Refusal
from ..core.subscriptions import SubscriptionError, WebhookTargets
from ..core.txn import SinkState, TxnError, TxnMeta, TxnStatus
from ..errors import OnceflowError
from ..storage.log import InvalidPosition, LogClosed, OffsetGone
from ..storage.position import Position, parse_token
from ..wire import CODINGS, COMPRESS_MIN, FRAME, MAX_SAFE_INT, RECORDS_MEDIA_TYPE, Coding, compress
from .answers import SUCCESS, answer_for
from .coding import BodyDecoder, DecodedTooLarge, Malformed, UnsupportedCoding, accepted_coding, content_coding
from .metrics import Metrics
from .routes import FORCE_ABORT, GROUPS_LIST_PATH, METRICS_PATH, PREFIX, TXN_LIST_PATH, Route, routed
from .subscriptions import SubscriptionAPI, subscription_error

__all__ = [
    "AnswerWithdrawn",
    "App",
    "AppConfig",
    "BadRequest",
    "body_coding",
    "fork_source",
    "list_prefix",
    "request_headers",
    "request_path",
]

log = logging.getLogger("onceflow.server")

Scope = MutableMapping[str, Any]
Readable = Callable[[str], bool]  # whether the request may read the stream of that name
ASGIMessage = MutableMapping[str, Any]  # an ASGI event (not the client's Message)
Receive = Callable[[], Awaitable[ASGIMessage]]
Send = Callable[[ASGIMessage], Awaitable[None]]

# An ASGI scope key: the guard's test of whether the request's token may read a stream (absent: any
# stream). Answers that show streams the request did not name (a group's positions, a
# transaction's streams) show only those; docs/security.md.
MAY_READ = "onceflow.may_read"
# A decimal integer as a query parameter or header gives it: bounded in length, as int() refuses
# more than 4300 digits (a ValueError, a 500, where the bad parameter is a 400); \Z, not $ (which
# takes a trailing newline).
_DIGITS = re.compile(r"[0-9]{1,1000}\Z")
_LINES = re.compile(r"\r\n|\r|\n")
CURSOR_EPOCH = 1728432000.0  # 2024-10-09T00:00:00Z, the protocol's default cursor epoch
CURSOR_INTERVAL = 20

_EXPOSE = (
    "Stream-Next-Offset, Stream-Cursor, Stream-Up-To-Date, Stream-Closed, Stream-TTL, Stream-Expires-At, "
    "Producer-Epoch, Producer-Seq, Producer-Expected-Seq, Producer-Received-Seq, Stream-SSE-Data-Encoding, "
    "ETag, Content-Type, Location, Stream-Last-Stable-Offset, Transaction-Number, Transaction-Committed"
)
_ALLOW_HEADERS = (
    "Content-Type, Authorization, Stream-Seq, Stream-TTL, Stream-Expires-At, Stream-Closed, Producer-Id, "
    "Producer-Epoch, Producer-Seq, Stream-Forked-From, Stream-Fork-Offset, Stream-Fork-Sub-Offset, "
    "If-None-Match, If-Match, Cache-Control, Transaction-Id, Transaction-Commit, Content-Encoding"
)
COMMON = [
    (b"access-control-allow-origin", b"*"),
    (b"access-control-expose-headers", _EXPOSE.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"cross-origin-resource-policy", b"cross-origin"),
]


# A stream's data is a client's, in whatever content type it was created with (text/html, SVG): a read
# of it is never active content on this server's origin, which the dashboard and the admin endpoints
# share (no script, a unique origin; nosniff is in COMMON). The dashboard has a policy of its own.
_SANDBOX = (b"content-security-policy", b"sandbox")


def _sandboxed(send: Send) -> Send:
    """``send``, with :data:`_SANDBOX` on the answer's headers."""

    async def sending(message: ASGIMessage) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message["headers"], _SANDBOX]}
        await send(message)

    return sending


@dataclass(slots=True)
class AppConfig:
    long_poll_timeout: float = 20.0
    max_body_bytes: int = 64 << 20
    sse_max_seconds: float = 60.0
    webhook_targets: WebhookTargets = "public"  # where webhooks may go (docs/security.md)
    metrics_allow: tuple[str, ...] = ()  # name prefixes that get a label of their own in /metrics
    # the most streams one group reset by time may move: each is a lookup in a time index, and
    # streams (forks above all) are free to create (docs/operations.md, "Groups: resets")
    max_time_reset_streams: int = 1000
    # the smallest read answer sent compressed to a client that accepts gzip or zstd; None: none is
    # (docs/protocol.md, "Compression")
    compress_min_bytes: int | None = COMPRESS_MIN


class BadRequest(OnceflowError):
    """A request the server refuses before it reaches the core: ``status``, ``code`` and ``headers``
    are its answer."""

    status: int

    def __init__(
        self, message: str, status: int = 400, code: str = "bad_request", headers: tuple[tuple[bytes, bytes], ...] = ()
    ) -> None:
        super().__init__(message, status=status, code=code)
        self.headers = headers


# Headers that name resources or carry protocol state: sent twice, a server that reads the first and
# a proxy or guard that reads the last would act on different requests, so a repeat is a 400.
_SINGLE_HEADER_PREFIXES = ("stream-", "producer-", "transaction-")
_SINGLE_HEADERS = frozenset(
    {
        "if-match",
        "if-none-match",
        "content-type",
        "content-length",
        "content-encoding",
        "transfer-encoding",
        "authorization",
        "host",
    }
)


# headers whose values are names (a stream, groups, a transactional id): UTF-8, as names in paths and
# bodies are; every other value is Latin-1, as HTTP has it
_NAME_HEADERS = frozenset({"stream-forked-from", "stream-retention-keep-groups", "transaction-id"})


def request_headers(scope: Scope) -> dict[str, str]:
    """The request's headers by lower-case name (latin-1; UTF-8 for the headers that carry names,
    a :class:`BadRequest` when they are not). A protocol header given more than once
    is a :class:`BadRequest` (every ``Stream-*``, ``Producer-*`` and ``Transaction-*`` header,
    ``If-Match``, ``If-None-Match``, ``Content-Type``, ``Content-Length``, ``Content-Encoding``,
    ``Transfer-Encoding``, ``Authorization`` and ``Host``); of any other repeated header the first
    counts. The guard reads headers through this function too, so both see the same request."""
    headers: dict[str, str] = {}
    for k, v in scope["headers"]:
        key = k.decode("latin-1").lower()
        if key in headers:
            if key in _SINGLE_HEADERS or key.startswith(_SINGLE_HEADER_PREFIXES):
                raise BadRequest(f"the header {key!r} is given more than once; send each protocol header once")
            continue
        if key in _NAME_HEADERS:
            try:
                headers[key] = v.decode("utf-8")
            except UnicodeDecodeError:
                raise BadRequest(f"the header {key!r} carries names: its value must be UTF-8") from None
        else:
            headers[key] = v.decode("latin-1")
    return headers


def request_path(scope: Scope) -> str:
    """The request path, percent-decoded strictly as UTF-8 (a :class:`BadRequest` otherwise).

    Decoded from ``raw_path`` where the server gives it: the HTTP front ends decode ``path``
    differently (onceflow's keeps undecodable bytes as surrogates, uvicorn replaces them with
    U+FFFD, so ``bad%ff``, ``bad%fe`` and ``bad%ef%bf%bd`` would be one name), and neither may
    name a stream. Without ``raw_path``, ``path`` must be encodable as UTF-8."""
    raw = scope.get("raw_path")
    if isinstance(raw, bytes | bytearray):
        try:
            return unquote_to_bytes(bytes(raw)).decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest("the path is not valid UTF-8 once percent-decoded") from None
    path: str = scope["path"]
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest("the path is not valid UTF-8 once percent-decoded") from None
    return path


_ACCEPTED = (b"accept-encoding", ", ".join(CODINGS).encode())  # on a 415: the codings a body may be in


def body_coding(method: str, path: str, headers: dict[str, str]) -> Coding | None:
    """The content coding of the request's body (``Content-Encoding``), None when it has none.

    A coded body is taken where a stream's data is: ``PUT`` and ``POST`` of ``/v1/stream/<name>``
    (server/coding.py decodes it as it is read). The bodies of the control endpoints (transactions,
    groups, sinks, subscriptions) are small JSON that the guard reads too: one in a coding is a
    ``415``, as is an unknown coding anywhere, naming the codings taken (``Accept-Encoding``, RFC
    9110 12.5.3). Methods whose body is never read (``GET``, ``HEAD``, ``DELETE``) are not refused
    for the header. The guard calls this too, so both refuse the same requests."""
    raw = headers.get("content-encoding")
    if raw is None or method not in ("PUT", "POST"):
        return None
    try:
        coding = content_coding(raw)
    except UnsupportedCoding as exc:
        raise BadRequest(str(exc), 415, "unsupported_encoding", (_ACCEPTED,)) from None
    if coding is None:
        return None
    name = path[len(PREFIX) :] if path.startswith(PREFIX) else None
    if name is None or name == "__ds" or name.startswith("__ds/"):
        raise BadRequest(
            f"a {coding} body is taken by appends and creates of streams only ({PREFIX}<name>); "
            "send this one as it is (without Content-Encoding)",
            415,
            "unsupported_encoding",
            (_ACCEPTED,),
        )
    return coding


def fork_source(headers: dict[str, str]) -> str | None:
    """The stream named by ``Stream-Forked-From`` (a stream URL path or a bare name), or None."""
    raw = headers.get("stream-forked-from")
    if raw is None:
        return None
    return raw[len(PREFIX) :] if raw.startswith(PREFIX) else raw.lstrip("/")


def list_prefix(scope: Scope) -> str:
    """The ``prefix`` parameter of the stream listing (``""``: every stream)."""
    query: bytes = scope.get("query_string", b"")
    return parse_qs(query.decode("latin-1"), keep_blank_values=True).get("prefix", [""])[0]


def _h(name: str, value: str | int) -> tuple[bytes, bytes]:
    return (name.encode(), str(value).encode())


def _error(
    status: int, code: str, message: str, extra: list[tuple[bytes, bytes]] | None = None
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    headers = [(b"content-type", b"application/json"), *(extra or [])]
    return status, headers, body


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


class AnswerWithdrawn(OnceflowError):
    """Raised by a ``send`` wrapped around the app (the leader's, once its lease ran out) to withdraw
    the answer being sent: the app stops handling the request, as after a client that went away, with
    no error of its own; the wrapper answers instead."""


class App:
    """ASGI application serving one :class:`Broker`."""

    def __init__(self, broker: Broker, config: AppConfig | None = None) -> None:
        self.broker = broker
        self.config = config or AppConfig()
        # the reserved __ds control APIs
        self.subscriptions = SubscriptionAPI(broker, webhook_targets=self.config.webhook_targets)
        self.metrics = Metrics(broker, self.config.metrics_allow)  # its own registry, fed by server/instrument.py
        self._sse_events = SseEvents()  # live readers of a stream share its reads and events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
            return
        if kind != "http":
            return
        try:
            await self._http(scope, receive, send)
        except AnswerWithdrawn:
            raise
        except Exception:
            log.exception("unhandled error for %s %s", scope.get("method"), scope.get("path"))
            status, headers, body = _error(500, "internal", "internal server error")
            await _send(send, status, headers, body)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await self.broker.start()
                self.subscriptions.start()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.subscriptions.close()
                await self.broker.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # ------------------------------------------------------------------ dispatch

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        method: str = scope["method"]
        try:
            path = request_path(scope)
            headers = request_headers(scope)
            coding = body_coding(method, path, headers)
        except BadRequest as exc:
            status, h, body = _error(exc.status, exc.code, str(exc), list(exc.headers))
            await _send(send, status, h, b"" if method == "HEAD" else body)
            return
        if method == "OPTIONS":
            await _send(
                send,
                204,
                [
                    (b"access-control-allow-methods", b"GET, POST, PUT, DELETE, HEAD, OPTIONS"),
                    (b"access-control-allow-headers", _ALLOW_HEADERS.encode()),
                    (b"access-control-max-age", b"86400"),
                ],
                b"",
            )
            return
        try:
            r = routed(scope, path)  # the one router (server/routes.py), shared with the guard and the metrics
        except SubscriptionError as exc:  # a control path that does not decode
            status, h, body = subscription_error(exc)
            await _send(send, status, h, b"" if method == "HEAD" else body)
            return
        area = r.key.partition(".")[0]
        if area in ("txn", "group", "sink"):
            try:
                status, h, body = await self._coordinated(r, method, headers, receive, scope)
            except BadRequest as exc:
                status, h, body = _error(exc.status, exc.code, str(exc), list(exc.headers))
            except TxnError as exc:
                status, h, body = _outcome_response(txn_outcome(exc))
            except OffsetGone as exc:  # a group reset whose scan retention overtook
                status, h, body = _gone(exc)
            except OSError as exc:  # the coordinator log could not be written (disk full, I/O error),
                # or its outcome is unknown (a lost answer to COMMIT): unstored() tells which
                log.error("%s %s: %s", method, path, exc)
                status, h, body = _outcome_response(
                    unstored(
                        "transaction log write",
                        exc,
                        refused="the transaction log could not be read or written (a logged decision is finished on recovery)",
                    )
                )
            await _send(send, status, h, body)
            return
        if r.key in ("txns.list", "groups.list", "sinks.list", "streams.list", "ui", "metrics", "other"):
            try:
                if r.key == "streams.list":
                    status, h, body = self._list(scope)
                elif r.key == "ui":
                    status, h, body = _dashboard(method)
                elif r.key == "metrics":
                    status, h, body = self._metrics(method, headers)
                elif r.refused is not None:
                    status, h, body = _error(r.refused[0], "not_found", r.refused[1])
                else:
                    status, h, body = self._admin_list(path, scope)
            except BadRequest as exc:
                status, h, body = _error(exc.status, exc.code, str(exc))
            await _send(send, status, h, b"" if method == "HEAD" else body)
            return
        name = r.name
        try:
            if area == "subs":
                status, h, body = await self.subscriptions.handle(scope, headers, receive, r)
                await _send(send, status, h, b"" if method == "HEAD" else body)
                return
            if method == "GET":
                await self._get(name, scope, headers, receive, send)
                return
            if method == "HEAD":
                status, h, body = self._head(name)
                await _send(send, status, h, b"")
                return
            if method == "PUT":
                status, h, body = await self._create(name, scope, headers, receive, coding)
            elif method == "POST":
                status, h, body = await self._post(name, headers, receive, coding)
            elif method == "DELETE":
                status, h, body = _outcome_response(self.broker.delete(name))
            else:
                assert r.refused is not None  # stream.other
                status, h, body = _error(405, "method_not_allowed", r.refused[1])
                h.append((b"allow", r.refused[2].encode()))
        except BadRequest as exc:
            status, h, body = _error(exc.status, exc.code, str(exc))
            if method == "HEAD":
                body = b""
        except OffsetGone as exc:
            status, h, body = _gone(exc)
        except OSError as exc:
            # the store failed, or did not answer within its bound (a cold read on the PostgreSQL
            # store: its read_timeout, storage/pgfs.py): a 503, never a 500, and the client retries
            log.error("%s %s: %s", method, path, exc)
            status, h, body = _outcome_response(
                unstored("request", exc, refused="the store could not serve this request")
            )
            if method == "HEAD":
                body = b""
        if status < 300:
            self.subscriptions.stream_changed(name)  # created, appended to, closed or deleted
        await _send(send, status, h, body)

    async def _create(
        self, name: str, scope: Scope, headers: dict[str, str], receive: Receive, coding: Coding | None
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """A PUT: the stream created (201, with its Location), confirmed, or refused."""
        body = await self._body(headers, receive, coding)
        refused = await self.broker.forget_offsets_of_deleted(name)
        if refused is not None:
            return _outcome_response(refused)
        status, h, body = self._put(name, headers, body)
        if status == 201:
            server_addr = scope.get("server") or ("127.0.0.1", 4437)
            host = headers.get("host") or f"{server_addr[0]}:{server_addr[1]}"
            h.append((b"location", f"{scope.get('scheme', 'http')}://{host}{PREFIX}{name}".encode()))
        return status, h, body

    async def _body(self, headers: dict[str, str], receive: Receive, coding: Coding | None = None) -> bytes:
        """The request's body, decoded from ``coding`` (server/coding.py: gzip as it comes, zstd once
        it has all come).

        ``--max-body`` bounds it twice: as sent (a declared ``Content-Length`` at once, a chunked
        body as it passes the bound) and decoded, so a small body that inflates past the bound is
        a ``413`` one byte past it, with nothing more decoded, and nothing stored. A body that is
        not valid in its coding is a ``400`` saying what is wrong with it."""
        limit = self.config.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise BadRequest(
                f"request body is larger than the server's limit of {limit} bytes", 413, "payload_too_large"
            )
        decoder = BodyDecoder(coding, limit) if coding is not None else None
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise BadRequest("client went away", 400, "disconnected")
                chunk = msg.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > limit:
                        raise BadRequest(
                            f"request body is larger than the server's limit of {limit} bytes",
                            413,
                            "payload_too_large",
                        )
                    if decoder is not None:
                        decoder.feed(chunk)
                    else:
                        chunks.append(chunk)
                if not msg.get("more_body", False):
                    break
            if decoder is not None:
                return decoder.end()
        except DecodedTooLarge as exc:
            raise BadRequest(str(exc), 413, "payload_too_large") from None
        except Malformed as exc:
            raise BadRequest(str(exc), 400, "bad_encoding") from None
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    # ------------------------------------------------------------------ transactions (extension)

    async def _json_body(self, headers: dict[str, str], receive: Receive) -> dict[str, Any]:
        raw = await self._body(headers, receive)
        if not raw:
            return {}
        try:
            value = parse_control(raw)
        except ValueError as exc:
            raise BadRequest(f"the body must be a JSON object: {exc}") from None
        except RecursionError:
            raise BadRequest("the body is JSON nested too deeply") from None
        if not isinstance(value, dict):
            raise BadRequest("the body must be a JSON object")
        return value

    @staticmethod
    def _int_field(body: dict[str, Any], key: str) -> int:
        value = body.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SAFE_INT:
            raise BadRequest(f"the body needs {key!r}: an integer from 0 to 2^53-1")
        return value

    def _offsets_field(self, body: dict[str, Any]) -> dict[str, str]:
        """A body's ``offsets``: positions this server issued, in streams that exist (each is kept in
        the coordinator, its log, every listing and scrape: a name is capped as every name is, and
        a commit can name no more streams than there are)."""
        offsets = body.get("offsets")
        if not isinstance(offsets, dict) or not offsets:
            raise BadRequest('the body needs "offsets": {"<stream>": "<offset>", ...}')
        for stream, off in offsets.items():
            if not _utf8(stream):
                raise BadRequest(f"stream name {stream!r} in offsets is not valid UTF-8 (a lone surrogate escape)")
            wrong = validate_name(stream)
            if wrong is not None:
                raise BadRequest(f"{wrong}: {stream[:80]!r} in offsets")
            if not isinstance(off, str) or parse_token(off) is None:
                raise BadRequest(f"offset for {stream!r} is not an offset this server issued: {off!r}")
        missing = [s for s in offsets if (found := self.broker.get(s)) is None or found.meta.soft_deleted]
        if missing:
            shown = ", ".join(repr(s) for s in missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise BadRequest(f"offsets name streams that do not exist: {shown}", 404, "not_found")
        return offsets

    @staticmethod
    def _group_name(group: str) -> str:
        if len(group.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            raise BadRequest(f"a group name is at most {MAX_NAME_BYTES} bytes, as every name is")
        return group

    async def _coordinated(
        self, r: Route, method: str, headers: dict[str, str], receive: Receive, scope: Scope
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """``/v1/txn/``, ``/v1/groups/`` and ``/v1/sinks/``: transactional ids, consumer groups and
        sinks (docs/transactions.md), each endpoint as the router named it."""
        if r.refused is not None:  # txn.other, group.other, sink.other
            status, message, allow = r.refused
            code = "method_not_allowed" if status == 405 else "not_found"
            raise BadRequest(message, status, code, ((b"allow", allow.encode()),) if allow else ())
        coord = self.broker.coordinator
        readable = may_read(scope)
        if r.key.startswith("txn."):
            tid = r.name
            if not tid or validate_name(tid):
                raise BadRequest("use /v1/txn/<transactional id>/(init|commit|abort|offsets)", 404, "not_found")
            if r.key == "txn.delete":
                if not await coord.drop_txn(tid):
                    raise BadRequest(f"transactional id {tid!r} was never initialised", 404, "unknown_transactional_id")
                return 204, [], b""
            if r.key == "txn.read":
                meta = coord.txns.get(tid)
                if meta is None:
                    raise BadRequest(f"transactional id {tid!r} was never initialised", 404, "not_found")
                return _json_response(200, self._txn_state(meta, readable))
            return await self._txn_action(tid, r.action, await self._json_body(headers, receive), readable)
        if r.key.startswith("group."):
            if r.key == "group.delete":  # the group itself may contain '/'
                if not r.name or not await coord.drop_group(self._group_name(r.name)):
                    raise BadRequest(
                        f"no group named {r.name!r} (it has no offsets and no member epoch)", 404, "not_found"
                    )
                return 204, [], b""
            group = self._group_name(r.name)
            if r.key == "group.reset":
                return await self._reset_group(group, await self._json_body(headers, receive), readable)
            if r.key == "group.commit":
                body = await self._json_body(headers, receive)
                member_epoch = body.get("member_epoch")
                if member_epoch is not None:
                    member_epoch = self._int_field(body, "member_epoch")
                await coord.commit_offsets(
                    group, self._offsets_field(body), member_epoch=member_epoch, reset=body.get("reset") is True
                )
            return _json_response(200, {"group": group, "offsets": _shown(coord.groups.get(group, {}), readable)})
        sink = r.name  # the sink id may contain '/': a POST's action is the last segment of the path
        if not sink or validate_name(sink):
            raise BadRequest(
                "use /v1/sinks/<sink id> or /v1/sinks/<sink id>/(begin|alive|commit|abort|reset)", 404, "not_found"
            )
        if r.key == "sink.read":
            return _json_response(200, _sink_json(sink, coord.sinks.get(sink)))
        return await self._sink_action(sink, r.action, await self._json_body(headers, receive))

    async def _txn_action(
        self, tid: str, action: str, body: dict[str, Any], readable: Readable
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """``POST /v1/txn/<tid>/<action>``."""
        coord = self.broker.coordinator
        if action == FORCE_ABORT:
            return await self._force_abort(tid, body, readable)
        if action == "init":
            timeout_ms = body.get("timeout_ms")
            if timeout_ms is not None and (
                not isinstance(timeout_ms, int) or isinstance(timeout_ms, bool) or not 1 <= timeout_ms <= 3_600_000
            ):
                raise BadRequest('"timeout_ms" must be an integer from 1 to 3600000')
            request_id = body.get("request_id")
            if request_id is not None and (not isinstance(request_id, str) or not 1 <= len(request_id) <= 200):
                raise BadRequest(
                    '"request_id" must be a string of 1 to 200 characters (the same for every retry of one init)'
                )
            expected = self._int_field(body, "expected_epoch") if body.get("expected_epoch") is not None else None
            meta = await coord.init(
                tid, timeout_ms / 1000 if timeout_ms else None, request_id=request_id, expected_epoch=expected
            )
            return _json_response(200, _txn_json(meta, readable))
        if action in ("commit", "abort"):
            meta = await coord.end(
                tid, self._int_field(body, "epoch"), self._int_field(body, "txn"), commit=action == "commit"
            )
            return _json_response(200, _txn_json(meta, readable))
        if action == "offsets":
            group = body.get("group")
            if not isinstance(group, str) or not group or not _utf8(group):
                raise BadRequest('the body needs "group": a non-empty string of valid UTF-8')
            self._group_name(group)
            txn = self._int_field(body, "txn") if body.get("txn") is not None else None
            meta = await coord.add_offsets(
                tid, self._int_field(body, "epoch"), group, self._offsets_field(body), txn=txn
            )
            return _json_response(200, _txn_json(meta, readable))
        raise AssertionError(f"the router gave txn action {action!r}")  # pragma: no cover

    async def _sink_action(
        self, sink: str, action: str, body: dict[str, Any]
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        coord = self.broker.coordinator
        query = self._name_field(body, "query")
        batch = self._int_field(body, "batch") if body.get("batch") is not None else None
        if action == "reset":
            if "owner" not in body:
                raise BadRequest(
                    'a reset needs "owner": the query the sink belongs to now (GET /v1/sinks/<sink> shows it), or null'
                )
            await coord.reset_sink(sink, self._name_field(body, "owner"))
            return _json_response(200, {"sink": sink, "status": "reset", "batch": None, "owner": None})
        if action == "alive":
            kept = coord.keep_alive(sink, query, batch)
            return _json_response(200, {"sink": sink, "kept": kept})
        if action == "begin":
            task = self._name_field(body, "task")
            if task is None:
                raise BadRequest(
                    'a task needs "task": a name of this task attempt (the same for every retry of one begin)'
                )
            timeout_ms = body.get("timeout_ms")
            if timeout_ms is not None and (
                not isinstance(timeout_ms, int) or isinstance(timeout_ms, bool) or not 1 <= timeout_ms <= 3_600_000
            ):
                raise BadRequest('"timeout_ms" must be an integer from 1 to 3600000')
            meta, state = await coord.begin_task(
                sink,
                partition=self._int_field(body, "partition"),
                task=task,
                batch=batch,
                query=query,
                txn_timeout=timeout_ms / 1000 if timeout_ms else None,
            )
            out = _sink_json(sink, state)
            if meta is None:
                # a replay: the task writes nothing; with a fingerprint recorded for this very batch it
                # still reports the fingerprint of its rows, so the commit can tell the input is the same
                check = state is not None and state.batch == batch and state.fingerprint is not None
                return _json_response(200, {**out, "status": "already_committed", "verify": check})
            return _json_response(
                200,
                {
                    **out,
                    "status": "write",
                    "id": meta.tid,
                    "producer_id": meta.producer_id,
                    "epoch": meta.epoch,
                    "txn": meta.txn,
                },
            )
        raw_members = body.get("members")
        if not isinstance(raw_members, list):
            raise BadRequest('the body needs "members": a list of {"id": ..., "epoch": ..., "txn": ...}')
        members: list[tuple[str, int, int]] = []
        for m in raw_members:
            if not isinstance(m, dict) or not isinstance(m.get("id"), str) or validate_name(m["id"]):
                raise BadRequest(f'each member needs "id" (a transactional id), "epoch" and "txn"; got {m!r}')
            members.append((m["id"], self._int_field(m, "epoch"), self._int_field(m, "txn")))
        prefix = body.get("abort_prefix")
        if prefix is not None and (not isinstance(prefix, str) or not prefix):
            raise BadRequest('"abort_prefix" must be a non-empty string')
        if action == "abort":
            await coord.abort_members(sink, members, prefix, query=query, batch=batch)
            return _json_response(
                200, {"sink": sink, "status": "aborted", "batch": _sink_json(sink, coord.sinks.get(sink))["batch"]}
            )
        fingerprint = self._name_field(body, "fingerprint")
        rows = self._int_field(body, "rows") if body.get("rows") is not None else None
        committed, last = await coord.commit_members(
            sink, batch, members, prefix, query=query, fingerprint=fingerprint, rows=rows
        )
        return _json_response(
            200, {"sink": sink, "status": "committed" if committed else "already_committed", "batch": last}
        )

    @staticmethod
    def _name_field(body: dict[str, Any], key: str) -> str | None:
        value = body.get(key)
        if value is not None and (
            not isinstance(value, str)
            or not 1 <= len(value) <= 200
            or any(ord(c) < 0x20 for c in value)
            or not _utf8(value)
        ):
            raise BadRequest(f'"{key}" must be a string of 1 to 200 printable characters, or null')
        return value

    # ------------------------------------------------------------------ list (extension)

    def _list(self, scope: Scope) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        prefix = list_prefix(scope)
        streams = [self._stream_json(s) for s in self.broker.list(prefix)]
        body = json.dumps({"streams": streams}, separators=(",", ":")).encode()
        return 200, [(b"content-type", b"application/json"), (b"cache-control", b"no-store")], body

    def _stream_json(self, s: StreamState) -> dict[str, object]:
        """One stream of the listing (docs/protocol.md, docs/operations.md)."""
        start, tail = s.earliest, s.tail
        keep_seconds, keep_bytes = self.broker.retention_of(s)  # in force: the stream's own, else the server's
        return {
            "name": s.name,
            "content_type": s.meta.content_type,
            "next_offset": tail.token(),
            "stable_offset": s.stable().token(),
            "closed": s.closed,
            "start_offset": start.token(),
            "messages": tail.offset - start.offset,
            "bytes": tail.pos - start.pos,
            "created_ms": s.meta.created_ms,
            "ttl_seconds": s.meta.ttl_seconds,
            "expires_at": s.meta.expires_at,
            "forked_from": s.meta.fork_parent,
            "producers": len(s.log.producers),
            "open_transactions": len(s.log.txn.open),
            "retention_seconds": keep_seconds,
            "retention_bytes": keep_bytes,
            "retention_keep_groups": s.meta.retention_keep_groups,
        }

    # ------------------------------------------------------------------ operator endpoints (extension)

    def _admin_list(self, path: str, scope: Scope) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """``GET /v1/txn``, ``/v1/groups`` and ``/v1/sinks`` (docs/operations.md): everything whose
        name starts with the ``prefix`` parameter, sorted by name."""
        params = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        prefix = list_prefix(scope)
        readable = may_read(scope)
        coord = self.broker.coordinator
        if path == TXN_LIST_PATH:
            raw_open = params.get("open", ["false"])[0]
            if raw_open not in ("true", "false"):
                raise BadRequest(f"open must be true or false, got {raw_open!r}")
            txns = [
                self._txn_detail(m, readable)
                for tid, m in sorted(coord.txns.items())
                if tid.startswith(prefix) and m.epoch >= 0 and (raw_open == "false" or _is_open(m))
            ]
            return _json_response(200, {"transactions": txns})
        if path == GROUPS_LIST_PATH:
            names = sorted(g for g in set(coord.groups) | set(coord.member_epochs) if g.startswith(prefix))
            return _json_response(200, {"groups": [self._group_lag(g, readable) for g in names]})
        sinks = [_sink_json(name, state) for name, state in sorted(coord.sinks.items()) if name.startswith(prefix)]
        return _json_response(200, {"sinks": sinks})

    @staticmethod
    def _txn_state(meta: TxnMeta, readable: Readable) -> dict[str, object]:
        """``GET /v1/txn/<id>``: the id's state, whether a transaction is open (or decided and not
        finished: either holds the last stable offset of its streams), and the groups whose
        offsets it carries."""
        return {
            **_txn_json(meta, readable),
            "open": _is_open(meta),
            "groups": sorted(g for g in meta.offsets if readable(g)),
        }

    def _txn_detail(self, meta: TxnMeta, readable: Readable) -> dict[str, object]:
        """A row of ``GET /v1/txn``: the id's state and, for an open transaction, ``open_ms``: the
        time its timeout counts (since it began, the server's last start, or a sink task's last
        keep-alive, whichever is latest)."""
        age = self.broker.coordinator.clock.monotonic() - meta.started
        return {**self._txn_state(meta, readable), "open_ms": int(age * 1000) if _is_open(meta) else None}

    def _group_lag(self, group: str, readable: Readable) -> dict[str, object]:
        """A group's committed offset in each stream, the stream's ends, and the lag: messages
        (records) from the committed offset to the last stable offset, which is what a
        read_committed consumer of the group has still to read (records of aborted transactions
        in between included); ``lag_bytes`` is the same distance in log bytes. Both are None
        when the stream is gone or the offset is not one of its positions (past its tail). An
        offset whose data retention deleted (``offset_gone``) counts from the earliest offset
        kept: what is gone cannot be read any more. Only streams the request may read are shown;
        ``hidden_streams`` counts the others, and the lag is that of the streams shown."""
        coord = self.broker.coordinator
        streams: list[dict[str, object]] = []
        total: int | None = None
        held = coord.groups.get(group, {})
        shown = _shown(held, readable)
        for name, token in sorted(shown.items()):
            entry: dict[str, object] = {
                "stream": name,
                "offset": token,
                "next_offset": None,
                "stable_offset": None,
                "lag": None,
                "lag_bytes": None,
                "offset_gone": False,
            }
            s = self.broker.get(name)
            at = parse_token(token)
            if s is not None and not s.meta.soft_deleted and at is not None:
                stable, tail, earliest = s.stable(), s.tail, s.earliest
                entry["next_offset"], entry["stable_offset"] = tail.token(), stable.token()
                if at.pos < earliest.pos:
                    entry["offset_gone"] = True
                    at = earliest
                if at.pos <= tail.pos and at.offset <= tail.offset:
                    entry["lag"] = max(0, stable.offset - at.offset)
                    entry["lag_bytes"] = max(0, stable.pos - at.pos)
                    total = (total or 0) + max(0, stable.offset - at.offset)
            streams.append(entry)
        return {
            "group": group,
            "member_epoch": coord.member_epochs.get(group),
            "lag": total,
            "streams": streams,
            "hidden_streams": len(held) - len(shown),
        }

    async def _force_abort(
        self, tid: str, body: dict[str, Any], readable: Readable
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """``POST /v1/txn/<id>/force-abort``: an operator aborts the id's open transaction and
        fences its epoch (:meth:`~onceflow.core.txn.Coordinator.abort_open`)."""
        epoch = self._int_field(body, "epoch") if body.get("epoch") is not None else None
        txn = self._int_field(body, "txn") if body.get("txn") is not None else None
        aborted_epoch, aborted_txn = await self.broker.coordinator.abort_open(tid, epoch=epoch, txn=txn)
        meta = self.broker.coordinator.txns[tid]
        return _json_response(
            200, {**self._txn_state(meta, readable), "aborted": {"epoch": aborted_epoch, "txn": aborted_txn}}
        )

    async def _reset_group(
        self, group: str, body: dict[str, Any], readable: Readable
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """``POST /v1/groups/<group>/reset``: move the group's offsets to the start of each stream
        (``earliest``), its last stable offset (``latest``), given offsets (``offsets``) or the
        first batch appended at or after ``time_ms`` (``time``), with one reset commit (or, with
        ``dry_run``, only say where they would go).

        A reset by time moves at most ``max_time_reset_streams`` streams (a 400 before any lookup
        otherwise) and pauses for the event loop between two streams' lookups
        (:meth:`~onceflow.core.broker.Broker.position_at_time`): one request's work is bounded by
        its size, and other requests are served meanwhile. A stream deleted during those pauses
        fails the reset (404) rather than have its offset committed for whatever stream of that
        name may exist by then."""
        to = body.get("to")
        if to not in ("earliest", "latest", "offsets", "time"):
            raise BadRequest('the body needs "to": "earliest", "latest", "offsets" or "time"')
        dry_run = body.get("dry_run", False)
        if not isinstance(dry_run, bool):
            raise BadRequest('"dry_run" must be true or false')
        coord = self.broker.coordinator
        before = dict(coord.groups.get(group, {}))  # a copy: the commit below changes the group in place
        wanted: dict[str, str] = {}
        if to == "offsets":
            if body.get("streams") is not None:
                raise BadRequest('a reset to "offsets" names its streams in "offsets", not in "streams"')
            wanted = self._offsets_field(body)
            names = list(wanted)
        else:
            names = self._reset_streams(body, before, group, readable)
        time_ms = self._int_field(body, "time_ms") if to == "time" else None
        if to != "time" and body.get("time_ms") is not None:
            raise BadRequest('"time_ms" goes with "to": "time" only')
        cap = self.config.max_time_reset_streams
        if to == "time" and len(names) > cap:
            which = (
                f"this one names {len(names)}"
                if body.get("streams") is not None
                else (f"group {group!r} has offsets in {len(names)}")
            )
            raise BadRequest(
                f'a reset by time moves at most {cap} streams ({which}): name them in "streams", in parts '
                f"of at most {cap} (--stream of onceflow groups reset); nothing was reset"
            )
        new: dict[str, str] = {}
        found: list[StreamState] = []
        for name in names:
            s = self.broker.get(name)
            if s is None or s.meta.soft_deleted:
                raise BadRequest(f"no stream named {name!r}: nothing was reset", 404, "not_found")
            new[name] = (await self._reset_position(s, to, wanted.get(name), time_ms)).token()
            found.append(s)
        for s in found:  # a lookup by time pauses: a stream may have been deleted (and made anew) since
            if self.broker.get(s.name) is not s or s.meta.soft_deleted:
                raise BadRequest(
                    f"stream {s.name!r} was deleted while the reset ran: nothing was reset", 404, "not_found"
                )
        if not dry_run:
            await coord.commit_offsets(group, new, reset=True)
        return _json_response(
            200,
            {
                "group": group,
                "to": to,
                "dry_run": dry_run,
                "offsets": new,
                "previous": {name: before.get(name) for name in new},
            },
        )

    async def _reset_position(self, s: StreamState, to: str, offset: str | None, time_ms: int | None) -> Position:
        """Where a reset ``to`` earliest, latest, an ``offset`` or ``time_ms`` puts a group in ``s``."""
        if to == "earliest":
            return s.earliest  # where a read from -1 starts: the start, or where retention left it
        if to == "latest":
            return s.stable()
        if to == "offsets":
            assert offset is not None
            try:
                at = self.broker.resolve_start(s, offset)
            except OffsetGone as exc:
                gone = answer_for(Refusal.OFFSET_GONE)
                raise BadRequest(
                    f"offset for stream {s.name!r}: {exc}; nothing was reset", gone.status, gone.code
                ) from None
            if isinstance(at, str):
                raise BadRequest(f"offset for stream {s.name!r}: {at}; nothing was reset")
            return at
        assert time_ms is not None
        try:
            return await self.broker.position_at_time(s, time_ms)
        except OffsetGone as exc:  # retention deleted what the scan was reading
            gone = answer_for(Refusal.OFFSET_GONE)
            raise BadRequest(f"stream {s.name!r}: {exc}; nothing was reset", gone.status, gone.code) from None
        except InvalidPosition as exc:
            raise BadRequest(f"{exc}: nothing was reset", 404, "not_found") from None

    @staticmethod
    def _reset_streams(body: dict[str, Any], committed: dict[str, str], group: str, readable: Readable) -> list[str]:
        """The streams a reset moves: ``streams`` in the body (the guard checked them), else every
        stream the group has committed an offset in, each of which the request must be allowed to
        read (the guard cannot see them in the request; they are not named in the refusal)."""
        raw = body.get("streams")
        if raw is None:
            if not committed:
                raise BadRequest(
                    f'group {group!r} has no committed offsets: name the streams to reset ("streams"; '
                    "--stream of onceflow groups reset)"
                )
            hidden = len(committed) - len(_shown(committed, readable))
            if hidden:
                raise BadRequest(
                    f"group {group!r} holds offsets in {hidden} stream(s) this token may not read: "
                    'name the streams to reset ("streams"; --stream of onceflow groups reset)',
                    403,
                    "forbidden",
                )
            return sorted(committed)
        if not isinstance(raw, list) or not raw or not all(isinstance(n, str) and n for n in raw):
            raise BadRequest('"streams" must be a non-empty list of stream names')
        return list(dict.fromkeys(raw))

    # ------------------------------------------------------------------ metrics

    def _metrics(self, method: str, headers: dict[str, str]) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        if method not in ("GET", "HEAD"):
            status, h, body = _error(405, "method_not_allowed", f"{method} is not supported on {METRICS_PATH}")
            h.append((b"allow", b"GET, HEAD, OPTIONS"))
            return status, h, body
        body, content_type = self.metrics.scrape(headers.get("accept"))
        return 200, [(b"content-type", content_type.encode()), (b"cache-control", b"no-store")], body

    # ------------------------------------------------------------------ PUT

    def _put(self, name: str, headers: dict[str, str], body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        fork_from = fork_source(headers)
        retention = parse_retention(
            headers.get("stream-retention-seconds"),
            headers.get("stream-retention-bytes"),
            headers.get("stream-retention-keep-groups"),
        )
        if isinstance(retention, str):
            raise BadRequest(retention)
        outcome = self.broker.create(
            name,
            content_type=headers.get("content-type"),
            ttl=headers.get("stream-ttl"),
            expires_at=headers.get("stream-expires-at"),
            closed=_is_true(headers.get("stream-closed")),
            body=body,
            fork_from=fork_from,
            fork_offset=headers.get("stream-fork-offset"),
            fork_sub_offset=headers.get("stream-fork-sub-offset"),
            retention=retention,
        )
        return _outcome_response(outcome)

    # ------------------------------------------------------------------ POST

    async def _post(
        self, name: str, headers: dict[str, str], receive: Receive, coding: Coding | None
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        close = _is_true(headers.get("stream-closed"))
        producer = _producer_headers(headers)
        if_match: Position | None = None
        raw_match = headers.get("if-match")
        if raw_match is not None:
            if_match = parse_token(raw_match.strip().strip('"'))
            if if_match is None:
                raise BadRequest(f"If-Match must be an offset this server issued, got {raw_match!r}")
        body = await self._body(headers, receive, coding)
        if not body and not close:
            raise BadRequest("empty body: an append needs data (or Stream-Closed: true to close)")
        content_type = headers.get("content-type")
        if body and not content_type:
            raise BadRequest("Content-Type is required when appending data")
        commit_txn: int | None = None
        raw_commit = headers.get("transaction-commit")
        if raw_commit is not None:
            commit_txn = _parse_txn_number(raw_commit)
        outcome = await self.broker.append(
            name,
            body,
            content_type=content_type,
            close=close,
            producer=producer,
            stream_seq=headers.get("stream-seq"),
            if_match=if_match,
            transactional_id=headers.get("transaction-id"),
            commit_txn=commit_txn,
        )
        return _outcome_response(outcome)

    # ------------------------------------------------------------------ HEAD

    def _head(self, name: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        s = self.broker.get(name)
        if s is None:
            return 404, [(b"content-type", b"application/json")], b""
        if s.meta.soft_deleted:
            return 410, [(b"content-type", b"application/json")], b""
        tail = s.tail
        h = [
            (b"content-type", s.meta.content_type.encode()),
            (b"stream-next-offset", tail.token().encode()),
            (b"cache-control", b"no-store"),
            (b"etag", _etag(s, "-1", tail, s.closed)),
            (b"stream-last-stable-offset", s.stable().token().encode()),
        ]
        if s.closed:
            h.append((b"stream-closed", b"true"))
        if s.meta.ttl_seconds is not None:
            h.append(_h("stream-ttl", s.meta.ttl_seconds))
        if s.meta.expires_at is not None:
            h.append(_h("stream-expires-at", s.meta.expires_at))
        earliest = s.earliest
        if earliest.pos > 0:  # retention deleted the start of the stream
            h.append((b"stream-earliest-offset", earliest.token().encode()))
        return 200, h, b""

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


# ---------------------------------------------------------------------- helpers


def _gone(exc: OffsetGone) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The answer to a read of data retention deleted: 410, naming the earliest offset kept (in the
    body and in ``Stream-Earliest-Offset``), where a reader may go on if losing the rest is fine."""
    answer = answer_for(Refusal.OFFSET_GONE)
    earliest = exc.earliest.token()
    body = json.dumps({"error": {"code": answer.code, "message": str(exc), "earliest_offset": earliest}}).encode()
    return answer.status, [(b"content-type", b"application/json"), (b"stream-earliest-offset", earliest.encode())], body


@functools.cache
def _dashboard_page() -> bytes:
    return importlib.resources.files("onceflow.server").joinpath("ui/index.html").read_bytes()


# The page's own script and styles are inline; it fetches only this server's JSON and /metrics.
_UI_POLICY = (
    b"default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src 'self' data:; "
    b"connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
)


def _dashboard(method: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """``GET /ui``: the dashboard, one HTML file shipped in the package (docs/operations.md)."""
    if method not in ("GET", "HEAD"):
        status, h, body = _error(405, "method_not_allowed", f"{method} is not supported on /ui; use GET")
        return status, [*h, (b"allow", b"GET, HEAD")], body
    return (
        200,
        [
            (b"content-type", b"text/html; charset=utf-8"),
            (b"cache-control", b"no-store"),
            (b"content-security-policy", _UI_POLICY),
        ],
        _dashboard_page(),
    )


def _utf8(text: str) -> bool:
    """Whether ``text`` is valid UTF-8 text: a JSON body's ``"\\ud800"`` is a lone surrogate, which
    no path can carry (:func:`request_path`) and no listing, label or terminal can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _json_response(status: int, value: object) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    return (
        status,
        [(b"content-type", b"application/json"), (b"cache-control", b"no-store")],
        json.dumps(value, separators=(",", ":")).encode(),
    )


def _parse_txn_number(raw: str) -> int:
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        raise BadRequest(
            f"Transaction-Commit must be the number of the transaction to commit (a non-negative integer), got {raw!r}"
        )
    return int(text)


def may_read(scope: Scope) -> Readable:
    """Whether the request may read a stream: the guard's test (:data:`MAY_READ`), or yes to every
    stream when no guard checks the request."""
    readable: Readable | None = scope.get(MAY_READ)
    return readable if readable is not None else _any_stream


def _any_stream(name: str) -> bool:
    return True


def _shown(offsets: dict[str, str], readable: Readable) -> dict[str, str]:
    """``offsets`` (stream -> position) without the streams the request may not read."""
    return offsets if readable is _any_stream else {n: t for n, t in offsets.items() if readable(n)}


def _txn_json(meta: TxnMeta, readable: Readable) -> dict[str, object]:
    return {
        "transactional_id": meta.tid,
        "producer_id": meta.producer_id,
        "epoch": meta.epoch,
        "txn": meta.txn,
        "status": meta.status.value,
        "streams": sorted(n for n in meta.streams if readable(n)),
        "timeout_ms": int(meta.timeout * 1000),
    }


def _sink_json(sink: str, state: SinkState | None) -> dict[str, object]:
    """What ``GET /v1/sinks/<sink>`` shows: the last committed batch and the query owning the sink."""
    return {
        "sink": sink,
        "batch": state.batch if state else None,
        "owner": state.owner if state else None,
        "rows": state.rows if state else None,  # of its last committed batch, as its writers counted them
    }


def _is_open(meta: TxnMeta) -> bool:
    """A transaction is open (or decided and not finished yet): it holds the LSO of its streams."""
    return meta.status in (TxnStatus.ONGOING, TxnStatus.PREPARE_COMMIT, TxnStatus.PREPARE_ABORT)


def _is_true(value: str | None) -> bool:
    return value is not None and value.strip().lower() == "true"


def _producer_headers(headers: dict[str, str]) -> ProducerHeaders | None:
    pid = headers.get("producer-id")
    epoch = headers.get("producer-epoch")
    seq = headers.get("producer-seq")
    given = [x is not None for x in (pid, epoch, seq)]
    if not any(given):
        return None
    if not all(given):
        raise BadRequest("Producer-Id, Producer-Epoch and Producer-Seq must be sent together")
    assert pid is not None and epoch is not None and seq is not None
    if pid == "":
        raise BadRequest("Producer-Id must not be empty")
    for label, value in (("Producer-Epoch", epoch), ("Producer-Seq", seq)):
        if not _DIGITS.match(value) or int(value) > MAX_SAFE_INT:
            raise BadRequest(f"{label} must be an integer from 0 to 2^53-1, got {value!r}")
    return ProducerHeaders(pid, int(epoch), int(seq))


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


async def _send(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    length = [] if status in (204, 304) else [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": COMMON + headers + length})
    await send({"type": "http.response.body", "body": body})


def _outcome_response(o: Outcome) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The one place where broker outcomes become HTTP statuses and headers (the statuses come
    from :mod:`onceflow.server.answers`)."""
    h: list[tuple[bytes, bytes]] = []
    if not isinstance(o.kind, Refusal):
        status = SUCCESS[o.kind]
        if o.kind in ("created", "exists"):
            assert o.stream is not None
            meta = o.stream.meta
            h.append((b"content-type", meta.content_type.encode()))
            if meta.ttl_seconds is not None:
                h.append(_h("stream-ttl", meta.ttl_seconds))
            if meta.expires_at is not None:
                h.append(_h("stream-expires-at", meta.expires_at))
        if o.next is not None:
            h.append((b"stream-next-offset", o.next.token().encode()))
        if o.closed:
            h.append((b"stream-closed", b"true"))
        if o.epoch is not None:
            h.append(_h("producer-epoch", o.epoch))
            h.append(_h("producer-seq", o.seq if o.seq is not None else 0))
            if o.kind == "appended":
                status = 200  # a new append by an idempotent producer (204 is its duplicate)
            if o.txn is not None:
                h.append(_h("transaction-number", o.txn))
            if o.committed:
                h.append((b"transaction-committed", b"true"))
        return status, h, b""
    answer = answer_for(o.kind)
    code = answer.code
    extra: list[tuple[bytes, bytes]] = []
    if code in ("stream_closed", "tail_mismatch") and o.next is not None:
        extra.append((b"stream-next-offset", o.next.token().encode()))
    if code == "stream_closed":
        extra.append((b"stream-closed", b"true"))
    if code == "stale_epoch" and o.epoch is not None:
        extra.append(_h("producer-epoch", o.epoch))
    if code in ("txn_refused", "concurrent_transactions") and o.txn is not None:
        extra.append(_h("transaction-number", o.txn))
    if code == "sequence_gap":
        extra.append(_h("producer-expected-seq", o.expected_seq or 0))
        extra.append(_h("producer-received-seq", o.received_seq or 0))
    if answer.retry_after:
        extra.append((b"retry-after", b"1"))
    return _error(answer.status, code, o.detail or code.replace("_", " "), extra)
