"""The Durable Streams protocol over HTTP, as an ASGI application.

Streams live at ``/v1/stream/<name>``. This module parses requests, calls the broker and turns its
:class:`~onceflow.core.broker.Outcome` into a response in one place (:func:`_outcome_response`, with the
status table of :mod:`onceflow.server.answers`).
It knows nothing of files. Extensions beyond the protocol are documented in ``docs/protocol.md``.
"""

from __future__ import annotations

import functools
import importlib.resources
import logging
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from ..core.broker import (
    Broker,
    Outcome,
    ProducerHeaders,
    parse_retention,
    txn_outcome,
    unstored,
)
from ..core.refusal import Refusal
from ..core.subscriptions import SubscriptionError, WebhookTargets
from ..core.txn import TxnError
from ..errors import OnceflowError
from ..storage.log import OffsetGone
from ..storage.position import Position, parse_token
from ..wire import CODINGS, COMPRESS_MIN, MAX_SAFE_INT, Coding
from .answering import (
    _DIGITS,
    BadRequest,
    Receive,
    Scope,
    Send,
    _error,
    _gone,
    _h,
    _send,
)
from .answers import SUCCESS, answer_for
from .coding import BodyDecoder, DecodedTooLarge, Malformed, UnsupportedCoding, content_coding
from .extensions import Extensions
from .metrics import Metrics
from .reads import Reads, SseEvents, _etag
from .routes import METRICS_PATH, PREFIX, routed
from .subscriptions import SubscriptionAPI, subscription_error

__all__ = [
    "AnswerWithdrawn",
    "App",
    "AppConfig",
    "body_coding",
    "fork_source",
    "request_headers",
    "request_path",
]

log = logging.getLogger("onceflow.server")


_ALLOW_HEADERS = (
    "Content-Type, Authorization, Stream-Seq, Stream-TTL, Stream-Expires-At, Stream-Closed, Producer-Id, "
    "Producer-Epoch, Producer-Seq, Stream-Forked-From, Stream-Fork-Offset, Stream-Fork-Sub-Offset, "
    "If-None-Match, If-Match, Cache-Control, Transaction-Id, Transaction-Commit, Content-Encoding"
)


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


class AnswerWithdrawn(OnceflowError):
    """Raised by a ``send`` wrapped around the app (the leader's, once its lease ran out) to withdraw
    the answer being sent: the app stops handling the request, as after a client that went away, with
    no error of its own; the wrapper answers instead."""


class App(Extensions, Reads):
    """ASGI application serving one :class:`Broker` (the extensions' endpoints: server/extensions.py)."""

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


# ---------------------------------------------------------------------- helpers


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


def _parse_txn_number(raw: str) -> int:
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        raise BadRequest(
            f"Transaction-Commit must be the number of the transaction to commit (a non-negative integer), got {raw!r}"
        )
    return int(text)


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
