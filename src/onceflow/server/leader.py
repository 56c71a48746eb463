"""Serving from PostgreSQL: servers that share one database, one of them leading (docs/ha.md).

Every server is stateless: all a stream holds (its batches, producer state, transactions, group
offsets, subscriptions) lives in the database (storage/pgfs.py), so any server can serve it. One
serves at a time: the holder of the store's *lease*, a row of the database with a term and a token.

- A server starts as a follower: it listens at once and passes every request on to the leader, and
  the leader's answer back (:class:`NotLeader`), so any server answers any request (behind a load
  balancer too). With ``--no-forward``, or while no leader is known, it answers 503 ``not_leader``
  naming the leader's URL (``Onceflow-Leader``), so clients given several URLs move there.
- When nobody holds the lease (at first start, or when the holder's term ran out by the database's
  clock) a follower takes it with a new token, recovers every stream from the database (the same
  recovery as after a crash on a local disk) and serves.
- The leader renews the lease every third of its term, from the moment it takes it (recovery
  included: with many streams it outlasts a term). Every write it makes reads the token in the same
  database transaction, so once another server took the lease, the old leader can write nothing
  more (fencing by token, not by clocks). Reads are not fenced so: the leader answers a request only
  while its lease is valid by its own clock (0.8 of a term after the last renewal began, which the
  database's term outlasts), else it answers as a follower. A leader that cannot renew for that
  long (a renewal that hangs does not hold up the next) exits (status 3) once no renewal on its way
  could make the lease valid again (one answered late counts from when it began), and at once when
  it finds the lease taken: a supervisor restarts it as a follower. So a paused, partitioned or
  blocked leader never answers from its memory once another server may have taken over.
- A clean shutdown gives the lease up at once, so a follower takes over without waiting the term.

High availability comes from PostgreSQL's own replication: with a synchronous standby, an append
is acknowledged only once two machines hold it; after the standby is promoted the leader carries on
over the new primary (a multi-host URL with ``target_session_attrs=read-write`` finds it) as long
as that takes less than the lease's term.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import secrets
import socket
import threading
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar
from urllib.parse import unquote_to_bytes

import httpx
import psycopg
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..core.broker import Broker
from ..storage.fs import FileSystem
from ..storage.pgfs import PgFileSystem
from .app import AnswerWithdrawn, App
from .guard import GuardConfig, refused_before_body
from .http import HttpLimits, HttpServerProtocol, start_server
from .instrument import Instrumented
from .run import shut_down

__all__ = [
    "LEASE_LOST_EXIT",
    "ROOT",
    "BodyBudget",
    "Lease",
    "Leading",
    "Renewals",
    "NotLeader",
    "Seal",
    "Switch",
    "serve_store",
    "take_lease",
]

log = logging.getLogger("onceflow")

ROOT = Path("/onceflow")  # where the broker's files are, inside the database
LEASE_LOST_EXIT = 3

ASGIApp = Callable[..., Any]
T = TypeVar("T")


class Switch:
    """The ASGI app a server listens with; what it serves changes when the server leads or stops.

    It answers ``GET /v1/leader`` itself, never passed on: ``{"leads": bool, "me": url, "leader":
    url or null}``, this server's own view (for probes, load balancers' health checks and tests)."""

    def __init__(self, target: ASGIApp) -> None:
        self.target = target
        self.leads = False
        self.lease: Lease | None = None  # while it leads: answers only while this is valid
        self.me: str | None = None
        self.leader: Callable[[], Any] | None = None  # async: the leader's URL as last read

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/leader" and scope["method"] in ("GET", "HEAD"):
            leads = self.leads and (self.lease is None or self.lease.valid())
            leader = self.me if leads else (await self.leader() if self.leader is not None else None)
            body = json.dumps({"leads": leads, "me": self.me, "leader": leader}).encode()
            headers = [(b"content-type", b"application/json"), (b"cache-control", b"no-store")]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else body})
            return
        await self.target(scope, receive, send)


def _clock() -> float:
    """Seconds on a clock that goes on while this process is stopped and while its machine is
    suspended (``CLOCK_BOOTTIME``; the monotonic clock where there is none)."""
    return time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()


_BOOTTIME: int | None = getattr(time, "CLOCK_BOOTTIME", None)


class Lease:
    """The store's lease as this server holds it: :attr:`until` is when it may have run out, by
    :func:`_clock`.

    The database extends the term by ``term`` from a moment *after* a renewal began here, so the
    lease is surely this server's until ``MARGIN`` of a term after that beginning (clocks may drift
    apart by less than the margin, nothing more)."""

    MARGIN = 0.8

    def __init__(self, token: int, term: float, began: float, clock: Callable[[], float] | None = None) -> None:
        self.clock = clock or _clock  # the simulator gives each server a clock of its own
        self.token = token
        self.term = term
        self.began = began  # the last renewal (or the taking) that succeeded began then
        self.until = began + self.MARGIN * term
        self._lock = threading.Lock()  # renewals succeed in threads of their own

    def renewed(self, began: float) -> None:
        """A renewal that began at ``began`` (:func:`_clock`) succeeded (an earlier one finishing
        late moves nothing back)."""
        with self._lock:
            if began > self.began and self.until > -math.inf:
                self.began = began
                self.until = began + self.MARGIN * self.term

    def lose(self) -> None:
        """Another server holds it, or this one may not lead on: invalid at once, for good."""
        with self._lock:
            self.until = -math.inf

    def valid(self) -> bool:
        return self.clock() < self.until


class Leading:
    """The leader's app behind its lease: a request that arrives when the lease may have run out
    (the process was paused, its event loop blocked, its renewals hang) is handled as a follower
    handles it, never answered from this server's memory, which another leader may have overtaken.

    A request a follower passed on with its headers sealed (:class:`Seal`) is opened first: handled
    with the headers sealed in it, or refused (400 ``bad_seal``) when it does not open."""

    def __init__(self, handler: ASGIApp, follower: ASGIApp, lease: Lease, seal: Seal | None = None) -> None:
        self.handler = handler
        self.follower = follower
        self.lease = lease
        self.seal = seal

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if not self.lease.valid():
            await self.follower(scope, receive, send)
            return
        if self.seal is not None and scope["type"] == "http" and any(k == SEALED for k, _ in scope["headers"]):
            opened = await self.seal.open_request(scope, receive, self.lease.token)
            if opened is None:  # the client may send it again: nothing was done
                await _error(send, 503, "lease_changed", "the store's lease changed hands as the request was passed on")
                return
            if isinstance(opened, str):
                await _error(send, 400, "bad_seal", opened)
                return
            scope, receive = opened
        if scope["type"] != "http" or scope["method"] not in ("GET", "HEAD"):
            # a write is fenced by the database: if it was stored, this server still held the lease
            # when it committed, and its answer is true whenever it is sent
            await self.handler(scope, receive, send)
            return
        # a read answers from memory: a long-poll or a live tail that began while the lease was
        # valid (or waited behind a blocked event loop) must not answer once another server may lead
        lease, started = self.lease, False

        async def while_valid(message: Any) -> None:
            nonlocal started
            if not lease.valid():
                raise _LeaseRanOut
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.handler(scope, receive, while_valid)
        except _LeaseRanOut:
            if started:  # a live tail broken off: left unfinished, so the server closes the
                return  # connection (no error: the client reads on from another server)
            await _not_leader(send, "this server's lease ran out while it answered the read; ask again", None)


class _LeaseRanOut(AnswerWithdrawn):
    """A read's answer was about to go out after this server's lease ran out."""


HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)  # Host is kept: the leader answers for the name the client used (URLs it builds in bodies)
# Content-Length is not hop-by-hop: a body passed on as it came keeps its length. A request's is the
# follower's own to set (NotLeader frames the body it holds); an answer's is the leader's, passed on
# with the leader's body as it came (undecoded), so that a client that cannot read chunked coding
# (HTTP/1.0) gets a framed answer where the leader framed it.
FORWARDED = b"onceflow-forwarded"  # set on a request a follower passes on: it is never passed on twice
SEALED = b"onceflow-sealed"  # a passed-on request's headers, sealed with the cluster's secret
IN_CLEAR = frozenset({b"host", b"content-type"})  # also sent in clear (content-type: for no one's sake but logs')


class Seal:
    """A follower passes a request on with its headers (the bearer token and cookies among them)
    sealed, AES-GCM with the secret the servers of one store share (``PgFileSystem.cluster_secret``), so that
    a listener at the address in the lease's row that is not a server of the store (a stale or wrong
    ``--advertise``, a port another process took) learns nothing of them. Only ``Host`` and
    ``Content-Type`` travel in clear besides.

    The seal also binds the method, the target, a digest of the body, the lease's token and the
    time, and the leader opens each seal once: such a listener can at most deliver the client's own
    request, unaltered, once, to the leader that held the lease then, within ``WINDOW`` seconds."""

    WINDOW = 30.0  # seconds a seal opens after it was made (the servers' clocks may differ by less)

    def __init__(self, secret: bytes) -> None:
        self._aead = AESGCM(secret)
        self._opened: OrderedDict[bytes, float] = OrderedDict()  # nonces opened, until they expire

    @staticmethod
    def _bound(method: str, path: bytes, query: bytes) -> bytes:
        # the target percent-decoded: the follower's HTTP client may encode it otherwise than it came
        return method.encode("latin-1") + b" " + unquote_to_bytes(path) + b"?" + unquote_to_bytes(query)

    def close(
        self,
        method: str,
        path: bytes,
        query: bytes,
        headers: list[tuple[bytes, bytes]],
        digest: str,
        token: int,
        size: int | None = None,
    ) -> bytes:
        """The header ``onceflow-sealed`` of a request to the leader holding the lease ``token``, whose
        body's SHA-256 is ``digest`` (hex: computed as the body came, which is passed on as it came)
        and whose ``Content-Length`` is ``size`` (None: not bound, as by followers before it was)."""
        sealed = {
            "t": time.time(),
            "token": token,
            "size": size,
            "body": digest,
            "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in headers],
        }
        nonce = secrets.token_bytes(12)
        box = self._aead.encrypt(nonce, json.dumps(sealed).encode(), self._bound(method, path, query))
        return base64.urlsafe_b64encode(nonce + box)

    async def open_request(self, scope: Any, receive: Any, token: int) -> tuple[Any, Any] | str | None:
        """The request with the headers sealed in it and its body as received; or why it does not
        open; or None when it was sealed for another holder of the lease than ``token``'s.

        Everything but the body's digest is checked before the body is read, its ``Content-Length``
        against the size sealed (when one is): anyone may send the header, and a request whose seal
        does not open is refused without a byte of its body held, as is a sealed request sent again
        with a body of another size (of any size: nothing else bounds it here). Its nonce counts as
        opened from then on, so a copy sent while this body arrives is refused."""
        value = next(v for k, v in scope["headers"] if k == SEALED)
        path = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")
        bound = self._bound(scope["method"], path, scope.get("query_string", b""))
        why = "the request's onceflow-sealed header does not open with this store's secret"
        try:
            raw = base64.urlsafe_b64decode(value)
            sealed = json.loads(self._aead.decrypt(raw[:12], raw[12:], bound))
            made, headers = (
                float(sealed["t"]),
                [(k.encode("latin-1"), v.encode("latin-1")) for k, v in sealed["headers"]],
            )
            body_digest, sealed_for = sealed["body"], int(sealed["token"])
            size = None if sealed.get("size") is None else int(sealed["size"])
        except (ValueError, TypeError, KeyError, InvalidTag, UnicodeError):
            return why
        if sealed_for != token:
            return None  # for the lease's earlier holder: the follower passed it on as the lease changed hands
        now = time.time()
        while self._opened and next(iter(self._opened.values())) < now:
            self._opened.popitem(last=False)
        if abs(now - made) > self.WINDOW or raw[:12] in self._opened:
            return why + " any more: it was opened before, or made too long ago"
        framing = [(k, v) for k, v in scope["headers"] if k in (b"content-length", b"transfer-encoding")]
        if size is not None and (framing or [(b"content-length", b"0")]) != [(b"content-length", str(size).encode())]:
            return why + " with a body of this length"  # a body without framing is empty
        self._opened[raw[:12]] = now + 2 * self.WINDOW
        messages = []
        digest = hashlib.sha256()
        while True:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            digest.update(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        if body_digest != digest.hexdigest():
            return why + " with this body"
        scope = {**scope, "headers": [*headers, *framing, (FORWARDED, b"1")]}
        replay = iter(messages)

        async def received() -> Any:
            return next(replay, None) or await receive()

        return scope, received


class BodyBudget:
    """Request body bytes that one follower's forwards hold at once: at most ``total``.

    A forward takes its room in one piece, before it reads its body (:meth:`NotLeader._take_body`),
    and gives it back bit by bit as the body goes on to the leader, the rest when it ends, however
    it ends. Taking in one piece, never more while holding some, is what keeps forwards from
    waiting for each other's room for ever. Room that is not free is waited for in the order asked
    (a large body is not overtaken for ever by smaller ones), at most ``wait`` seconds."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("a body budget must be at least 1 byte")
        self.total = total
        self.held = 0
        self._queue: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def take(self, n: int, wait: float) -> bool:
        """Hold ``n`` bytes more; False when they were not free within ``wait`` seconds (nothing is
        held then). ``n`` must not be over ``total``."""
        assert n <= self.total
        if not self._queue and self.held + n <= self.total:
            self.held += n
            return True
        entry = (n, asyncio.get_running_loop().create_future())
        self._queue.append(entry)
        try:
            await asyncio.wait((entry[1],), timeout=wait)
        except BaseException:
            self._leave(entry)
            raise
        if entry[1].done():
            return True
        self._leave(entry)
        return False

    def give(self, n: int) -> None:
        """``n`` bytes held are free again: the first in the queue take them when they fit."""
        self.held -= n
        self._grant()

    def _grant(self) -> None:
        while self._queue and self.held + self._queue[0][0] <= self.total:
            n, granted = self._queue.popleft()
            self.held += n
            granted.set_result(None)

    def _leave(self, entry: tuple[int, asyncio.Future[None]]) -> None:
        """A waiter gives up (its time ran out, or it was cancelled): room it was granted meanwhile
        is given back; and those behind it may fit now."""
        if entry[1].done():
            self.give(entry[0])
            return
        self._queue.remove(entry)
        entry[1].cancel()
        self._grant()


