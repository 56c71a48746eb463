"""What the app's endpoints answer with: the request's types, a refusal (:class:`BadRequest`) and
the JSON answers, shared by the protocol's endpoints (server/app.py) and onceflow's extensions
(server/extensions.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

from ..core.refusal import Refusal
from ..errors import OnceflowError
from ..storage.log import OffsetGone
from .answers import answer_for

__all__ = [
    "MAY_READ",
    "ASGIMessage",
    "BadRequest",
    "Readable",
    "Receive",
    "Scope",
    "Send",
    "list_prefix",
    "may_read",
]

Scope = MutableMapping[str, Any]
Readable = Callable[[str], bool]  # whether the request may read the stream of that name
ASGIMessage = MutableMapping[str, Any]  # an ASGI event (not the client's Message)
Receive = Callable[[], Awaitable[ASGIMessage]]
Send = Callable[[ASGIMessage], Awaitable[None]]

# An ASGI scope key: the guard's test of whether the request's token may read a stream (absent: any
# stream). Answers that show streams the request did not name (a group's positions, a
# transaction's streams) show only those; docs/security.md.
MAY_READ = "onceflow.may_read"


class BadRequest(OnceflowError):
    """A request the server refuses before it reaches the core: ``status``, ``code`` and ``headers``
    are its answer."""

    status: int

    def __init__(
        self, message: str, status: int = 400, code: str = "bad_request", headers: tuple[tuple[bytes, bytes], ...] = ()
    ) -> None:
        super().__init__(message, status=status, code=code)
        self.headers = headers


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


def _gone(exc: OffsetGone) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The answer to a read of data retention deleted: 410, naming the earliest offset kept (in the
    body and in ``Stream-Earliest-Offset``), where a reader may go on if losing the rest is fine."""
    answer = answer_for(Refusal.OFFSET_GONE)
    earliest = exc.earliest.token()
    body = json.dumps({"error": {"code": answer.code, "message": str(exc), "earliest_offset": earliest}}).encode()
    return answer.status, [(b"content-type", b"application/json"), (b"stream-earliest-offset", earliest.encode())], body


def _utf8(text: str) -> bool:
    """Whether ``text`` is valid UTF-8 text: a JSON body's ``"\\ud800"`` is a lone surrogate, which
    no path can carry (:func:`~onceflow.server.app.request_path`) and no listing, label or terminal can encode."""
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


# A decimal integer as a query parameter or header gives it: bounded in length, as int() refuses
# more than 4300 digits (a ValueError, a 500, where the bad parameter is a 400); \Z, not $ (which
# takes a trailing newline).
_DIGITS = re.compile(r"[0-9]{1,1000}\Z")


_EXPOSE = (
    "Stream-Next-Offset, Stream-Cursor, Stream-Up-To-Date, Stream-Closed, Stream-TTL, Stream-Expires-At, "
    "Producer-Epoch, Producer-Seq, Producer-Expected-Seq, Producer-Received-Seq, Stream-SSE-Data-Encoding, "
    "ETag, Content-Type, Location, Stream-Last-Stable-Offset, Transaction-Number, Transaction-Committed"
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


async def _send(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    length = [] if status in (204, 304) else [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": COMMON + headers + length})
    await send({"type": "http.response.body", "body": body})
