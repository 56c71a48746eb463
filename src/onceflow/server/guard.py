"""Optional access control and limits in front of the app: bearer tokens with scopes per name prefix.

Configured by a JSON file (``onceflow serve --guard FILE`` or ``$ONCEFLOW_GUARD``)::

    {"tokens": {"s3cret-ingest": [{"prefix": "orders/", "scopes": ["write"]}],
                "s3cret-report": [{"prefix": "", "scopes": ["read"]}]},
     "limits": {"streams": 10000, "live_reads": 500, "producers_per_stream": 100}}

Both parts are optional. Without ``tokens`` every request is allowed (as without a guard).

Authorisation (``tokens``)
    Every request but ``OPTIONS`` needs ``Authorization: Bearer <token>`` naming a configured token:
    else ``401`` with ``WWW-Authenticate: Bearer``. The request's *name* must then start with the
    prefix of a grant of that token that has the needed scope, else ``403`` (error code
    ``forbidden``). The name is the stream for ``/v1/stream/<name>`` (``GET``/``HEAD`` need
    ``read``, anything else ``write``), the ``prefix`` parameter for the ``/v1/streams`` listing
    (``read``), and the transactional id, group or sink id for ``/v1/txn/``, ``/v1/groups/`` and
    ``/v1/sinks/`` (``GET`` needs ``read``, ``POST`` ``write``): name those ids under the same
    prefixes as the streams they go with. A transactional append is checked like any append, by
    its stream.

Limits (``limits``), answered ``429`` with ``Retry-After: 1`` (error code ``limit_exceeded``)
    ``streams``: creating a stream when this many exist. ``live_reads``: a long-poll or SSE read
    when this many are open at once. ``producers_per_stream``: an append with a ``Producer-Id`` the
    stream does not know yet when it already keeps state for this many producers (retention drops
    old producers with their batches).

The guard runs before the app and never changes what the app does with a request it lets through.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs

from ..core.broker import Broker
from .app import GROUPS_PREFIX, LIST_PATH, PREFIX, SINKS_PREFIX, TXN_PREFIX, App, Receive, Send
from .app import Scope as ASGIScope

__all__ = ["ENV_VAR", "Grant", "Guard", "GuardConfig", "GuardConfigError"]

ENV_VAR = "ONCEFLOW_GUARD"
Scope = Literal["read", "write"]


class GuardConfigError(ValueError):
    """The guard configuration is malformed; the message says where."""


@dataclass(frozen=True, slots=True)
class Grant:
    prefix: str
    scopes: frozenset[Scope]

    def allows(self, name: str, scope: Scope) -> bool:
        return scope in self.scopes and name.startswith(self.prefix)


def _limit(raw: Mapping[str, Any], key: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise GuardConfigError(f"limits.{key} must be a non-negative integer, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class GuardConfig:
    tokens: Mapping[str, tuple[Grant, ...]] | None = None
    max_streams: int | None = None
    max_live_reads: int | None = None
    max_producers_per_stream: int | None = None

    @classmethod
    def from_json(cls, raw: Any) -> GuardConfig:
        if not isinstance(raw, dict) or set(raw) - {"tokens", "limits"}:
            raise GuardConfigError('the guard configuration is an object with "tokens" and/or "limits"')
        tokens: dict[str, tuple[Grant, ...]] | None = None
        if raw.get("tokens") is not None:
            if not isinstance(raw["tokens"], dict):
                raise GuardConfigError('"tokens" maps each token to a list of {"prefix": ..., "scopes": [...]}')
            tokens = {}
            for token, grants in raw["tokens"].items():
                if not token or not isinstance(grants, list):
                    raise GuardConfigError(f"token {token[:4]!r}...: needs a non-empty token and a list of grants")
                parsed = []
                for g in grants:
                    scopes = g.get("scopes") if isinstance(g, dict) else None
                    if (not isinstance(g, dict) or not isinstance(g.get("prefix"), str) or not isinstance(scopes, list)
                            or not scopes or not set(scopes) <= {"read", "write"}):
                        raise GuardConfigError(f'each grant is {{"prefix": "...", "scopes": ["read", "write"]}}; got {g!r}')
                    parsed.append(Grant(g["prefix"], frozenset(scopes)))
                tokens[token] = tuple(parsed)
        limits = raw.get("limits") or {}
        if not isinstance(limits, dict) or set(limits) - {"streams", "live_reads", "producers_per_stream"}:
            raise GuardConfigError('"limits" may hold "streams", "live_reads" and "producers_per_stream"')
        return cls(tokens, _limit(limits, "streams"), _limit(limits, "live_reads"), _limit(limits, "producers_per_stream"))

    @classmethod
    def from_file(cls, path: str | Path) -> GuardConfig:
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise GuardConfigError(f"cannot read the guard configuration {path}: {exc}") from None
        return cls.from_json(raw)

    @classmethod
    def from_env(cls) -> GuardConfig | None:
        path = os.environ.get(ENV_VAR)
        return cls.from_file(path) if path else None


@dataclass
class Guard:
    """ASGI middleware enforcing a :class:`GuardConfig` in front of ``app``."""

    app: App
    broker: Broker
    config: GuardConfig
    live_reads: int = field(default=0, init=False)

    async def __call__(self, scope: ASGIScope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        method: str = scope["method"]
        path: str = scope["path"]
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        target = _target(method, path, query)
        refusal = self._authorise(headers, target)
        if refusal is None and target is not None and target[2]:
            refusal = self._limit(method, target[0], query, headers)
        if refusal is not None:
            await _answer(send, *refusal, head=method == "HEAD")
            return
        live = method == "GET" and target is not None and target[2] and query.get("live", [""])[0] in ("long-poll", "sse")
        if live:
            self.live_reads += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if live:
                self.live_reads -= 1

    def _authorise(self, headers: Mapping[str, str], target: tuple[str, Scope, bool] | None) -> tuple[int, str, str, list[tuple[bytes, bytes]]] | None:
        tokens = self.config.tokens
        if tokens is None:
            return None
        auth = headers.get("authorization", "")
        kind, _, token = auth.partition(" ")
        if kind.lower() != "bearer" or not token.strip():
            return 401, "unauthorized", "this server needs Authorization: Bearer <token>", [(b"www-authenticate", b'Bearer realm="onceflow"')]
        grants = tokens.get(token.strip())
        if grants is None:
            return 401, "unauthorized", "unknown token", [(b"www-authenticate", b'Bearer realm="onceflow", error="invalid_token"')]
        if target is None:
            return None  # not a resource (the app answers 404)
        name, needed, _ = target
        if not any(g.allows(name, needed) for g in grants):
            return 403, "forbidden", f"this token may not {needed} {name!r}", []
        return None

    def _limit(self, method: str, name: str, query: Mapping[str, list[str]], headers: Mapping[str, str]) -> tuple[int, str, str, list[tuple[bytes, bytes]]] | None:
        c = self.config
        retry = [(b"retry-after", b"1")]
        if method == "GET" and query.get("live", [""])[0] in ("long-poll", "sse"):
            if c.max_live_reads is not None and self.live_reads >= c.max_live_reads:
                return 429, "limit_exceeded", f"too many open live reads (limit {c.max_live_reads})", retry
        elif method == "PUT" and c.max_streams is not None and self.broker.get(name) is None:
            if sum(1 for _ in self.broker.list()) >= c.max_streams:
                return 429, "limit_exceeded", f"too many streams (limit {c.max_streams})", retry
        elif method == "POST" and c.max_producers_per_stream is not None and "producer-id" in headers:
            s = self.broker.get(name)
            known = s.log.producers if s is not None else {}
            if headers["producer-id"] not in known and len(known) >= c.max_producers_per_stream:
                return 429, "limit_exceeded", f"too many producers on {name!r} (limit {c.max_producers_per_stream})", retry
        return None


def _target(method: str, path: str, query: Mapping[str, list[str]]) -> tuple[str, Scope, bool] | None:
    """(name, scope needed, whether the name is a stream) of a request, or None for no resource."""
    read: Scope = "read" if method in ("GET", "HEAD") else "write"
    if path.startswith(PREFIX):
        return path[len(PREFIX):], read, True  # ASGI paths are already percent-decoded
    if path == LIST_PATH:
        return query.get("prefix", [""])[0], "read", False
    for prefix in (TXN_PREFIX, GROUPS_PREFIX, SINKS_PREFIX):
        if path.startswith(prefix):
            return path[len(prefix):], read, False
    return None


async def _answer(send: Send, status: int, code: str, message: str, extra: list[tuple[bytes, bytes]], *, head: bool) -> None:
    body = b"" if head else json.dumps({"error": {"code": code, "message": message}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"access-control-allow-origin", b"*"), (b"cache-control", b"no-store"), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
