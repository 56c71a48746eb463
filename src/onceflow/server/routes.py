"""Where a request goes: one router for the app, the guard and the metrics.

:func:`route` reads a request's method and path once and names its endpoint: the key of
docs/security.md's table (the guard's :data:`~onceflow.server.guard.ENDPOINTS`, which says who may
call it and which names it checks), what the app runs (``App._http`` dispatches on the key: the
protocol's writes there, reads in server/reads.py, the extensions in server/extensions.py, the
subscriptions' control API in server/subscriptions.py) and the ``route`` label of the metrics
(server/instrument.py). Before, the app, the guard and the metrics each had a
router of their own, kept equal by tests; a drift between them would have been an authorisation
bug (the guard checking one endpoint's names while the app ran another's). The outermost layer
routes and leaves the answer in the request's scope (:data:`ROUTE`); the layers within read it.

A path that names no endpoint, or an endpoint with another method, routes to the area's ``*.other``
key with :attr:`Route.refused`: the status (404 or 405), what to say, and the methods it takes. The
area answers it in its own words (the subscriptions' control API in the Durable Streams protocol's,
the rest in onceflow's).

Names may contain ``/`` (a transactional id, a group, a sink, a stream): an action is the last
segment of the path, and ``GET``/``DELETE`` of a transactional id or a group take the whole rest.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from ..core.broker import validate_name
from ..core.refusal import Refusal
from ..core.subscriptions import SubscriptionError

__all__ = [
    "ADMIN_LISTS",
    "FORCE_ABORT",
    "GROUPS_LIST_PATH",
    "GROUPS_PREFIX",
    "GROUP_RESET",
    "KEYS",
    "LIST_PATH",
    "METRICS_PATH",
    "PREFIX",
    "ROUTE",
    "SINKS_LIST_PATH",
    "SINKS_PREFIX",
    "SINK_ACTIONS",
    "STREAM_ROOT",
    "SUBSCRIPTION_ACTIONS",
    "TXN_LIST_PATH",
    "TXN_PREFIX",
    "UI_PATHS",
    "Route",
    "control_segments",
    "route",
    "routed",
    "sink_action",
]

Scope = MutableMapping[str, Any]

STREAM_ROOT = "/v1/stream"
PREFIX = STREAM_ROOT + "/"
LIST_PATH = "/v1/streams"  # extension: list streams by name prefix
TXN_PREFIX = "/v1/txn/"  # extension: transactions (docs/transactions.md)
GROUPS_PREFIX = "/v1/groups/"  # extension: consumer-group offsets
SINKS_PREFIX = "/v1/sinks/"  # extension: many transactions committed as one (docs/transactions.md)
# extension: what an operator lists (docs/operations.md): transactional ids, groups with lag, sinks
TXN_LIST_PATH, GROUPS_LIST_PATH, SINKS_LIST_PATH = "/v1/txn", "/v1/groups", "/v1/sinks"
UI_PATHS = ("/ui", "/ui/")  # the dashboard (docs/operations.md)
ADMIN_LISTS = (TXN_LIST_PATH, GROUPS_LIST_PATH, SINKS_LIST_PATH)
FORCE_ABORT = "force-abort"  # POST /v1/txn/<id>/force-abort: an operator's abort of a hanging transaction
GROUP_RESET = "reset"  # POST /v1/groups/<group>/reset: rewind (or move) a group to earliest/latest/offsets/a time
METRICS_PATH = "/metrics"  # Prometheus metrics (docs/operations.md)
SINK_ACTIONS = ("", "commit", "abort", "begin", "alive", "reset")
SUBSCRIPTION_ACTIONS = ("callback", "claim", "ack", "release")
_WAKES = ("callback", "ack", "release")  # a subscription's wake token's calls (the guard's subs.wake)
_TXN_ACTIONS = {"init": "txn.init", "commit": "txn.end", "abort": "txn.end", "offsets": "txn.offsets"}
_TXN_ACTIONS[FORCE_ABORT] = "txn.force_abort"
_STREAM_KEYS = {
    "GET": "stream.read",
    "HEAD": "stream.head",
    "PUT": "stream.create",
    "POST": "stream.append",
    "DELETE": "stream.delete",
}
_LISTS = {TXN_LIST_PATH: "txns.list", GROUPS_LIST_PATH: "groups.list", SINKS_LIST_PATH: "sinks.list"}
ROUTE = "onceflow.route"  # the ASGI scope key under which the outermost layer leaves the Route


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes. ``key``: its endpoint. ``name``: the name in its path the guard checks
    (a stream, a transactional id, a group, a sink, a subscription; for a ``*.other`` key under
    ``/v1/txn/``, ``/v1/groups/`` and ``/v1/sinks/``, the whole path after the prefix). ``action``:
    the action its path ends in (``commit``, ``reset``, ``claim``...). ``extra``: the stream path
    under a subscription (``subs.remove_stream``). ``refused``: for a path or method no endpoint
    takes, (status, what is wrong, the methods it takes: the ``Allow`` of a 405)."""

    key: str
    name: str = ""
    action: str = ""
    extra: str = ""
    refused: tuple[int, str, str] | None = None


