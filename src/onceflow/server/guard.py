"""Optional access control and limits in front of the app: bearer tokens with scopes per name prefix.

Configured by a JSON file (``onceflow serve --guard FILE`` or ``$ONCEFLOW_GUARD``)::

    {"tokens": {"s3cret-ingest": [{"prefix": "orders/", "scopes": ["write"]}],
                "s3cret-report": [{"prefix": "", "scopes": ["read"]}],
                "s3cret-ops": [{"prefix": "", "scopes": ["read", "admin"]}],
                "s3cret-scraper": [{"prefix": "", "scopes": ["metrics"]}]},
     "limits": {"streams": 10000, "live_reads": 500, "producers_per_stream": 100}}

Both parts are optional. Without ``tokens`` every request is allowed (as without a guard).

Authorisation (``tokens``)
    :data:`ENDPOINTS` is the rule, written once: for every endpoint, who may call it (a token, anyone,
    or the holder of a subscription's wake token) and every name the request carries (in its path,
    headers or JSON body, or held by the subscription it addresses) with the scope a grant must
    give on it. Streams, transactional ids, consumer groups and sink ids are one namespace: each
    name must start with the prefix of a grant of the request's token that has the scope. A name
    prefix (the listing's ``prefix``, a sink's ``abort_prefix``, a subscription pattern through
    :func:`~onceflow.core.subscriptions.glob_prefix`) stands for every name it covers, so it must
    itself start with a grant's prefix. Scopes: ``read``, ``write``, ``admin`` (what an operator
    does: list transactional ids, groups and sinks, abort another's hanging transaction, rewind a
    group, reset a sink; docs/operations.md) and ``metrics`` (``GET /metrics``, which shows the
    whole server: a grant gives it only on the prefix ``""``); none implies another. Refusals:
    ``401`` with ``WWW-Authenticate: Bearer`` for a missing or unknown token, ``403`` (error code
    ``forbidden``) for a name outside the grants.

Limits (``limits``), answered ``429`` with ``Retry-After: 1`` (error code ``limit_exceeded``)
    ``streams``: creating a stream when this many exist. ``live_reads``: a long-poll or SSE read
    when this many are open at once. ``producers_per_stream``: an append with a ``Producer-Id`` the
    stream does not know yet when it already keeps state for this many producers (retention drops
    old producers with their batches). ``groups``, ``transactional_ids``, ``sinks``,
    ``subscriptions``: creating a new one when this many exist (:meth:`Guard._limit_state`; the
    server's own limits, ``onceflow serve --max-groups`` and so on, hold with or without a guard).

How a request passes (:meth:`Guard.__call__`)
    1. Path and headers are read with the app's own functions (:func:`~onceflow.server.app.request_path`,
       :func:`~onceflow.server.app.request_headers`): a path that is not UTF-8 or a repeated
       protocol header is a ``400`` here, as in the app, so both act on the same request. So is
       the body's coding (:func:`~onceflow.server.app.body_coding`): an unknown one, or any on a
       control endpoint, whose JSON body this guard reads, is the app's ``415``.
    2. The request is routed to its :class:`Endpoint` the way the app dispatches it.
    3. For endpoints whose names are in the JSON body, the body (bounded like the app bounds it)
       is read and parsed; an unparseable one is a ``400`` here. The app gets the same bytes.
       The body of every subscription route is read here too (see step 5).
    4. Authentication, then every name, then the limits. A refusal is answered here; the app
       never sees the request, so nothing changes.
    5. The app runs with the request unchanged. Between the check and the app's use of the state
       the check read (an existing subscription's configuration), nothing else runs: the body is
       replayed from memory, so the app reaches that state without waiting on the client (a body
       trickling in while another tenant creates the subscription cannot claim it).

A server that passes requests on to the one holding the store's state (a follower on PostgreSQL,
server/leader.py) checks what it can of them first, before it reads a body:
:func:`refused_before_body`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs

from ..core.broker import Broker
from ..core.jsonmode import parse_control
from ..core.subscriptions import Subscription, SubscriptionError, glob_prefix
from ..core.txn import SINK_TASK_PREFIX
from ..errors import OnceflowError
from . import routes
from .answering import MAY_READ, ASGIMessage, BadRequest, Receive, Send, list_prefix
from .answering import Scope as ASGIScope
from .answers import answer_for
from .app import App, body_coding, fork_source, request_headers, request_path
from .routes import (
    FORCE_ABORT,
    GROUP_RESET,
    routed,
)
from .subscriptions import MAX_BODY as CONTROL_MAX_BODY

__all__ = [
    "ENDPOINTS",
    "ENV_VAR",
    "Endpoint",
    "Grant",
    "Guard",
    "GuardConfig",
    "GuardConfigError",
    "Names",
    "SCOPES",
    "refused_before_body",
    "scope_table",
]

ENV_VAR = "ONCEFLOW_GUARD"
Scope = Literal["read", "write", "admin", "metrics"]
SCOPES: tuple[Scope, ...] = ("read", "write", "admin", "metrics")
WHOLE_SERVER: frozenset[Scope] = frozenset({"metrics"})  # scopes a grant gives only on the prefix ""
_SCOPE_NAMES = ", ".join(f'"{s}"' for s in SCOPES)
Auth = Literal["token", "anyone", "wake_token"]


class GuardConfigError(OnceflowError, ValueError):
    """The guard configuration is malformed; the message says where."""


@dataclass(frozen=True, slots=True)
class Grant:
    prefix: str
    scopes: frozenset[Scope]

    def allows(self, name: str, scope: Scope) -> bool:
        """Whether ``name`` (or every name starting with the name prefix ``name``) is covered."""
        return scope in self.scopes and name.startswith(self.prefix)


LIMITS = (
    "streams",
    "live_reads",
    "producers_per_stream",
    "groups",
    "transactional_ids",
    "sinks",
    "subscriptions",
)


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
    max_groups: int | None = None
    max_transactional_ids: int | None = None
    max_sinks: int | None = None
    max_subscriptions: int | None = None

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
                    if (
                        not isinstance(g, dict)
                        or not isinstance(g.get("prefix"), str)
                        or not isinstance(scopes, list)
                        or not scopes
                        or not set(scopes) <= set(SCOPES)
                    ):
                        raise GuardConfigError(
                            f'each grant is {{"prefix": "...", "scopes": [...]}} with scopes among {_SCOPE_NAMES}; '
                            f"got {g!r}"
                        )
                    if g["prefix"] and WHOLE_SERVER & set(scopes):
                        raise GuardConfigError(
                            f"the {', '.join(map(repr, sorted(WHOLE_SERVER & set(scopes))))} scope covers the whole "
                            f'server: give it in a grant with "prefix": ""; got {g!r}'
                        )
                    parsed.append(Grant(g["prefix"], frozenset(scopes)))
                tokens[token] = tuple(parsed)
        limits = raw.get("limits") or {}
        if not isinstance(limits, dict) or set(limits) - set(LIMITS):
            raise GuardConfigError(f'"limits" may hold {", ".join(map(repr, LIMITS))}')
        return cls(
            tokens,
            _limit(limits, "streams"),
            _limit(limits, "live_reads"),
            _limit(limits, "producers_per_stream"),
            _limit(limits, "groups"),
            _limit(limits, "transactional_ids"),
            _limit(limits, "sinks"),
            _limit(limits, "subscriptions"),
        )

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


# ---------------------------------------------------------------------- the rule: endpoints and their names


@dataclass(frozen=True, slots=True)
class Held:
    """The names an existing subscription reaches: the prefix of its pattern, its configured
    streams and every stream linked to it (streams added later included), and its wake stream."""

    reads: tuple[str, ...]
    wake_stream: str | None

    @staticmethod
    def of(sub: Subscription) -> Held:
        pattern = (glob_prefix(sub.config.pattern),) if sub.config.pattern is not None else ()
        return Held((*pattern, *sub.config.streams, *sub.links), sub.config.wake_stream)


@dataclass(frozen=True, slots=True)
class Request:
    """What the guard knows of a request when it checks its names."""

    method: str
    name: str  # the name in the path: stream, transactional id, group, sink or subscription id
    headers: Mapping[str, str]
    scope: ASGIScope
    body: Any = None  # the parsed JSON body, for endpoints that read it
    subscription: Held | None = None  # the existing subscription the path names
    extra: str = ""  # the stream path of DELETE __ds/subscriptions/<id>/streams/<path>


@dataclass(frozen=True, slots=True)
class Names:
    """Names a request carries somewhere, and the scope a grant must give on each."""

    scope: Scope
    doc: str  # where they are, for docs/security.md
    of: Callable[[Request], Iterable[str]]


@dataclass(frozen=True, slots=True)
class Endpoint:
    key: str
    request: str  # method and path, for docs/security.md
    auth: Auth
    names: tuple[Names, ...] = ()
    # "json": names are in the JSON body, which the guard reads and parses before checking.
    # "read": the guard reads the whole body before checking, so that the app, replaying it from
    # memory, reaches the state the check read (a subscription) without waiting on the client.
    body: Literal["none", "read", "json"] = "none"


def _path_name(r: Request) -> Iterator[str]:
    yield r.name


def _body_field(key: str) -> Callable[[Request], Iterator[str]]:
    def names(r: Request) -> Iterator[str]:
        value = r.body.get(key) if isinstance(r.body, dict) else None
        if isinstance(value, str):
            yield value

    return names


def _offset_streams(r: Request) -> Iterator[str]:
    offsets = r.body.get("offsets") if isinstance(r.body, dict) else None
    if isinstance(offsets, dict):
        yield from offsets


SINK_TASKS = SINK_TASK_PREFIX  # transactional ids of sinks' tasks: spark/<sink id>/p<n>/s<m>, handed out by the server


def as_owned(tid: str) -> str:
    """The name a transactional id is checked as: a sink task's id (``spark/<sink id>/...``, see
    docs/spark.md) belongs to the tenant of its sink id, so it is checked without the ``spark/``."""
    return tid[len(SINK_TASKS) :] if tid.startswith(SINK_TASKS) else tid


def owned_prefix(prefix: str) -> Iterator[str]:
    """The names a prefix of transactional ids (a listing's, an ``abort_prefix``) is checked as:
    :func:`as_owned` of it; and one that ``spark/`` starts with (``s``, ``spark``) takes in the
    tasks of every sink too, which no grant short of the whole server's (``""``) covers."""
    yield as_owned(prefix)
    if prefix != SINK_TASKS and SINK_TASKS.startswith(prefix):
        yield ""


def _txn_path(r: Request) -> Iterator[str]:
    yield as_owned(r.name)


def _members(r: Request) -> Iterator[str]:
    members = r.body.get("members") if isinstance(r.body, dict) else None
    for m in members if isinstance(members, list) else ():
        if isinstance(m, dict) and isinstance(m.get("id"), str):
            yield as_owned(m["id"])


def _abort_prefix(r: Request) -> Iterator[str]:
    prefix = r.body.get("abort_prefix") if isinstance(r.body, dict) else None
    if isinstance(prefix, str):
        yield from owned_prefix(prefix)


def _group_if_reset(r: Request) -> Iterator[str]:
    """A commit with ``"reset": true`` may move a group's offsets backwards: an operator's act."""
    if isinstance(r.body, dict) and r.body.get("reset") is True:
        yield r.name


def _reset_streams(r: Request) -> Iterator[str]:
    """The streams a group reset names: body ``streams`` (as given: the app does not normalise
    them) and the streams of body ``offsets``."""
    streams = r.body.get("streams") if isinstance(r.body, dict) else None
    for s in streams if isinstance(streams, list) else ():
        if isinstance(s, str):
            yield s
    yield from _offset_streams(r)


def _fork_source(r: Request) -> Iterator[str]:
    source = fork_source(dict(r.headers))
    if source is not None:
        yield source


def _transaction_id(r: Request) -> Iterator[str]:
    tid = r.headers.get("transaction-id")
    if tid is not None:
        yield as_owned(tid)


def _transactional_producer(r: Request) -> Iterator[str]:
    """``Producer-Id: txn:<id>`` is the producer of transactional id ``<id>``."""
    pid = r.headers.get("producer-id")
    if pid is not None and pid.startswith("txn:"):
        yield as_owned(pid[len("txn:") :])


def _list_prefix(r: Request) -> Iterator[str]:
    yield list_prefix(r.scope)


def _txn_list_prefix(r: Request) -> Iterator[str]:
    """The prefix of a listing of transactional ids, checked as such ids are (``spark/<sink id>/``
    as the sink id's)."""
    yield from owned_prefix(list_prefix(r.scope))


def _body_pattern(r: Request) -> Iterator[str]:
    pattern = r.body.get("pattern") if isinstance(r.body, dict) else None
    if isinstance(pattern, str):
        yield glob_prefix(pattern.strip("/"))  # normalized as parse_pattern does


def _body_streams(r: Request) -> Iterator[str]:
    streams = r.body.get("streams") if isinstance(r.body, dict) else None
    for s in streams if isinstance(streams, list) else ():
        if isinstance(s, str):
            yield s.strip("/")  # normalized as normalize_path does


def _body_wake_stream(r: Request) -> Iterator[str]:
    wake = r.body.get("wake_stream") if isinstance(r.body, dict) else None
    if isinstance(wake, str):
        yield wake.strip("/")


def _held_reads(r: Request) -> Iterator[str]:
    if r.subscription is not None:
        yield from r.subscription.reads


def _held_wake_stream(r: Request) -> Iterator[str]:
    if r.subscription is not None and r.subscription.wake_stream is not None:
        yield r.subscription.wake_stream


def _removed_stream(r: Request) -> Iterator[str]:
    yield r.extra.strip("/")


def _whole_server(r: Request) -> Iterator[str]:
    yield ""  # only a grant on the prefix "" covers it


PATH_STREAM = Names("read", "the stream", _path_name)
SUBSCRIPTION_HELD = (
    Names("read", "the subscription's pattern (as a prefix) and linked streams", _held_reads),
    Names("write", "the subscription's wake stream", _held_wake_stream),
)

ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("stream.read", "GET /v1/stream/<name> (catch-up, long-poll, SSE, format=)", "token", (PATH_STREAM,)),
    Endpoint("stream.head", "HEAD /v1/stream/<name>", "token", (PATH_STREAM,)),
    Endpoint(
        "stream.create",
        "PUT /v1/stream/<name> (create, fork)",
        "token",
        (
            Names("write", "the stream", _path_name),
            Names("read", "`Stream-Forked-From` (the fork's source)", _fork_source),
        ),
    ),
    Endpoint(
        "stream.append",
        "POST /v1/stream/<name> (append, close, transactional append)",
        "token",
        (
            Names("write", "the stream", _path_name),
            Names("write", "`Transaction-Id`", _transaction_id),
            Names("write", "`Producer-Id: txn:<id>` (the id)", _transactional_producer),
        ),
    ),
    Endpoint("stream.delete", "DELETE /v1/stream/<name>", "token", (Names("write", "the stream", _path_name),)),
    Endpoint(
        "stream.other", "other methods on /v1/stream/<name> (405)", "token", (Names("write", "the stream", _path_name),)
    ),
    Endpoint(
        "streams.list",
        "GET/HEAD /v1/streams?prefix=P",
        "token",
        (Names("read", '`P` (a prefix; `""` when absent)', _list_prefix),),
    ),
    Endpoint(
        "txns.list",
        "GET/HEAD /v1/txn?prefix=P&open=true",
        "token",
        (Names("admin", '`P` (a prefix of transactional ids; `""` when absent)', _txn_list_prefix),),
    ),
    Endpoint("txn.read", "GET /v1/txn/<id>", "token", (Names("read", "the transactional id", _txn_path),)),
    Endpoint("txn.init", "POST /v1/txn/<id>/init", "token", (Names("write", "the transactional id", _txn_path),)),
    Endpoint("txn.delete", "DELETE /v1/txn/<id>", "token", (Names("admin", "the transactional id", _txn_path),)),
    Endpoint(
        "txn.end", "POST /v1/txn/<id>/(commit|abort)", "token", (Names("write", "the transactional id", _txn_path),)
    ),
    Endpoint(
        "txn.offsets",
        "POST /v1/txn/<id>/offsets",
        "token",
        (
            Names("write", "the transactional id", _txn_path),
            Names("write", "body `group`", _body_field("group")),
            Names("read", "the streams of body `offsets`", _offset_streams),
        ),
        body="json",
    ),
    Endpoint(
        "txn.force_abort",
        f"POST /v1/txn/<id>/{FORCE_ABORT}",
        "token",
        (Names("admin", "the transactional id", _txn_path),),
    ),
    Endpoint(
        "txn.other",
        "other requests under /v1/txn/ (404, 405)",
        "token",
        (Names("write", "the path after /v1/txn/", _path_name),),
    ),
    Endpoint(
        "groups.list",
        "GET/HEAD /v1/groups?prefix=P",
        "token",
        (Names("admin", '`P` (a prefix; `""` when absent)', _list_prefix),),
    ),
    Endpoint("group.read", "GET /v1/groups/<group>/offsets", "token", (Names("read", "the group", _path_name),)),
    Endpoint("group.delete", "DELETE /v1/groups/<group>", "token", (Names("admin", "the group", _path_name),)),
    Endpoint(
        "group.commit",
        "POST /v1/groups/<group>/offsets",
        "token",
        (
            Names("write", "the group", _path_name),
            Names("read", "the streams of body `offsets`", _offset_streams),
            Names("admin", "the group, when body `reset` is `true` (a rewind)", _group_if_reset),
        ),
        body="json",
    ),
    Endpoint(
        "group.reset",
        f"POST /v1/groups/<group>/{GROUP_RESET}",
        "token",
        (
            Names("admin", "the group", _path_name),
            Names(
                "read",
                "body `streams` and the streams of body `offsets`; with neither, every stream the group "
                "holds a position in (the app checks those, with the guard's grants)",
                _reset_streams,
            ),
        ),
        body="json",
    ),
    Endpoint(
        "group.other",
        "other requests under /v1/groups/ (404, 405)",
        "token",
        (Names("write", "the path after /v1/groups/", _path_name),),
    ),
    Endpoint(
        "sinks.list",
        "GET/HEAD /v1/sinks?prefix=P",
        "token",
        (Names("admin", '`P` (a prefix; `""` when absent)', _list_prefix),),
    ),
    Endpoint("sink.read", "GET /v1/sinks/<sink>", "token", (Names("read", "the sink id", _path_name),)),
    Endpoint("sink.reset", "POST /v1/sinks/<sink>/reset", "token", (Names("admin", "the sink id", _path_name),)),
    Endpoint(
        "sink.post",
        "POST /v1/sinks/<sink>/(begin|alive|commit|abort)",
        "token",
        (
            Names("write", "the sink id", _path_name),
            Names("write", "body `members[].id` (transactional ids)", _members),
            Names("write", "body `abort_prefix` (a prefix of transactional ids)", _abort_prefix),
        ),
        body="json",
    ),
    Endpoint(
        "sink.other",
        "other requests under /v1/sinks/ (404, 405)",
        "token",
        (Names("write", "the path after /v1/sinks/", _path_name),),
    ),
    Endpoint("subs.jwks", "GET /v1/stream/__ds/jwks.json", "anyone"),
    Endpoint(
        "subs.create",
        "PUT /v1/stream/__ds/subscriptions/<id>",
        "token",
        (
            Names("read", "body `pattern` (as a prefix)", _body_pattern),
            Names("read", "body `streams`", _body_streams),
            Names("write", "body `wake_stream`", _body_wake_stream),
            *SUBSCRIPTION_HELD,
        ),
        body="json",
    ),
    Endpoint("subs.read", "GET/HEAD /v1/stream/__ds/subscriptions/<id>", "token", SUBSCRIPTION_HELD, body="read"),
    Endpoint("subs.delete", "DELETE /v1/stream/__ds/subscriptions/<id>", "token", SUBSCRIPTION_HELD, body="read"),
    Endpoint(
        "subs.add_streams",
        "POST /v1/stream/__ds/subscriptions/<id>/streams",
        "token",
        (
            Names("read", "body `streams`", _body_streams),
            *SUBSCRIPTION_HELD,
        ),
        body="json",
    ),
    Endpoint(
        "subs.remove_stream",
        "DELETE /v1/stream/__ds/subscriptions/<id>/streams/<path>",
        "token",
        (
            Names("read", "`<path>`", _removed_stream),
            *SUBSCRIPTION_HELD,
        ),
        body="read",
    ),
    Endpoint("subs.claim", "POST /v1/stream/__ds/subscriptions/<id>/claim", "token", SUBSCRIPTION_HELD, body="read"),
    Endpoint("subs.wake", "POST /v1/stream/__ds/subscriptions/<id>/(callback|ack|release)", "wake_token"),
    Endpoint("subs.other", "other requests under /v1/stream/__ds/ (404, 405)", "token", SUBSCRIPTION_HELD, body="read"),
    Endpoint(
        "metrics",
        "any request to /metrics (GET/HEAD: Prometheus metrics; others 405)",
        "token",
        (Names("metrics", 'the whole server (a grant on the prefix `""`)', _whole_server),),
    ),
    Endpoint("ui", "GET/HEAD /ui (the dashboard's page: no data; it asks for a token)", "anyone"),
    Endpoint("other", "any other path (404)", "token"),
)
_BY_KEY = {e.key: e for e in ENDPOINTS}
_WHO = {"token": "a token", "anyone": "anyone (no token)", "wake_token": "the subscription's wake token"}


