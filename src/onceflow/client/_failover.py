"""Several servers behind one URL (``http://a:4437,b:4437``), and the httpx transports that fail
over between them.

Several onceflow servers may share one PostgreSQL database; one of them, the leader, serves at a
time. A follower answers every request with 503 ``not_leader`` (and ``Onceflow-Leader: <url>``
when it knows the leader); a dead server refuses connections. A client given several servers
keeps the index of the one it last found serving and sends each request there:

- The connection is refused (or cannot be made in time): nothing was sent, so the request goes
  at once to the next server.
- 503 ``not_leader`` (a HEAD's 503 has no body: there, an ``Onceflow-Leader`` header, empty when
  the follower knows no leader): the follower did nothing, so the request goes at once to the
  leader it names (when that is one of the configured servers), else to the next server. A body
  that cannot be sent again (an iterator's) gets the follower's 503 instead.
- Any other transport error (read timeout, connection reset, also while reading the body): the
  request may have reached the server. It is raised unchanged, for the caller's own retry rules
  (the producers resend with the same Producer-Id/Epoch/Seq and transaction ids, which the server
  deduplicates), and the *next* request starts at the next server. A silent server (a frozen one)
  is given up on after at most :data:`SILENT_SERVER` seconds, whatever longer timeout the request
  has, except a live read's wait for data.

Each request tries each server at most once. When every server refused it or was a follower, it
raises :class:`NoServerError` (an ``httpx.ConnectError``: like a refused connection, the request
was stored by none of them) naming each server and what it did.

One representation, parsed here only: a URL with one scheme and several comma-separated
``host:port`` (``http://a:4437,b:4437``, optionally followed by a path such as
``/v1/stream/orders``); the APIs that take a server URL also take a list of single-server URLs,
which :func:`server_url` joins into that form. A URL naming one server is never parsed here: it
goes to httpx as it is, and its client has no failover transport at all.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import httpx

from ..errors import OnceflowError

__all__ = [
    "LEADER_HEADER",
    "SILENT_SERVER",
    "AsyncFailoverTransport",
    "FailoverTransport",
    "NoServerError",
    "ServerURL",
    "Servers",
    "parse_servers",
    "request_url",
    "server_url",
]

ServerURL = str | Sequence[str]
"""A server URL (``http://a:4437`` or ``http://a:4437,b:4437``), or a list of single-server URLs."""

LEADER_HEADER = "onceflow-leader"
SILENT_SERVER = 10.0
"""Seconds a client given several servers waits for one of them (to connect, to send, for a piece
of the answer) before it gives up on it, whatever longer timeout it was given: a frozen leader (SIGSTOP,
a paused VM) takes connections, as its kernel still does, and answers nothing, while another server
leads after a term (3 s by default) and its recovery. The request then fails as any read timeout does
(it may have reached the server: producers resend it, deduplicated) and the next one goes to the next
server. Live reads (``live=long-poll``, ``live=sse``) wait for data by design: their reads keep their
own timeout."""
NOT_LEADER = "not_leader"
_SCHEME_AFTER_COMMA = re.compile(r",\s*[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True, slots=True)
class Servers:
    """The servers a URL names: one ``scheme``, the ``hosts`` (``host:port`` as written, in order)
    and the ``path`` after them (``""`` or e.g. ``/v1/stream/orders``)."""

    scheme: str
    hosts: tuple[str, ...]
    path: str = ""

    def __str__(self) -> str:
        return f"{self.scheme}://{','.join(self.hosts)}{self.path}"

    def origin(self, i: int) -> str:
        """Server ``i`` as a URL without the path: ``http://b:4437``."""
        return f"{self.scheme}://{self.hosts[i]}"

    @property
    def first_url(self) -> str:
        """The first server's URL with the path: what requests are addressed to (the failover
        transport sends them to the current server)."""
        return self.origin(0) + self.path


def _several(url: str) -> tuple[str, str, str] | None:
    """``(scheme, hosts, path)`` of a URL naming several servers; None when it names one."""
    if "," not in url:
        return None  # the fast path: one server
    scheme, sep, rest = url.partition("://")
    hosts, slash, path = rest.partition("/")
    if not sep:
        if "," in url.partition("/")[0]:
            raise ValueError(f"{url!r}: name the scheme once, first: http://a:4437,b:4437")
        return None
    if "," not in hosts:
        return None  # a comma in the path (a stream name), not between servers
    return scheme, hosts, slash + path


def _key(url: httpx.URL) -> tuple[str, str, int | None]:
    """What makes two URLs the same server: scheme, host, port (the scheme's default filled in)."""
    port = url.port or {"http": 80, "https": 443}.get(url.scheme)
    return url.scheme, url.host.lower(), port


def parse_servers(url: str) -> Servers | None:
    """The servers ``url`` names when it names several (``http://a:4437,b:4437[/path]``); None
    when it names one (such a URL is left to httpx as it is). Raises ValueError for a malformed
    list: an empty item, a scheme repeated inside it, user info, a server named twice."""
    parts = _several(url)
    if parts is None:
        return None
    scheme, hosts_text, path = parts
    if _SCHEME_AFTER_COMMA.search(url):
        raise ValueError(f"{url!r}: give host:port after one scheme, as in http://a:4437,b:4437")
    if scheme not in ("http", "https"):
        raise ValueError(f"{url!r}: the scheme must be http or https")
    hosts: list[str] = []
    seen: set[tuple[str, str, int | None]] = set()
    for item in (h.strip() for h in hosts_text.split(",")):
        if not item:
            raise ValueError(f"{url!r}: an empty server between commas")
        if "://" in item or "@" in item:
            raise ValueError(f"{url!r}: give host:port after one scheme, as in http://a:4437,b:4437")
        try:
            parsed = httpx.URL(f"{scheme}://{item}")
        except httpx.InvalidURL as exc:
            raise ValueError(f"{url!r}: {item!r} is not a host:port ({exc})") from None
        if not parsed.host or item.endswith(":"):
            raise ValueError(f"{url!r}: {item!r} is not a host:port")
        key = _key(parsed)
        if key in seen:
            raise ValueError(f"{url!r}: {item!r} is named twice")
        seen.add(key)
        hosts.append(item)
    return Servers(scheme, tuple(hosts), path.rstrip("/") if path.strip("/") else "")


def server_url(url: ServerURL) -> str:
    """The one string form of a server URL. A str is returned as it is; a list of single-server
    URLs (one scheme, one path) is joined: ``["http://a:4437", "http://b:4437"]`` →
    ``http://a:4437,b:4437``."""
    if isinstance(url, str):
        return url
    items = list(url)
    if not items or not all(isinstance(u, str) for u in items):
        raise ValueError(f"{url!r}: give a server URL or a non-empty list of them")
    if len(items) == 1:
        return items[0]
    schemes, paths, hosts = set(), set(), []
    for u in items:
        if _several(u) is not None:
            raise ValueError(f"{u!r}: in a list of servers, each URL names one server")
        try:
            parsed = httpx.URL(u)
        except httpx.InvalidURL as exc:
            raise ValueError(f"{u!r} is not a URL ({exc})") from None
        if not parsed.scheme or not parsed.host:
            raise ValueError(f"{u!r} is not a server URL such as http://a:4437")
        schemes.add(parsed.scheme)
        paths.add(parsed.raw_path.decode("ascii").rstrip("/"))
        hosts.append(parsed.netloc.decode("ascii"))
    if len(schemes) > 1 or len(paths) > 1:
        raise ValueError(f"{url!r}: the servers of one list share one scheme and one path")
    joined = f"{schemes.pop()}://{','.join(hosts)}{paths.pop()}"
    parse_servers(joined)  # the same checks as for a string
    return joined


def request_url(url: str) -> str:
    """The URL to address an HTTP request to: ``url`` itself when it names one server, else the
    first server's (the client's failover transport sends it to the current one)."""
    servers = parse_servers(url)
    return url if servers is None else servers.first_url


class NoServerError(httpx.ConnectError, OnceflowError):
    """Every configured server refused the connection or answered 503 ``not_leader``. None of
    them stored the request (a follower does nothing), so, as after a refused connection (it is
    an ``httpx.ConnectError`` for code that handles those), it is safe to send again once a
    leader is up: retriable. ``tried``: ``(server, what it did)`` in the order tried.

    ``answered``: some server answered (a follower), so the request was carried to it. A writer
    that must know whether a request can still land (a transactional producer deciding how to
    abort) counts that as reaching a server: a copy of it sent again by something on the way (a
    proxy) may land once a leader is up. Only refused connections mean it went nowhere."""

    retriable = True

    def __init__(self, tried: Sequence[tuple[str, str]], *, request: httpx.Request, answered: bool = False) -> None:
        self.answered = answered
        self.tried = tuple(tried)
        what = "; ".join(f"{server}: {outcome}" for server, outcome in self.tried)
        super().__init__(f"no onceflow server took the request (tried {what})", request=request)
        self.code = "no_server"


class _Route:
    """The servers and which one is current, shared by all requests of one client. Holds no I/O:
    the transports below ask it where to go and tell it what happened. Concurrent requests may
    race on ``current``; every outcome is still a server to try, and the next answer corrects it."""

    def __init__(self, servers: Servers) -> None:
        self.servers = servers
        self.targets = [httpx.URL(servers.origin(i)) for i in range(len(servers.hosts))]
        self._index = {_key(u): i for i, u in enumerate(self.targets)}
        self.current = 0

    def addressed(self, url: httpx.URL) -> int | None:
        """The server ``url`` is addressed to; None for another URL (which passes untouched)."""
        return self._index.get(_key(url))

    def index_of(self, url: str) -> int | None:
        try:
            return self._index.get(_key(httpx.URL(url)))
        except (httpx.InvalidURL, TypeError):
            return None

    def point(self, request: httpx.Request, i: int) -> None:
        """Address ``request`` to server ``i`` (its URL and Host header)."""
        target = self.targets[i]
        request.url = request.url.copy_with(scheme=target.scheme, host=target.host, port=target.port)
        request.headers["host"] = target.netloc.decode("ascii")

    def served(self, i: int) -> None:
        self.current = i

    def failed(self, i: int) -> None:
        """Server ``i`` may be gone: the next request starts at the one after it (unless another
        request has already moved on)."""
        if self.current == i:
            self.current = (i + 1) % len(self.targets)


class _Attempt:
    """One request's way through the servers: each at most once, starting at the current one."""

    def __init__(self, route: _Route, request: httpx.Request) -> None:
        self.route = route
        self.request = request
        self.at = route.current
        self.tried: list[tuple[str, str]] = []  # (server, what it did), for NoServerError
        self.answered = False  # a server answered (a follower): the request was carried to it
        self._done: set[int] = set()

    def refused(self, exc: httpx.TransportError) -> int:
        """The connection to the server at hand failed (nothing was sent): the next one to try."""
        return self._move(f"{type(exc).__name__} ({exc or 'no detail'})", None)

    def not_leader(self, leader: str | None) -> int:
        """The server at hand is a follower: the next one to try (the leader it names, if ours)."""
        self.answered = True
        hint = self.route.index_of(leader) if leader else None
        if not leader:
            note = "not the leader (it knows no leader)"
        elif hint is None:
            note = f"not the leader (it names {leader}, which is not among the servers given)"
        else:
            note = f"not the leader (it names {leader})"
        return self._move(note, hint)

    def _move(self, note: str, hint: int | None) -> int:
        """Record what the server at hand did; the next server, or NoServerError if none is left."""
        self.tried.append((self.route.servers.origin(self.at), note))
        self._done.add(self.at)
        n = len(self.route.targets)
        if hint is not None and hint not in self._done:
            self.at = hint
            return hint
        for k in range(1, n):
            j = (self.at + k) % n
            if j not in self._done:
                self.at = j
                return j
        raise NoServerError(self.tried, request=self.request, answered=self.answered)


# transport errors raised before a byte of the request could have reached the server (a full
# connection pool, the other such error, is this client's own and moves nothing)
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)


def _bound_silence(request: httpx.Request) -> None:
    """At most :data:`SILENT_SERVER` for each wait of ``request`` on a server (a live read's wait
    for data excepted); a shorter timeout the caller gave, or none at all (``None``), stays."""
    timeouts = dict(request.extensions.get("timeout", {}))
    live = bool(request.url.params.get("live"))
    for kind in ("connect", "write") if live else ("connect", "write", "read"):
        wait = timeouts.get(kind)
        if wait is not None and wait > SILENT_SERVER:
            timeouts[kind] = SILENT_SERVER
    request.extensions["timeout"] = timeouts


def _leader_of(response: httpx.Response, raw: bytes) -> tuple[bool, str | None]:
    """Whether a 503 (its headers and raw body) is a follower's, and the leader's URL it names
    (None when it knows none). A follower's 503 has the error code ``not_leader`` in its body or,
    as a HEAD's has no body, an ``Onceflow-Leader`` header (empty when it knows no leader); the
    leader is the header's, else the body's ``leader``."""
    header = response.headers.get(LEADER_HEADER)
    named: object = None
    try:
        error = json.loads(httpx.Response(503, headers=response.headers, stream=httpx.ByteStream(raw)).read())["error"]
        code, named = error.get("code"), error.get("leader")
    except (httpx.DecodingError, ValueError, KeyError, TypeError, AttributeError):
        code = None
    if code != NOT_LEADER and header is None:
        return False, None
    return True, header or (named if isinstance(named, str) and named else None)


def _again(response: httpx.Response, raw: bytes) -> httpx.Response:
    """``response`` with its body, read to look at it, ready to be read again."""
    return httpx.Response(
        response.status_code, headers=response.headers, stream=httpx.ByteStream(raw), extensions=response.extensions
    )


class _Watched(httpx.SyncByteStream):
    """A response body whose transport errors move the route on (a body may break off midway)."""

    def __init__(self, stream: httpx.SyncByteStream, route: _Route, i: int) -> None:
        self._stream, self._route, self._i = stream, route, i

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self._stream
        except httpx.TransportError:
            self._route.failed(self._i)
            raise

    def close(self) -> None:
        self._stream.close()


class _AsyncWatched(httpx.AsyncByteStream):
    def __init__(self, stream: httpx.AsyncByteStream, route: _Route, i: int) -> None:
        self._stream, self._route, self._i = stream, route, i

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._stream:
                yield chunk
        except httpx.TransportError:
            self._route.failed(self._i)
            raise

    async def aclose(self) -> None:
        await self._stream.aclose()


class FailoverTransport(httpx.BaseTransport):
    """Sends each request addressed to one of ``servers`` to the current one of them, failing over
    as the module docstring says; requests to other URLs go to ``inner`` untouched. ``inner``
    (an ``httpx.HTTPTransport``) makes the connections, to every server from one pool."""

    def __init__(self, servers: Servers, inner: httpx.BaseTransport) -> None:
        self._route = _Route(servers)
        self._inner = inner

    @property
    def current(self) -> str:
        """The server the next request goes to first (``http://b:4437``)."""
        return self._route.servers.origin(self._route.current)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        route = self._route
        at = route.addressed(request.url)
        if at is None:
            return self._inner.handle_request(request)
        _bound_silence(request)
        attempt = _Attempt(route, request)
        i = attempt.at
        while True:
            if i != at:
                route.point(request, i)
                at = i
            try:
                response = self._inner.handle_request(request)
            except _NOT_SENT as exc:
                i = attempt.refused(exc)
                continue
            except httpx.TransportError:
                route.failed(i)
                raise
            assert isinstance(response.stream, httpx.SyncByteStream)
            if response.status_code != 503:
                route.served(i)
                response.stream = _Watched(response.stream, route, i)
                return response
            try:
                raw = b"".join(response.stream)
            except httpx.TransportError:
                route.failed(i)
                raise
            finally:
                response.close()
            not_leader, leader = _leader_of(response, raw)
            if not not_leader:
                route.served(i)
                return _again(response, raw)
            if not isinstance(request.stream, httpx.ByteStream):
                route.failed(i)  # a body that cannot be sent again: the caller gets the follower's 503
                return _again(response, raw)
            i = attempt.not_leader(leader)

    def close(self) -> None:
        self._inner.close()


class AsyncFailoverTransport(httpx.AsyncBaseTransport):
    """The asyncio twin of :class:`FailoverTransport`."""

    def __init__(self, servers: Servers, inner: httpx.AsyncBaseTransport) -> None:
        self._route = _Route(servers)
        self._inner = inner

    @property
    def current(self) -> str:
        return self._route.servers.origin(self._route.current)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        route = self._route
        at = route.addressed(request.url)
        if at is None:
            return await self._inner.handle_async_request(request)
        _bound_silence(request)
        attempt = _Attempt(route, request)
        i = attempt.at
        while True:
            if i != at:
                route.point(request, i)
                at = i
            try:
                response = await self._inner.handle_async_request(request)
            except _NOT_SENT as exc:
                i = attempt.refused(exc)
                continue
            except httpx.TransportError:
                route.failed(i)
                raise
            assert isinstance(response.stream, httpx.AsyncByteStream)
            if response.status_code != 503:
                route.served(i)
                response.stream = _AsyncWatched(response.stream, route, i)
                return response
            try:
                raw = b"".join([chunk async for chunk in response.stream])
            except httpx.TransportError:
                route.failed(i)
                raise
            finally:
                await response.aclose()
            not_leader, leader = _leader_of(response, raw)
            if not not_leader:
                route.served(i)
                return _again(response, raw)
            if not isinstance(request.stream, httpx.ByteStream):
                route.failed(i)
                return _again(response, raw)
            i = attempt.not_leader(leader)

    async def aclose(self) -> None:
        await self._inner.aclose()