def _not_found(key: str, name: str, message: str) -> Route:
    return Route(key, name, refused=(404, message, ""))


def _not_allowed(key: str, name: str, method: str, allow: str, action: str = "") -> Route:
    say = " or ".join(allow.split(", ")) if allow.count(",") == 1 else allow
    return Route(key, name, action, refused=(405, f"{method} is not supported here; use {say}", allow))


def route(method: str, path: str, scope: Scope) -> Route:
    """The route of a request (``path``: decoded, as :func:`~onceflow.server.app.request_path`
    gives it). Raises :class:`~onceflow.core.subscriptions.SubscriptionError` for a control path
    whose percent-escapes are not UTF-8."""
    if path.startswith(PREFIX):
        name = path[len(PREFIX) :]
        if name == "__ds" or name.startswith("__ds/"):
            return _control(method, control_segments(scope))
        key = _STREAM_KEYS.get(method)
        if key is None:
            return Route(
                "stream.other",
                name,
                refused=(405, f"{method} is not supported on a stream", "GET, HEAD, POST, PUT, DELETE, OPTIONS"),
            )
        return Route(key, name)
    if path.startswith(TXN_PREFIX):
        return _txn(method, path[len(TXN_PREFIX) :])
    if path.startswith(SINKS_PREFIX):
        return _sink(method, path[len(SINKS_PREFIX) :])
    if path.startswith(GROUPS_PREFIX):
        return _group(method, path[len(GROUPS_PREFIX) :])
    get = method in ("GET", "HEAD")
    if path == LIST_PATH and get:
        return Route("streams.list")
    if path in _LISTS and get:
        return Route(_LISTS[path])
    if path in UI_PATHS:
        return Route("ui")  # any method: the page answers 405 to all but GET and HEAD
    if path == METRICS_PATH:
        return Route("metrics")  # any method, likewise
    return _not_found("other", "", f"no such resource: streams live under {PREFIX}<name>")


def routed(scope: Scope, path: str) -> Route:
    """The route of the request ``scope``, whose decoded path is ``path``: the one an outer layer
    left in the scope (:data:`ROUTE`) for that method and path, or routed now and left there for
    the layers within (raises as :func:`route`)."""
    method: str = scope["method"]
    found = scope.get(ROUTE)
    if isinstance(found, tuple) and found[0] == method and found[1] == path:
        r: Route = found[2]
        return r
    r = route(method, path, scope)
    scope[ROUTE] = (method, path, r)
    return r


_TXN_USAGE = "use /v1/txn/<transactional id>/(init|commit|abort|offsets)"


def _txn(method: str, rest: str) -> Route:
    if method == "GET":  # the id itself may contain '/'
        return Route("txn.read", rest)
    if method == "DELETE":
        return Route("txn.delete", rest)
    tid, _, action = rest.rpartition("/")
    key = _TXN_ACTIONS.get(action)
    if method == "POST" and key is not None:
        return Route(key, tid, action)
    if not tid or validate_name(tid):
        return _not_found("txn.other", rest, _TXN_USAGE)
    if method != "POST":
        return _not_allowed("txn.other", rest, method, "POST", action)
    return _not_found(
        "txn.other", rest, f"unknown transaction action {action!r}: use init, commit, abort, offsets or {FORCE_ABORT}"
    )


def sink_action(rest: str) -> tuple[str, str]:
    """(sink id, action) of a ``POST /v1/sinks/<rest>``: the action is the last segment when it is
    one, so a sink id may contain ``/`` (``/v1/sinks/pub/s1/commit`` commits sink ``pub/s1``)."""
    sink, _, action = rest.rpartition("/")
    if action in SINK_ACTIONS and action:
        return sink, action
    return rest, ""


_SINK_USAGE = "use /v1/sinks/<sink id> or /v1/sinks/<sink id>/(begin|alive|commit|abort|reset)"


def _sink(method: str, rest: str) -> Route:
    if method == "GET":  # the sink id itself may contain '/'
        return Route("sink.read", rest)
    sink, action = sink_action(rest)
    if method == "POST" and action:
        return Route("sink.reset" if action == "reset" else "sink.post", sink, action)
    if not sink or validate_name(sink) or method == "POST":
        return _not_found("sink.other", rest, _SINK_USAGE)
    return _not_allowed("sink.other", rest, method, "POST" if action else "GET", action)