def scope_table() -> str:
    """:data:`ENDPOINTS` as the Markdown table of docs/security.md (a test keeps them equal)."""
    rows = ["| endpoint | request | who | names checked: scope needed |", "|---|---|---|---|"]
    for e in ENDPOINTS:
        names = "; ".join(f"{n.doc}: `{n.scope}`" for n in e.names) or "none"
        request = e.request.replace("|", "\\|")  # a pipe would end the cell, even in a code span
        rows.append(f"| `{e.key}` | `{request}` | {_WHO[e.auth]} | {names} |")
    return "\n".join(rows) + "\n"


def route(method: str, path: str, scope: ASGIScope) -> tuple[Endpoint, str, str]:
    """(endpoint, name in the path, extra path part) of a request: the one router's
    (server/routes.py) answer, as this guard's table knows it."""
    r = routed(scope, path) if scope.get("method") == method else routes.route(method, path, scope)
    return _BY_KEY[r.key], r.name, r.extra


# ---------------------------------------------------------------------- the middleware


@dataclass
class Guard:
    """ASGI middleware enforcing a :class:`GuardConfig` in front of ``app``."""

    app: App
    broker: Broker
    config: GuardConfig
    live_reads: int = field(default=0, init=False)
    # kind -> names that requests let through are creating now (the app has not answered yet)
    _creating: dict[str, set[str]] = field(default_factory=dict, init=False)

    async def __call__(self, scope: ASGIScope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        method: str = scope["method"]
        raw: bytes | None = None
        try:
            headers, endpoint, name, extra = _routed(scope)  # Steps 1 and 2
            grants = self._authenticate(headers, endpoint, name)
            body: Any = None
            if endpoint.body != "none" and (grants is not None or self._limit_reads_body(endpoint)):
                raw = await _read_body(receive, headers, self._body_limit(endpoint))  # Step 3
                body = _parse(raw) if endpoint.body == "json" else None
            if grants is not None:  # Step 4
                request = Request(method, name, headers, scope, body, self._subscription(endpoint, name), extra)
                _authorise(grants, endpoint, request)
                # and for the streams an answer shows or a reset moves without the request naming them
                scope = {**scope, MAY_READ: _reader(grants)}
            self._limit(endpoint, name, scope, headers)
            creating = self._limit_state(endpoint, name, body, scope)
        except _Refused as refused:
            await _answer(send, refused.status, refused.code, str(refused), refused.headers, head=method == "HEAD")
            return
        live = endpoint.key == "stream.read" and _live(scope)
        if live:
            self.live_reads += 1
        for kind, what in creating:  # its places held until the app is done, so that requests at once count them
            self._creating.setdefault(kind, set()).add(what)
        try:  # Step 5
            await self.app(scope, receive if raw is None else _replay(raw, receive), send)
        finally:
            if live:
                self.live_reads -= 1
            for kind, what in creating:
                self._creating[kind].discard(what)

    def _authenticate(self, headers: Mapping[str, str], endpoint: Endpoint, name: str) -> tuple[Grant, ...] | None:
        return _authenticate(
            self.config.tokens, headers, endpoint, name, self.app.subscriptions.manager.token_subscription
        )

    def _body_limit(self, endpoint: Endpoint) -> int:
        return CONTROL_MAX_BODY if endpoint.key.startswith("subs.") else self.app.config.max_body_bytes

    def _subscription(self, endpoint: Endpoint, sid: str) -> Held | None:
        if not endpoint.key.startswith("subs.") or not sid:
            return None
        manager = self.app.subscriptions.manager
        manager.start()  # loads the subscriptions on disk (idempotent), before the app would
        sub = manager.subs.get(sid)
        return Held.of(sub) if sub is not None else None

    def _limit(self, endpoint: Endpoint, name: str, scope: ASGIScope, headers: Mapping[str, str]) -> None:
        c = self.config
        if endpoint.key == "stream.read" and _live(scope):
            if c.max_live_reads is not None and self.live_reads >= c.max_live_reads:
                raise _Refused(429, "limit_exceeded", f"too many open live reads (limit {c.max_live_reads})", _RETRY)
        elif endpoint.key == "stream.create" and c.max_streams is not None and self.broker.get(name) is None:
            if sum(1 for _ in self.broker.list()) >= c.max_streams:
                raise _Refused(429, "limit_exceeded", f"too many streams (limit {c.max_streams})", _RETRY)
        elif endpoint.key == "stream.append" and c.max_producers_per_stream is not None and "producer-id" in headers:
            s = self.broker.get(name)
            known = s.log.producers if s is not None else {}
            if headers["producer-id"] not in known and len(known) >= c.max_producers_per_stream:
                raise _Refused(
                    429,
                    "limit_exceeded",
                    f"too many producers on {name!r} (limit {c.max_producers_per_stream})",
                    _RETRY,
                )

    def _limit_reads_body(self, endpoint: Endpoint) -> bool:
        """Whether a limit needs the body of ``endpoint``'s requests (the group a transaction's
        offsets go to, whether a reset is a dry run, the task a sink's ``begin`` names) when no
        token is checked (a guard of limits only)."""
        if endpoint.key == "sink.post":
            return self.config.max_transactional_ids is not None
        return endpoint.key in ("txn.offsets", "group.reset") and self.config.max_groups is not None

    def _limit_state(self, endpoint: Endpoint, name: str, body: Any, scope: ASGIScope) -> list[tuple[str, str]]:
        """The limits on what a request creates besides streams: a group (an offsets commit, a
        reset that is not a dry run, a transaction's offsets), a transactional id (an init, and a
        sink's ``begin``, which gives its task an id of the sink's), a sink (its first ``begin``
        or ``commit``) and a subscription. What exists already is never refused; what requests let
        through are creating at this moment counts. Returns the (kind, name) this one creates."""
        c = self.config
        coord = self.broker.coordinator
        key = endpoint.key
        fields = body if isinstance(body, dict) else {}
        new: list[tuple[str, str, int, int | None, str]] = []  # kind, name, count, limit, what
        if key in ("group.commit", "group.reset", "txn.offsets"):
            group = name if key != "txn.offsets" else fields.get("group")
            creates = key != "group.reset" or fields.get("dry_run") is not True
            if isinstance(group, str) and creates and not coord.group_exists(group):
                new.append(("groups", group, len(coord.groups), c.max_groups, "consumer groups"))
        elif key == "txn.init" and name not in coord.txns:
            new.append(("transactional_ids", name, len(coord.txns), c.max_transactional_ids, "transactional ids"))
        elif key == "sink.post" and (action := routed(scope, request_path(scope)).action) in ("begin", "commit"):
            if not coord.knows_sink(name):
                new.append(("sinks", name, coord.sink_count(), c.max_sinks, "sinks"))
            task, partition = fields.get("task"), fields.get("partition")
            if action == "begin" and isinstance(task, str) and type(partition) is int:
                query = fields.get("query")
                tid = coord.task_id(name, partition, task, query if isinstance(query, str) else None)
                if tid not in coord.txns:
                    new.append(
                        ("transactional_ids", tid, len(coord.txns), c.max_transactional_ids, "transactional ids")
                    )
        elif key == "subs.create" and name not in self.app.subscriptions.manager.subs:
            subs = self.app.subscriptions.manager.subs
            new.append(("subscriptions", name, len(subs), c.max_subscriptions, "subscriptions"))
        for kind, what, count, limit, label in new:
            creating = self._creating.get(kind, set())
            if limit is not None and what not in creating and count + len(creating) >= limit:
                hint = "; an idle one can be deleted (onceflow txn delete)" if kind == "transactional_ids" else ""
                raise _Refused(429, "limit_exceeded", f"too many {label} (limit {limit}){hint}", _RETRY)
        return [(kind, what) for kind, what, *_ in new]


async def refused_before_body(config: GuardConfig, scope: ASGIScope, send: Send) -> bool:
    """Whether ``config`` refuses the request for what its path and headers say, answered here so
    (True) exactly as the guard in front of the app answers it; False when only the guard of the
    server that holds the store's state can tell (the request must go there).

    For a server that passes requests on to another (a follower, server/leader.py), and would
    otherwise read the body to do so: these refusals come before the guard reads any body, so they
    never depend on it. Checked: Steps 1 and 2 (a ``400``, a ``415``), the token (``401`` when missing or
    unknown; a wake token only when missing, for which subscription it was issued is the other
    server's to know), and, for an endpoint whose names are all in its path and headers (an append,
    a read, a create: ``Endpoint.body == "none"``), every name (``403``). Not checked: names in a
    body or held by a subscription, and the limits, which need the store's state."""
    if scope["type"] != "http" or scope["method"] == "OPTIONS":
        return False
    method: str = scope["method"]
    try:
        headers, endpoint, name, extra = _routed(scope)
        grants = _authenticate(config.tokens, headers, endpoint, name, None)
        if grants is not None and endpoint.body == "none":
            _authorise(grants, endpoint, Request(method, name, headers, scope, extra=extra))
    except _Refused as refused:
        await _answer(send, refused.status, refused.code, str(refused), refused.headers, head=method == "HEAD")
        return True
    return False


def _routed(scope: ASGIScope) -> tuple[Mapping[str, str], Endpoint, str, str]:
    """Step 1, the request as the app will read it (its headers, and its body's coding: a coded
    control body, which this guard would have to read, is refused as the app refuses it), and
    Step 2, its endpoint, with the name and the extra path part of :func:`route`. Raises
    :class:`_Refused` (a ``400``, or the app's ``415``)."""
    try:
        path = request_path(scope)
        headers = request_headers(scope)
        body_coding(scope["method"], path, headers)
        endpoint, name, extra = route(scope["method"], path, scope)
    except BadRequest as exc:
        raise _Refused(exc.status, exc.code, str(exc), list(exc.headers)) from None
    except SubscriptionError as exc:
        raise _Refused(answer_for(exc.refusal).status, "bad_request", str(exc)) from None
    return headers, endpoint, name, extra


def _authenticate(
    tokens: Mapping[str, tuple[Grant, ...]] | None,
    headers: Mapping[str, str],
    endpoint: Endpoint,
    name: str,
    wake_owner: Callable[[str], str | None] | None,
) -> tuple[Grant, ...] | None:
    """The grants names are checked against, or None when no name is checked (no tokens
    configured, or an endpoint for anyone or for a wake token). Raises :class:`_Refused`.

    ``wake_owner`` tells the subscription a wake token was issued for; None where that cannot be
    known (a follower holds no subscription): a wake token is then refused only when missing."""
    if tokens is None or endpoint.auth == "anyone":
        return None
    kind, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip() if kind.lower() == "bearer" else ""
    if endpoint.auth == "wake_token":
        # the protocol's Authorization: Bearer <claim or callback token>, issued for this subscription
        if token and (wake_owner is None or wake_owner(token) == name):
            return None
        raise _Refused(
            401,
            "unauthorized",
            "callback, ack and release take the wake's own token: "
            "Authorization: Bearer <claim or callback token> of this subscription",
            _INVALID_TOKEN,
        )
    if not token:
        raise _Refused(401, "unauthorized", "this server needs Authorization: Bearer <token>", _NO_TOKEN)
    grants = tokens.get(token)
    if grants is None:
        raise _Refused(401, "unauthorized", "unknown token", _INVALID_TOKEN)
    return grants


class _Refused(Exception):
    """The guard's answer to a request the app must not see."""

    def __init__(self, status: int, code: str, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.headers = headers or []


_RETRY = [(b"retry-after", b"1")]
_NO_TOKEN = [(b"www-authenticate", b'Bearer realm="onceflow"')]
_INVALID_TOKEN = [(b"www-authenticate", b'Bearer realm="onceflow", error="invalid_token"')]


def _authorise(grants: tuple[Grant, ...], endpoint: Endpoint, request: Request) -> None:
    """Every name the endpoint's rule finds in the request must be covered by a grant."""
    for names in endpoint.names:
        for n in names.of(request):
            if not any(g.allows(n, names.scope) for g in grants):
                if names.scope in WHOLE_SERVER:
                    raise _Refused(
                        403, "forbidden", f'this token has no {names.scope!r} scope (a grant on the prefix "" gives it)'
                    )
                raise _Refused(403, "forbidden", f"this token may not {names.scope} {n!r} ({names.doc})")


def _reader(grants: tuple[Grant, ...]) -> Callable[[str], bool]:
    """The app's test (:data:`~onceflow.server.answering.MAY_READ`) of whether these grants read a stream."""
    return lambda name: any(g.allows(name, "read") for g in grants)


def _parse(raw: bytes) -> Any:
    """A JSON body as the app will parse it (an empty one is ``{}``); a 400 or 413 otherwise."""
    if not raw.strip():
        return {}
    try:
        return parse_control(raw)
    except ValueError as exc:
        raise _Refused(400, "bad_request", f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise _Refused(400, "bad_request", "the body is JSON nested too deeply") from None


def _live(scope: ASGIScope) -> bool:
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    return query.get("live", [""])[0] in ("long-poll", "sse")


async def _read_body(receive: Receive, headers: Mapping[str, str], limit: int) -> bytes:
    """The whole request body; a 413 when it is larger than ``limit``."""
    too_large = _Refused(413, "payload_too_large", f"request body is larger than the server's limit of {limit} bytes")
    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _Refused(400, "disconnected", "client went away")
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields ``body`` as one message, then whatever the client sends next."""
    sent = False

    async def replayed() -> ASGIMessage:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _answer(
    send: Send, status: int, code: str, message: str, extra: list[tuple[bytes, bytes]], *, head: bool
) -> None:
    body = b"" if head else json.dumps({"error": {"code": code, "message": message}}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"access-control-allow-origin", b"*"),
        (b"cache-control", b"no-store"),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
