"""HTTP for the reserved subscription APIs under ``/v1/stream/__ds`` (PROTOCOL.md sections 6-7).

Routes (``{root}`` is ``/v1/stream``)::

    GET    {root}/__ds/jwks.json                         webhook signing keys (JWK Set)
    PUT    {root}/__ds/subscriptions/:id                 create (201) or re-confirm (200)
    GET    {root}/__ds/subscriptions/:id                 read
    DELETE {root}/__ds/subscriptions/:id                 delete (204, idempotent)
    POST   {root}/__ds/subscriptions/:id/streams         add explicit streams (204)
    DELETE {root}/__ds/subscriptions/:id/streams/:path   remove an explicit stream (204)
    POST   {root}/__ds/subscriptions/:id/callback        webhook receiver's answer (Bearer callback token)
    POST   {root}/__ds/subscriptions/:id/claim           pull-wake: take the wake
    POST   {root}/__ds/subscriptions/:id/ack             pull-wake: ack / heartbeat / done (Bearer claim token)
    POST   {root}/__ds/subscriptions/:id/release         pull-wake: hand the wake back (Bearer claim token)

The semantics live in :mod:`onceflow.core.subscriptions`; this module parses requests, turns
:class:`SubscriptionError` into ``{"error": {"code", "message"}}`` responses and POSTs webhooks
with httpx.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import socket
import ssl
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx

from ..core.broker import Broker
from ..core.jsonmode import parse_control
from ..core.refusal import Refusal
from ..core.subscriptions import (
    DeliveryError,
    SubscriptionError,
    Subscriptions,
    WebhookTargets,
    allowed_target,
    parse_config,
)
from .answers import answer_for
from .routes import STREAM_ROOT, Route

__all__ = ["MAX_BODY", "SubscriptionAPI", "subscription_error"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Response = tuple[int, list[tuple[bytes, bytes]], bytes]

MAX_BODY = 1 << 20
MAX_ANSWER = 64 << 10  # how much of a webhook's response body is read (for {"done": true})
_HOST = re.compile(r"^[A-Za-z0-9.\-]+(:[0-9]{1,5})?$|^\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?$")


def _json(status: int, value: object, extra: list[tuple[bytes, bytes]] | None = None) -> Response:
    headers = [(b"content-type", b"application/json"), (b"cache-control", b"no-store"), *(extra or [])]
    return status, headers, json.dumps(value, separators=(",", ":")).encode()


def subscription_error(exc: SubscriptionError) -> Response:
    """The answer to a refusal of the control API, in the Durable Streams protocol's words."""
    return _error(exc)


def _error(exc: SubscriptionError) -> Response:
    answer = answer_for(exc.refusal)
    return _json(answer.status, {"error": {"code": answer.code, "message": str(exc), **exc.extra}})


def _not_allowed(method: str, allowed: str) -> Response:
    body = {"error": {"code": "METHOD_NOT_ALLOWED", "message": f"{method} is not supported here; use {allowed}"}}
    return _json(405, body, [(b"allow", allowed.encode())])