class _HeldBody:
    """A body a follower holds to pass it on: the pieces as they came (neither joined nor copied),
    their SHA-256 for the seal, and the room they hold in the :class:`BodyBudget`."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget = budget
        self.pieces: deque[bytes] = deque()
        self.size = 0
        self.room = 0  # taken from the budget and not given back yet
        self.digest = hashlib.sha256()

    async def take(self, n: int, wait: float) -> bool:
        if not await self.budget.take(n, wait):
            return False
        self.room += n
        return True

    def add(self, piece: bytes) -> None:
        assert self.size + len(piece) <= self.room
        self.pieces.append(piece)
        self.size += len(piece)
        self.digest.update(piece)

    def trim(self) -> None:
        """The body has all come: give back the room taken beyond its size."""
        self._give(self.room - self.size)

    async def stream(self) -> AsyncIterator[bytes]:
        """The pieces, each let go (and its room given back) once the HTTP client has written it."""
        while self.pieces:
            piece = self.pieces.popleft()
            yield piece
            self._give(min(len(piece), self.room))

    def release(self) -> None:
        """Give back all the room still held (idempotent): the forward ended, however it ended."""
        self.pieces.clear()
        self._give(self.room)

    def _give(self, n: int) -> None:
        if n > 0:
            self.room -= n
            self.budget.give(n)


class NotLeader:
    """What a server that does not hold the lease does with a request: pass it on to the leader and
    its answer back (streamed: long-polls and SSE too), so that any server answers any request; or,
    when no leader is known, when the request was passed on already, or when ``forward`` is off,
    answer 503 ``not_leader`` naming the leader (clients given several servers move on at once).

    A request that cannot reach the leader (connection refused: it sent nothing) is a 503
    ``not_leader``; one whose answer broke off after it was sent, or did not begin in time, is a 502
    ``leader_unreachable``, whose outcome is unknown to the client, as a timeout's is (producers retry
    it and are deduplicated).

    With a guard (``guard``, the leader's own configuration) it refuses what the leader's guard
    would refuse for the request's path and headers alone (a missing or unknown token, a token
    without the scope for the names there), with the leader's own answer, before it reads a byte of
    the body (:func:`~onceflow.server.guard.refused_before_body`): an anonymous client cannot make
    it hold a body, as it cannot the leader.

    Bounded: a body over ``max_body`` is a ``413`` (at once when its declared length says so), and
    the bodies of all forwards at once hold at most ``forward_buffer`` bytes (:class:`BodyBudget`;
    by default ``max_body``: one body of the largest size, or several smaller). A body is held, not
    streamed through: the seal binds its digest, which must be known before the request is sent.

    Compressed bodies and answers (docs/protocol.md, "Compression") pass as they came: the seal binds
    the body's bytes as sent, coded, which the leader digests before its app decodes them, and
    ``Content-Encoding`` travels sealed with the other headers; the bound above is on those bytes,
    the leader bounds them decoded too. The leader's coded answer goes back undecoded, its
    ``Content-Encoding``, ``Vary`` and length with it.

    In time: a leader that is frozen (SIGSTOP, a paused VM) still accepts connections (its kernel
    does), so a forward waits for its answer at most a term (``lease_seconds``: by then another
    server may lead), between any two bytes of it; a long-poll or SSE read waits ``long_poll_timeout``
    more, for the leader answers a long-poll within that and sends an SSE keep-alive as often."""

    def __init__(
        self,
        fs: PgFileSystem,
        lease_seconds: float,
        *,
        me: str,
        forward: bool,
        max_body: int,
        long_poll_timeout: float = 20.0,
        seal: Seal | None = None,
        guard: GuardConfig | None = None,
        forward_buffer: int | None = None,
    ) -> None:
        self.seal = seal
        self._guard = guard
        self.budget = BodyBudget(forward_buffer if forward_buffer is not None else max_body)
        if self.budget.total < max_body:
            raise ValueError("the forward buffer must hold a body of max_body bytes")
        self._fs = fs
        self._lease_seconds = lease_seconds
        self._long_poll_timeout = long_poll_timeout
        self._me = me
        self._forward = forward
        self._max_body = max_body
        self._leader: str | None = None
        self._token = 0  # the leader's lease token, as last read
        self._read_at = -1e9
        self._reading: asyncio.Future[tuple[str, str | None, int] | None] | None = None
        self._client: httpx.AsyncClient | None = None

    async def leader_url(self) -> str | None:
        now = asyncio.get_running_loop().time()
        if now - self._read_at >= 1.0 and self._reading is None:  # read at most once a second, one read at a time
            self._read_at = now
            self._reading = asyncio.ensure_future(_off_loop(self._fs.holder))
            self._reading.add_done_callback(self._read)
        if self._reading is not None:
            # not waiting long (a database that does not answer): the answer sends clients on at
            # once; a read that fails leaves no leader known (_read), which is the answer too
            with contextlib.suppress(TimeoutError, OSError):
                await asyncio.wait_for(asyncio.shield(self._reading), 1.0)
        return self._leader

    def _read(self, reading: asyncio.Future[tuple[str, str | None, int] | None]) -> None:
        self._reading = None
        held = None if reading.cancelled() or reading.exception() is not None else reading.result()
        self._leader = held[1] if held is not None else None
        self._token = held[2] if held is not None else 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        leader = await self.leader_url()
        forwarded = any(k == FORWARDED for k, _ in scope["headers"])
        if self._forward and leader and leader != self._me and not forwarded:
            if self._guard is not None and await refused_before_body(self._guard, scope, send):
                return
            await self._pass_on(leader, scope, receive, send)
            return
        await self._not_leader(leader, send)

    async def _not_leader(self, leader: str | None, send: Any) -> None:
        message = (
            f"this onceflow server does not hold the store's lease: the leader is {leader}"
            if leader
            else f"no onceflow server holds the store's lease now; one takes it within {self._lease_seconds:g} s"
        )
        await _not_leader(send, message, leader)

    ROOM_WAIT = 5.0  # seconds a forward waits for room in the budget: less than a client's patience (10 s)

    async def _take_body(self, scope: Any, receive: Any, send: Any) -> _HeldBody | None:
        """The request's body, held within the budget; None when it was answered instead (``413``,
        ``503 forward_buffer_full``) or the client went away.

        Room is taken before the first byte is read: for the declared ``Content-Length``, or for
        ``max_body`` when the body is chunked (its size is known once it has all come; the room
        beyond is then given back). A forward that waits for room reads nothing meanwhile, and the
        HTTP layer stops reading its connection once it holds ``--body-buffer`` of it."""
        framing = {k: v for k, v in scope["headers"] if k in (b"content-length", b"transfer-encoding")}
        declared = framing.get(b"content-length", b"0" if b"transfer-encoding" not in framing else None)
        length = int(declared) if declared is not None and declared.isdigit() else None
        if length is not None and length > self._max_body:
            await self._too_large(send)
            return None
        body = _HeldBody(self.budget)
        try:
            room = self._max_body if length is None else length
            if room and not await body.take(room, self.ROOM_WAIT):  # a request without a body never waits
                await self._full(send)
                return None
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    body.release()
                    return None
                piece = msg.get("body", b"")
                if body.size + len(piece) > body.room:  # over max_body, or over what it declared
                    body.release()
                    await self._too_large(send)
                    return None
                if piece:
                    body.add(piece)
                if not msg.get("more_body", False):
                    body.trim()
                    return body
        except BaseException:
            body.release()
            raise

    async def _too_large(self, send: Any) -> None:
        """The leader's own answer to a body over ``--max-body`` (server/app.py)."""
        limit = self._max_body
        await _error(send, 413, "payload_too_large", f"request body is larger than the server's limit of {limit} bytes")

    async def _full(self, send: Any) -> None:
        message = (
            f"this server holds as many request bodies as it may ({self.budget.total} bytes, --forward-buffer) "
            "to pass on to the leader; try again"
        )
        await _error(send, 503, "forward_buffer_full", message, ((b"retry-after", b"1"),))

    async def _pass_on(self, leader: str, scope: Any, receive: Any, send: Any) -> None:
        body = await self._take_body(scope, receive, send)
        if body is None:
            return
        try:
            await self._send_on(leader, scope, body, send)
        finally:
            body.release()

    async def _send_on(self, leader: str, scope: Any, body: _HeldBody, send: Any) -> None:
        if self._client is None:
            # a connection per request in flight (live reads hold theirs), bounded by the server's
            # own --max-connections, not by a pool
            self._client = httpx.AsyncClient(
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                trust_env=False,
            )
            # httpx adds Accept-Encoding to every request: the leader would compress answers the
            # client did not ask to be compressed, passed on to it undecoded. The client's own
            # header goes on (sealed, as every header but Host and Content-Type).
            del self._client.headers["accept-encoding"]
        term = self._lease_seconds
        live = any(p in (b"live=long-poll", b"live=sse") for p in scope.get("query_string", b"").split(b"&"))
        timeout = httpx.Timeout(term, connect=min(2.0, term), read=term + self._long_poll_timeout if live else term)
        path = scope.get("raw_path") or scope["path"].encode("utf-8", "surrogateescape")
        if not path.startswith(b"/"):
            # asterisk form (OPTIONS *): no URL has it; the leader answers "/" as it answers "*"
            # (OPTIONS: its 204 for any path; another method: 404), and so the follower does
            path = b"/"
        target_path = path + (b"?" + scope["query_string"] if scope.get("query_string") else b"")
        target = leader.rstrip("/") + target_path.decode("latin-1")
        headers = [(k, v) for k, v in scope["headers"] if k not in HOP_BY_HOP and k != b"content-length"]
        if self.seal is not None:  # the leader at that address proves it is of this store by opening them
            query = scope.get("query_string", b"")
            digest = body.digest.hexdigest()
            sealed = self.seal.close(scope["method"], path, query, headers, digest, self._token, body.size)
            headers = [(k, v) for k, v in headers if k in IN_CLEAR]
            headers.append((SEALED, sealed))
        headers.append((FORWARDED, b"1"))
        if body.size or any(k in (b"content-length", b"transfer-encoding") for k, _ in scope["headers"]):
            # the pieces as they came, framed by their length, as the client's were or could have been
            headers.append((b"content-length", str(body.size).encode()))
        content = body.stream() if body.size else b""
        request = self._client.build_request(scope["method"], target, headers=headers, content=content, timeout=timeout)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.ConnectError:  # nothing reached the leader: as if this server had answered
            self._read_at = -1e9  # read the lease again: the leader may have changed
            await self._not_leader(self._leader, send)
            return
        except httpx.HTTPError as exc:  # a timeout too: the leader may have done the request
            await _error(send, 502, "leader_unreachable", f"the leader {leader} did not answer: {exc!r}")
            return
        started = False
        try:
            out = [(k.lower(), v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]
            if "transfer-encoding" in response.headers:  # framed by chunks (a length beside them is void)
                out = [(k, v) for k, v in out if k != b"content-length"]
            await send({"type": "http.response.start", "status": response.status_code, "headers": out})
            started = True
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except httpx.HTTPError as exc:
            if not started:
                await _error(send, 502, "leader_unreachable", f"the leader {leader} broke off: {exc!r}")
            # else: the client sees the answer end early, as if the leader had gone
        finally:
            await response.aclose()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


async def _error(
    send: Any,
    status: int,
    code: str,
    message: str,
    headers: tuple[tuple[bytes, bytes], ...] = (),
    **more: str | None,
) -> None:
    body = json.dumps({"error": {"code": code, "message": message, **more}}).encode()
    start = [(b"content-type", b"application/json"), *headers]
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": body})


async def _not_leader(send: Any, message: str, leader: str | None) -> None:
    """503 ``not_leader``, naming the leader when one is known. The header always, empty when no
    leader is known: a HEAD's answer has no body to tell a follower's 503 from another one (clients
    move to the next server on it)."""
    headers = ((b"retry-after", b"1"), (b"cache-control", b"no-store"), (b"onceflow-leader", (leader or "").encode()))
    await _error(send, 503, "not_leader", message, headers, leader=leader)


async def _starting(scope: Any, receive: Any, send: Any) -> None:
    """Before the server knows its own URL (a moment at start)."""
    if scope["type"] == "http":
        await _error(send, 503, "starting", "this onceflow server is starting")


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))


