"""The outermost ASGI layer: what ``/metrics`` counts of each request (server/metrics.py).

It sits in front of the guard (so the guard's refusals are counted too) and changes nothing of a
request or its answer. Per request it routes the method and the path with the router the guard
and the app use (server/routes.py), which leaves the route in the scope for them: the ``route``
label is the endpoint key of docs/security.md's table, plus ``stream.live`` for long-poll and SSE
reads and ``options``. It notes the status of the answer, and for an error the ``code`` of its JSON
body. An idempotent producer's duplicate (an append answered ``204`` with ``Producer-Epoch``, not a
close) is code ``duplicate``."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from urllib.parse import parse_qs

from ..errors import OnceflowError
from .answering import ASGIMessage, Receive, Scope, Send
from .metrics import Metrics
from .routes import routed

__all__ = ["Instrumented", "classify"]

ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
READS = ("stream.read", "stream.live")


def classify(method: str, scope: Scope) -> tuple[str, str]:
    """(route label, name in the path) of a request: the one router's (server/routes.py), which
    leaves its answer in the scope for the guard and the app."""
    if method == "OPTIONS":
        return "options", ""
    try:
        r = routed(scope, scope["path"])
    except OnceflowError:  # a subscription path that does not decode: the app answers 400
        return "other", ""
    if r.key == "stream.read" and b"live=" in scope.get("query_string", b""):
        live = parse_qs(scope["query_string"].decode("latin-1")).get("live", [""])[0]
        if live in ("long-poll", "sse"):
            return "stream.live", r.name
    return r.key, r.name


def _error_code(body: bytes) -> str:
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return ""
    return code if isinstance(code, str) else ""


def _duplicate(headers: list[tuple[bytes, bytes]]) -> bool:
    """A 204 to an append is a duplicate when it names the producer's epoch and does not close."""
    epoch = False
    for k, _ in headers:
        if k == b"producer-epoch":
            epoch = True
        elif k == b"stream-closed":
            return False
    return epoch


class Instrumented:
    """Times every HTTP request through ``inner`` and counts it in ``metrics``."""

    def __init__(self, inner: ASGIApp, metrics: Metrics) -> None:
        self.inner = inner
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.inner(scope, receive, send)
            return
        began = time.perf_counter()
        key, name = classify(scope["method"], scope)
        append = key == "stream.append"
        counts_out = key in READS
        status = 0
        code = ""
        sent = 0
        got = 0

        async def sending(message: ASGIMessage) -> None:
            nonlocal status, code, sent
            await send(message)  # first: an answer withdrawn (AnswerWithdrawn) or not sent is not counted
            if message["type"] == "http.response.start":
                status = message["status"]
                if append and status == 204 and _duplicate(message.get("headers", [])):
                    code = "duplicate"
            else:
                body = message.get("body", b"")
                if body:
                    if status >= 400 and not code:
                        code = _error_code(body)
                    if counts_out:
                        sent += len(body)

        async def receiving() -> ASGIMessage:
            nonlocal got
            message = await receive()
            got += len(message.get("body", b""))
            return message

        live = key == "stream.live"
        if live:
            self.metrics.live_readers += 1
        try:
            await self.inner(scope, receiving if append else receive, sending)
        finally:
            m = self.metrics
            if live:
                m.live_readers -= 1
            m.request(key, status, code, time.perf_counter() - began)
            if append and status in (200, 204) and code != "duplicate":
                m.appended(name, got)
            elif counts_out and status == 200:
                m.read(name, sent)