class _BodyError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class SubscriptionAPI:
    """The ``__ds`` control routes of one :class:`~onceflow.server.app.App`."""

    def __init__(self, broker: Broker, *, webhook_targets: WebhookTargets = "public") -> None:
        self.webhook_targets = webhook_targets  # onceflow serve --webhook-targets
        self.manager = Subscriptions(broker, self._post)
        self._client: httpx.AsyncClient | None = None
        self._ssl: ssl.SSLContext | None = None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            pass  # started by the first request or stream change instead
        else:
            loop.call_soon(self.manager.try_start)

    def load(self) -> None:
        """Read the subscriptions on disk (blocking: for a worker thread); :meth:`start` does it otherwise."""
        self.manager.load()

    def start(self) -> None:
        self.manager.start()

    async def close(self) -> None:
        await self.manager.close()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def stream_changed(self, name: str) -> None:
        """Call after a request created, appended to, closed or deleted stream ``name``."""
        self.manager.stream_changed(name)

    # ------------------------------------------------------------------ requests

    async def handle(self, scope: Scope, headers: dict[str, str], receive: Receive, r: Route) -> Response:
        """Answer a request whose path is ``/v1/stream/__ds`` or below it, routed to ``r``."""
        method: str = scope["method"]
        try:
            self.manager.start()
        except OSError as exc:
            # The store could not read the subscriptions: a 503, never a 500, and the next request
            # (or stream change) tries again.
            refused = SubscriptionError(Refusal.SUBSCRIPTION_UNAVAILABLE, f"the subscriptions could not be read: {exc}")
            return _error(refused)
        try:
            return await self._answer(method, r, scope, headers, receive)
        except SubscriptionError as exc:
            return _error(exc)
        except _BodyError as exc:
            return _json(exc.status, {"error": {"code": exc.code, "message": str(exc)}})

    async def _answer(self, method: str, r: Route, scope: Scope, headers: dict[str, str], receive: Receive) -> Response:
        if r.refused is not None:  # subs.other, or a method the endpoint does not take
            status, message, allow = r.refused
            if status == 405:
                return _not_allowed(method, allow)
            raise SubscriptionError(Refusal.NO_CONTROL_API, message)
        m, sid = self.manager, r.name
        if r.key == "subs.jwks":
            try:
                jwks = m.jwks()
            except (OSError, ValueError) as exc:
                raise SubscriptionError(
                    Refusal.SUBSCRIPTION_UNAVAILABLE, f"the webhook signing key is unavailable: {exc}"
                ) from None
            return (
                200,
                [
                    (b"content-type", b"application/jwk-set+json"),
                    (b"cache-control", b"public, max-age=300"),
                ],
                json.dumps(jwks, separators=(",", ":")).encode(),
            )
        if r.key == "subs.create":
            config = parse_config(await _read_json(headers, receive), webhook_targets=self.webhook_targets)
            sub, created = await m.create(sid, config, _base_url(scope, headers))
            return _json(201 if created else 200, m.describe(sub, _jwks_url(scope, headers)))
        if r.key == "subs.read":
            return _json(200, m.describe(m.get(sid), _jwks_url(scope, headers)))
        if r.key == "subs.delete":
            await m.delete(sid)
            return 204, [], b""
        if r.key == "subs.add_streams":
            await m.add_streams(sid, await _read_json(headers, receive))
            return 204, [], b""
        if r.key == "subs.remove_stream":
            await m.remove_stream(sid, r.extra)
            return 204, [], b""
        body = await _read_json(headers, receive)
        if r.key == "subs.claim":
            return _json(200, await m.claim(sid, body))
        token = _bearer(headers)  # subs.wake
        if r.action == "callback":
            return _json(200, await m.callback(sid, token, body))
        if r.action == "ack":
            return _json(200, await m.ack(sid, token, body))
        await m.release(sid, token, body)
        return 204, [], b""

    # ------------------------------------------------------------------ webhook delivery

    async def _post(self, url: str, body: bytes, headers: dict[str, str], seconds: float) -> tuple[int, bytes]:
        """POST a wake to the address its URL resolves to now, once that address is checked.

        1. Resolve the host (an IP literal is its own answer) and refuse unless every address is an
           allowed target (:func:`~onceflow.core.subscriptions.allowed_target` under
           ``--webhook-targets``), whatever the URL passed at creation.
        2. Connect to the first of those addresses, not to the name: the HTTP client does not
           resolve again, so a DNS answer that changes in between (rebinding) cannot redirect the
           POST. ``Host`` and the TLS server name (SNI, and so the certificate check) stay the URL's.
        3. No connection is reused (another name may resolve to the same address).
        """
        target = httpx.URL(url)
        host = target.raw_host.decode("ascii")  # IDNA-encoded; an IPv6 literal without brackets
        pinned = await _pinned_address(
            host, target.port or (443 if target.scheme == "https" else 80), targets=self.webhook_targets
        )
        extensions: dict[str, Any] = {}
        if pinned != host:
            headers = {**headers, "host": target.netloc.decode("ascii")}
            target = target.copy_with(host=pinned)
            if target.scheme == "https":
                extensions["sni_hostname"] = host
        if self._client is None:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            self._client = httpx.AsyncClient(
                follow_redirects=False,
                trust_env=False,
                verify=self._ssl,
                limits=httpx.Limits(max_keepalive_connections=0),
            )
        try:
            async with self._client.stream(
                "POST", target, content=body, headers=headers, timeout=seconds, extensions=extensions
            ) as resp:
                chunks: list[bytes] = []
                size = 0
                async for chunk in resp.aiter_bytes():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size >= MAX_ANSWER:
                        break
                return resp.status_code, b"".join(chunks)[:MAX_ANSWER]
        except httpx.HTTPError as exc:
            raise DeliveryError(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from None


async def _pinned_address(host: str, port: int, *, targets: WebhookTargets) -> str:
    """The address to connect to for ``host``: checked, never resolved again (see ``_post``)."""
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        if not allowed_target(literal, targets):
            raise DeliveryError(f"{host} is not a {_TARGETS[targets]} address (--webhook-targets {targets})")
        return host
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise DeliveryError(f"cannot resolve {host}: {exc}") from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
    if not addresses:
        raise DeliveryError(f"{host} resolves to no address")
    for ip in addresses:
        if not allowed_target(ip, targets):
            raise DeliveryError(
                f"{host} resolves to {ip}, which is not a {_TARGETS[targets]} address (--webhook-targets {targets})"
            )
    return str(addresses[0])


_TARGETS = {"public": "public", "loopback": "public or loopback", "private": "public, loopback or private"}


# ---------------------------------------------------------------------- request helpers


def _origin(scope: Scope, headers: dict[str, str]) -> str:
    host = headers.get("host", "")
    if not _HOST.match(host):
        server = scope.get("server") or ("127.0.0.1", 4437)
        host = f"{server[0]}:{server[1]}"
    return f"{scope.get('scheme', 'http')}://{host}"


def _base_url(scope: Scope, headers: dict[str, str]) -> str:
    return _origin(scope, headers) + STREAM_ROOT


def _jwks_url(scope: Scope, headers: dict[str, str]) -> str:
    return _base_url(scope, headers) + "/__ds/jwks.json"


def _bearer(headers: dict[str, str]) -> str | None:
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def _read_json(headers: dict[str, str], receive: Receive) -> object:
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY:
        raise _BodyError(413, "PAYLOAD_TOO_LARGE", f"control request bodies are limited to {MAX_BODY} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _BodyError(400, "INVALID_REQUEST", "the client went away before sending the body")
        chunk = msg.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > MAX_BODY:
                raise _BodyError(413, "PAYLOAD_TOO_LARGE", f"control request bodies are limited to {MAX_BODY} bytes")
            chunks.append(chunk)
        if not msg.get("more_body", False):
            break
    raw = b"".join(chunks)
    if not raw.strip():
        return {}
    try:
        return parse_control(raw)
    except ValueError as exc:
        raise _BodyError(400, "INVALID_REQUEST", f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise _BodyError(400, "INVALID_REQUEST", "the body is JSON nested too deeply") from None