def _group(method: str, rest: str) -> Route:
    if method == "DELETE":  # the group itself may contain '/'
        return Route("group.delete", rest)
    group, _, action = rest.rpartition("/")
    if group and action == "offsets" and method in ("GET", "POST"):
        return Route("group.read" if method == "GET" else "group.commit", group, action)
    if group and action == GROUP_RESET:
        if method == "POST":
            return Route("group.reset", group, action)
        return _not_allowed("group.other", rest, method, "POST", action)
    if group and action == "offsets":
        return _not_allowed("group.other", rest, method, "GET, POST", action)
    return _not_found(
        "group.other",
        rest,
        f"use /v1/groups/<group>/offsets, POST /v1/groups/<group>/{GROUP_RESET} or DELETE /v1/groups/<group>",
    )


def control_segments(scope: Scope) -> list[str]:
    """Path segments after ``/v1/stream/__ds/``, each percent-decoded (so ``a%2Fb`` stays one)."""
    prefix = STREAM_ROOT + "/__ds/"
    raw = scope.get("raw_path")
    path = raw.decode("latin-1") if isinstance(raw, bytes | bytearray) else ""
    encoded = path.startswith(prefix)
    if not encoded:
        path = scope["path"]  # already decoded by the server
        if not path.startswith(prefix):
            return []
    segments = path[len(prefix) :].split("/")
    if not encoded:
        return segments
    try:
        return [unquote(s, errors="strict") for s in segments]
    except UnicodeDecodeError:
        raise SubscriptionError(Refusal.INVALID_REQUEST, "the path has percent-escapes that are not UTF-8") from None


def _control(method: str, seg: list[str]) -> Route:
    """The control API of Durable Streams' subscriptions (``/v1/stream/__ds/...``)."""
    if seg == ["jwks.json"]:
        if method in ("GET", "HEAD"):
            return Route("subs.jwks")
        return Route("subs.jwks", refused=(405, f"{method} is not supported here; use GET", "GET"))
    if len(seg) < 2 or seg[0] != "subscriptions" or not seg[1]:
        return _not_found(
            "subs.other",
            "",
            f"no control API at {STREAM_ROOT}/__ds/{'/'.join(seg)}: use __ds/jwks.json or "
            "__ds/subscriptions/<id>[/streams|/callback|/claim|/ack|/release]",
        )
    sid, rest = seg[1], seg[2:]
    if not rest:
        key = {"PUT": "subs.create", "GET": "subs.read", "HEAD": "subs.read", "DELETE": "subs.delete"}.get(method)
        return Route(key, sid) if key else _not_allowed("subs.other", sid, method, "GET, PUT, DELETE")
    if rest[0] == "streams":
        if len(rest) == 1:
            return (
                Route("subs.add_streams", sid) if method == "POST" else _not_allowed("subs.other", sid, method, "POST")
            )
        if method == "DELETE":
            return Route("subs.remove_stream", sid, extra="/".join(rest[1:]))
        return _not_allowed("subs.other", sid, method, "DELETE")
    if len(rest) == 1 and rest[0] in SUBSCRIPTION_ACTIONS:
        if rest[0] in _WAKES:  # any method: the wake token is checked first, then the method
            return Route("subs.wake", sid, rest[0], refused=None if method == "POST" else _refused_method(method))
        return (
            Route("subs.claim", sid, "claim") if method == "POST" else _not_allowed("subs.other", sid, method, "POST")
        )
    return _not_found(
        "subs.other",
        sid,
        f"no control API {'/'.join(rest)!r} on a subscription: use streams, callback, claim, ack or release",
    )


def _refused_method(method: str) -> tuple[int, str, str]:
    return (405, f"{method} is not supported here; use POST", "POST")


KEYS = frozenset(
    {
        *_STREAM_KEYS.values(),
        "stream.other",
        "streams.list",
        *_LISTS.values(),
        "txn.read",
        "txn.delete",
        *_TXN_ACTIONS.values(),
        "txn.other",
        "sink.read",
        "sink.reset",
        "sink.post",
        "sink.other",
        "group.delete",
        "group.read",
        "group.commit",
        "group.reset",
        "group.other",
        "subs.jwks",
        "subs.create",
        "subs.read",
        "subs.delete",
        "subs.add_streams",
        "subs.remove_stream",
        "subs.claim",
        "subs.wake",
        "subs.other",
        "metrics",
        "ui",
        "other",
    }
)