class Renewals:
    """When the lease is renewed and when it is given up: every third of its term an attempt, the
    last one at the deadline (:class:`Lease`); each attempt (:meth:`due`) runs apart (a thread of
    its own in the server, :func:`_hold`; the simulator's loop in a simulation), at most three at
    once, so that one that hangs (a primary gone mid-statement) does not hold up the next.

    :meth:`verdict` says why to stop: another server holds the lease, or no renewal succeeded while
    it was valid and none on its way could make it valid again, or the store could not learn the
    outcome of a write (``fs.unsure``: this server's memory may disagree with the store); ``""``
    when woken without a reason (a clean stop); None to go on. ``on_taken`` is told, from the
    attempt, that another server holds it.

    Past the deadline the lease is not valid (the server answers as a follower), but a renewal that
    began before it and is still on its way may yet succeed: the lease is then valid again until
    0.8 of a term after that renewal *began*, whenever its answer came, as safe as one answered at
    once (a follower counts its term from a moment after the renewal committed). So the leader
    steps down only once no renewal on its way could make it valid again, and starts none meanwhile
    (a database that answers slowly costs a moment of follower answers, not a takeover; one that does
    not answer, at most 0.8 of a term after the last attempt began)."""

    TAKEN = "another server took the store's lease over"
    LOOK_AGAIN = 0.1  # of a term: how often a leader past its deadline looks for a late answer

    def __init__(self, fs: PgFileSystem, lease: Lease, on_taken: Callable[[], None]) -> None:
        self.fs = fs
        self.lease = lease
        self.on_taken = on_taken
        self.taken = False
        self.tried = lease.began
        self._on_the_way: list[float] = []  # when each attempt not yet answered began
        self._lock = threading.Lock()

    def wait(self) -> float:
        """Seconds (of the lease's clock) until the next attempt is due, or, past the deadline, until
        the next look for a late answer."""
        lease = self.lease
        now = lease.clock()
        if now >= lease.until:  # an answer that comes does not wake this loop: look again soon
            return max(0.0, min(now + self.LOOK_AGAIN * lease.term, self._hope()) - now)
        return max(0.0, min(self.tried + lease.term / 3, lease.until) - now)

    def _hope(self) -> float:
        """Until when a renewal on its way could make the lease valid (-inf: none is on its way)."""
        with self._lock:
            youngest = max(self._on_the_way, default=-math.inf)
        return youngest + Lease.MARGIN * self.lease.term

    def verdict(self, woken: bool) -> str | None:
        lease = self.lease
        if self.taken:
            return self.TAKEN
        if self.fs.unsure is not None:
            return f"the store could not learn the outcome of a write ({self.fs.unsure})"
        if woken:
            return ""
        self.tried = lease.clock()
        hope = self._hope()  # before the lease: an attempt leaves the way only once it moved the lease
        if self.tried >= lease.until and self.tried >= hope:
            with self._lock:
                hung = len(self._on_the_way)
            return f"could not renew the store's lease for {Lease.MARGIN * lease.term:.1f} s" + (
                " (no answer)" if hung else ""
            )
        return None

    def due(self) -> Callable[[], None] | None:
        """The attempt to run now (after :meth:`verdict` said to go on); None while three hang, or
        past the deadline (waiting for the answers on their way)."""
        began = self.tried
        with self._lock:
            if len(self._on_the_way) >= 3 or began >= self.lease.until:
                return None
            self._on_the_way.append(began)
        return functools.partial(self._attempt, began)

    def _attempt(self, began: float) -> None:
        try:
            try:
                renewed = self.fs.renew(self.lease.token, self.lease.term)
            except OSError as exc:
                log.warning("could not renew the store's lease: %s", exc)
                return
            if renewed:
                self.lease.renewed(began)
            else:
                self.taken = True
                self.lease.lose()
                self.on_taken()
        finally:
            with self._lock:
                self._on_the_way.remove(began)


