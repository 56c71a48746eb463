"""Serving from PostgreSQL: servers that share one database, one of them leading (docs/ha.md).

Every server is stateless: all a stream holds (its batches, producer state, transactions, group
offsets, subscriptions) lives in the database (storage/pgfs.py), so any server can serve it. One
serves at a time: the holder of the store's *lease*, a row of the database with a term and a token.

- A server starts as a follower: it listens at once and answers every request 503 ``not_leader``
  naming the leader's URL (``Onceflow-Leader``), so clients given several URLs move there.
- When nobody holds the lease (at first start, or when the holder's term ran out by the database's
  clock) a follower takes it with a new token, recovers every stream from the database (the same
  recovery as after a crash on a local disk) and serves.
- The leader renews the lease every third of its term. Every write it makes reads the token in
  the same database transaction, so once another server took the lease, the old leader can write
  nothing more (fencing by token, not by clocks). A leader that cannot renew within its term, or
  finds the lease taken, stops serving and exits (status 3): a supervisor restarts it as a follower.
- A clean shutdown gives the lease up at once, so a follower takes over without waiting the term.

High availability comes from PostgreSQL's own replication: with a synchronous standby, an append
is acknowledged only once two machines hold it; after the standby is promoted the leader carries on
over the new primary (a multi-host URL with ``target_session_attrs=read-write`` finds it) as long
as that takes less than the lease's term.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ..core.broker import Broker
from ..storage.fs import FileSystem
from ..storage.pgfs import PgFileSystem
from .app import App
from .http import HttpLimits, HttpServerProtocol, start_server
from .instrument import Instrumented
from .run import shut_down

__all__ = ["LEASE_LOST_EXIT", "ROOT", "NotLeader", "Switch", "serve_store"]

log = logging.getLogger("onceflow")

ROOT = Path("/onceflow")  # where the broker's files are, inside the database
LEASE_LOST_EXIT = 3

ASGIApp = Callable[..., Any]
T = TypeVar("T")


class Switch:
    """The ASGI app a server listens with; what it serves changes when the server leads or stops."""

    def __init__(self, target: ASGIApp) -> None:
        self.target = target

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.target(scope, receive, send)


class NotLeader:
    """What a server that does not hold the lease answers: 503 ``not_leader`` with the leader's URL."""

    def __init__(self, fs: PgFileSystem, lease_seconds: float) -> None:
        self._fs = fs
        self._lease_seconds = lease_seconds
        self._leader: str | None = None
        self._read_at = -1e9

    async def _leader_url(self) -> str | None:
        now = time.monotonic()
        if now - self._read_at >= 1.0:  # the lease is read at most once a second
            self._read_at = now
            try:
                held = await _off_loop(self._fs.holder)
            except OSError:
                held = None
            self._leader = held[1] if held is not None else None
        return self._leader

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        leader = await self._leader_url()
        message = (
            f"this onceflow server does not hold the store's lease: the leader is {leader}"
            if leader
            else f"no onceflow server holds the store's lease now; one takes it within {self._lease_seconds:g} s"
        )
        body = json.dumps({"error": {"code": "not_leader", "message": message, "leader": leader}}).encode()
        # the header always, empty when no leader is known: a HEAD's answer has no body to tell a
        # follower's 503 from another one (clients move to the next server on it)
        headers = [
            (b"content-type", b"application/json"),
            (b"retry-after", b"1"),
            (b"cache-control", b"no-store"),
            (b"onceflow-leader", (leader or "").encode()),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))


async def _hold(fs: PgFileSystem, token: int, term: float) -> str:
    """Renew the lease every third of its term; returns why it was lost."""
    renewed = time.monotonic()
    while True:
        await asyncio.sleep(term / 3)
        started = time.monotonic()
        try:
            if not await _off_loop(fs.renew, token, term):
                return "another server took the store's lease over"
            renewed = started
        except OSError as exc:
            log.warning("could not renew the store's lease: %s", exc)
        # the database extended the term from a moment after `renewed`: stop before it can run out
        if time.monotonic() - renewed > term * 0.8:
            return f"could not renew the store's lease for {time.monotonic() - renewed:.1f} s"


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    """Sleep ``seconds`` unless told to stop; whether told to stop."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        return False
    return True


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
    lease_seconds: float = 10.0,
) -> None:
    """Serve the streams of the PostgreSQL database ``store`` (module docstring) until ``stop``."""
    if lease_seconds < 1.0:
        raise ValueError("the lease's term must be at least 1 s")
    fs = await _off_loop(PgFileSystem, store)
    follower = NotLeader(fs, lease_seconds)
    switch = Switch(follower)
    connections: set[HttpServerProtocol] = set()
    server = await start_server(switch, host, port, limits, connections)
    bound = server.sockets[0].getsockname()[1]
    me = advertise or f"http://{host}:{bound}"
    holder = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
    print(f"onceflow listening on http://{host}:{bound} (store: PostgreSQL, {me})", flush=True)
    token: int | None = None
    while token is None:
        try:
            token = await _off_loop(fs.acquire, holder, me, lease_seconds)
        except OSError as exc:
            log.warning("could not reach the store: %s", exc)
        if token is None and await _wait(stop, min(1.0, lease_seconds / 4)):
            server.close()
            fs.close()
            return
    fs.token = token
    broker = make_broker(fs, ROOT)
    await _off_loop(broker.open)  # recovery: every stream, from the database
    app, handler = build(broker)
    await broker.start()
    app.subscriptions.start()
    switch.target = handler
    print(f"onceflow leads the store (lease token {token})", flush=True)
    lost = asyncio.ensure_future(_hold(fs, token, lease_seconds))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({lost, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if lost.done():
        why = lost.result()
        switch.target = follower
        log.error("%s: stopping (a supervisor restarts this server as a follower)", why)
        print(f"onceflow: {why}; exiting", flush=True)
        os._exit(LEASE_LOST_EXIT)  # its memory may be ahead of the store: serve nothing more of it
    lost.cancel()
    await shut_down(server, connections, app, broker)
    try:
        await _off_loop(fs.release, token)
    except OSError as exc:
        log.warning("could not give the store's lease up (a follower takes it when it expires): %s", exc)
    fs.close()