def _hold(
    fs: PgFileSystem,
    lease: Lease,
    wake: threading.Event,
    *,
    wait: Callable[[float], bool] | None = None,
    spawn: Callable[[Callable[[], None]], None] | None = None,
) -> str | None:
    """Renew the lease (:class:`Renewals`) in a thread of its own, so that nothing the event loop
    does, a long retention sweep, a blocking read, delays it; returns why it was lost, or None when
    ``wake`` is set without a reason (a clean stop). Each attempt runs in a thread of its own
    (``spawn``). ``wait`` and ``spawn`` are for tests (a clock of their own, attempts inline)."""
    wait = wait or wake.wait
    spawn = spawn or _daemon
    renewals = Renewals(fs, lease, wake.set)
    while True:
        why = renewals.verdict(wait(renewals.wait()))
        if why is not None:
            return why or None
        attempt = renewals.due()
        if attempt is not None:
            spawn(attempt)
        if renewals.taken:  # an attempt run inline (tests) found it taken
            return Renewals.TAKEN


def _settle_future(fut: asyncio.Future[str | None], why: str | None) -> None:
    if not fut.done():
        fut.set_result(why)


def _daemon(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, name="onceflow-lease-renewal", daemon=True).start()


def _holding(fs: PgFileSystem, lease: Lease, wake: threading.Event) -> asyncio.Future[str | None]:
    """:func:`_hold` in a thread of its own (not the event loop's executor, which the leader's own
    work may fill); its result as a future of the running loop. A lost lease is invalid at once
    (:meth:`Lease.lose`), before the event loop hears of it."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[str | None] = loop.create_future()

    def run() -> None:
        try:
            why = _hold(fs, lease, wake)
        except BaseException as exc:  # noqa: BLE001 - handed to the event loop
            loop.call_soon_threadsafe(done.set_exception, exc)
            return
        if why is not None:
            lease.lose()
        loop.call_soon_threadsafe(_settle_future, done, why)

    threading.Thread(target=run, name="onceflow-lease", daemon=True).start()
    return done


def _step_down(why: str, switch: Switch, follower: NotLeader) -> NoReturn:
    switch.target, switch.leads = follower, False
    log.error("%s: stopping (a supervisor restarts this server as a follower)", why)
    print(f"onceflow: {why}; exiting", flush=True)
    os._exit(LEASE_LOST_EXIT)  # its memory may be behind the store: serve nothing more of it


async def take_lease(
    fs: PgFileSystem,
    holder: str,
    address: str,
    term: float,
    *,
    clock: Callable[[], float],
    call: Callable[..., Awaitable[Any]],
    pause: Callable[[float], Awaitable[bool]],
    unreachable: Callable[[OSError], None],
) -> tuple[int, float] | None:
    """Take the store's lease, trying again every quarter of a term (at most 1 s) while another
    server holds it: its token and when the taking began by ``clock`` (the term counts from then),
    or None when ``pause`` says to stop waiting. When the taking itself was slow (a database
    failing over), most of its term is gone by this clock: it is renewed once at once, rather than
    leading for a moment and stepping down. ``call(fn, *args)`` runs a call into the store (in a
    thread; the simulator's at once); ``unreachable`` hears each failed attempt. The server and the
    simulator (tools/onceflow_tools/sim/cluster.py) both take the lease here."""
    while True:
        began = clock()
        try:
            token: int | None = await call(fs.acquire, holder, address, term)
        except OSError as exc:
            unreachable(exc)
            token = None
        if token is not None:
            break
        if await pause(min(1.0, term / 4)):
            return None
    if clock() - began > term / 3:
        again = clock()
        with contextlib.suppress(OSError):
            if await call(fs.renew, token, term):
                began = again
    return token, began


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds`` unless told to stop; whether told to stop."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        return False
    return True


async def _reach_store(
    store: str,
    lease_seconds: float,
    stop: asyncio.Event,
    timeouts: tuple[float, float] = (2.0, 5.0),
    cold_reads: int = 4,
) -> tuple[PgFileSystem, bytes] | None:
    """The store and the servers' shared secret, tried again (a warning each time) while the database
    cannot be reached or fails the first transactions (a primary paused or failing over while this
    server starts, as a supervisor restarts it): a server waits for its database as a follower waits
    for the lease, and does not die of it. None once ``stop`` is set first."""
    fs: PgFileSystem | None = None
    while True:
        try:
            if fs is None:
                # a transaction this process left open (paused, SIGSTOP) ends after half a term: the
                # lease's row lock it holds does not keep the next leader out
                fs = await _off_loop(
                    functools.partial(
                        PgFileSystem,
                        store,
                        idle_timeout=lease_seconds / 2,
                        read_timeout=timeouts[0],
                        write_timeout=timeouts[1],
                        cold_reads=cold_reads,
                    )
                )
            return fs, await _off_loop(fs.cluster_secret)
        except (OSError, psycopg.Error) as exc:
            log.warning("could not reach the store (trying again): %s", exc)
        if await _wait(stop, min(1.0, lease_seconds / 4)):
            if fs is not None:
                fs.close()
            return None


async def serve_store(
    store: str,
    *,
    host: str,
    port: int,
    limits: HttpLimits,
    make_broker: Callable[[FileSystem, Path], Broker],
    build: Callable[[Broker], tuple[App, Instrumented]],
    stop: asyncio.Event,
    advertise: str | None = None,
    lease_seconds: float = 3.0,
    forward: bool = True,
    max_body: int = 64 << 20,
    long_poll_timeout: float = 20.0,
    store_timeouts: tuple[float, float] = (2.0, 5.0),
    cold_reads: int = 4,
    guard: GuardConfig | None = None,
    forward_buffer: int | None = None,
) -> None:
    """Serve the streams of the PostgreSQL database ``store`` (module docstring) until ``stop``.
    ``store_timeouts``: how long the event loop waits for one read and one write of the store
    (``PgFileSystem.read_timeout`` and ``write_timeout``); ``cold_reads``: how many clients' reads
    wait for the database at once (``PgFileSystem.cold_reads``). ``guard``: the configuration of the guard
    that ``build`` puts in front of the app, for the checks a follower makes itself
    (:class:`NotLeader`); ``forward_buffer``: the body bytes its forwards hold at once
    (:class:`BodyBudget`, by default ``max_body``)."""
    if not 1.0 <= lease_seconds <= 300.0:  # followers wait the leader's term: never one without end
        raise ValueError("the lease's term must be 1 to 300 s")
    opened = await _reach_store(store, lease_seconds, stop, store_timeouts, cold_reads)
    if opened is None:
        return
    fs, secret = opened
    switch = Switch(_starting)
    connections: set[HttpServerProtocol] = set()
    refusals: Counter[tuple[int, str]] = Counter()  # the HTTP layer's own answers, since this process began
    server = await start_server(switch, host, port, limits, connections, refusals)
    bound = server.sockets[0].getsockname()[1]
    me = advertise or f"http://{host}:{bound}"
    seal = Seal(secret)
    follower = NotLeader(
        fs,
        lease_seconds,
        me=me,
        forward=forward,
        max_body=max_body,
        long_poll_timeout=long_poll_timeout,
        seal=seal,
        guard=guard,
        forward_buffer=forward_buffer,
    )
    switch.target, switch.me, switch.leader = follower, me, follower.leader_url
    holder = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
    print(f"onceflow listening on http://{host}:{bound} (store: PostgreSQL, {me})", flush=True)
    taken = await take_lease(
        fs,
        holder,
        me,
        lease_seconds,
        clock=_clock,
        call=_off_loop,
        pause=functools.partial(_wait, stop),
        unreachable=lambda exc: log.warning("could not reach the store: %s", exc),
    )
    if taken is None:
        server.close()
        await follower.close()
        fs.close()
        return
    token, began = taken
    fs.token = token
    lease = Lease(token, lease_seconds, began)
    # a write whose COMMIT answer was lost is read back while the lease is valid; if it cannot be,
    # the store writes nothing more and this server steps down (its memory may disagree with it)
    fs.alive = lease.valid
    wake = threading.Event()
    fs.on_unsure = lambda why: wake.set()
    lost = _holding(fs, lease, wake)  # renewed from now on: recovery may outlast a term

    async def lead() -> tuple[App, Broker]:
        broker = make_broker(fs, ROOT)
        t = time.monotonic()
        try:
            await _off_loop(broker.open)  # recovery: every stream, from the database
            app, handler = build(broker)
            await _off_loop(app.subscriptions.load)  # each file a query: off the loop, unbounded
        except OSError as exc:  # the database failed it: another server (or this one, restarted) tries again
            wake.set()  # no renewal after the release
            with contextlib.suppress(OSError):
                fs.release(token)  # on the event loop, on purpose: nothing else runs before the exit
            _step_down(f"could not recover the store's streams ({exc})", switch, follower)
        print(f"onceflow recovered {len(broker.streams)} streams in {time.monotonic() - t:.2f} s", flush=True)
        app.metrics.http_refusals = refusals
        await broker.start()
        app.subscriptions.start()
        switch.target, switch.lease, switch.leads = Leading(handler, follower, lease, seal), lease, True
        return app, broker

    leading = asyncio.ensure_future(lead())
    first: set[asyncio.Future[Any]] = {lost, leading}
    await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
    if lost.done():
        _step_down(lost.result() or "the lease's renewals stopped", switch, follower)
    try:
        app, broker = leading.result()
    except BaseException:
        wake.set()
        raise
    print(f"onceflow leads the store (lease token {token})", flush=True)
    stopping = asyncio.ensure_future(stop.wait())
    then: set[asyncio.Future[Any]] = {lost, stopping}
    await asyncio.wait(then, return_when=asyncio.FIRST_COMPLETED)
    if lost.done():
        _step_down(lost.result() or "the lease's renewals stopped", switch, follower)
    await follower.close()
    await shut_down(server, connections, app, broker)  # still renewing: the last snapshots are written
    wake.set()
    try:
        await _off_loop(fs.release, token)
    except OSError as exc:
        log.warning("could not give the store's lease up (a follower takes it when it expires): %s", exc)
    fs.close()
