"""A fault-injecting TCP proxy in front of PostgreSQL that understands just enough of its wire
protocol to lose the answer to a ``COMMIT`` (tests and chaos runs of the PostgreSQL store).

The fault that matters to a store on PostgreSQL is the *unknown outcome*: the database committed a
transaction, but the answer to ``COMMIT`` never reached the client (the primary crashed after its
synchronous standby flushed, a connection was reset at that moment). The client sees a broken
connection and cannot tell a commit from a rollback. This proxy makes that happen on demand::

    proxy = PgFaultProxy(postgres_port)
    proxy.start()
    conninfo = proxy.conninfo("dbname")      # sslmode=disable: the proxy reads the protocol in clear
    proxy.arm(lambda sql: "onceflow_chunks" in sql)           # the next such transaction's COMMIT
    ...                                                       # ... commits, and its answer is lost
    proxy.stop()

:meth:`PgFaultProxy.arm` takes a predicate on the SQL text of a transaction (every query the client
sent since its last ``COMMIT`` or ``ROLLBACK``, simple or extended protocol) and how to fail:

- ``"answer"`` (default): the ``COMMIT`` goes to the database, which commits; its answer is
  swallowed and both connections are closed. The outcome is *committed*, the client sees an error.
- ``"request"``: the connection is closed before the ``COMMIT`` is sent. The database rolls the
  transaction back; the client sees the same error. The outcome is *rolled back*.

Each :meth:`arm` applies to one ``COMMIT``; :attr:`lost` counts those done. With ``then_down``, or
while :attr:`down` is set, the database is unreachable through the proxy: new connections close. The proxy runs its own
event loop in a background thread, so it serves blocking and asyncio clients alike.

While :attr:`blackhole` is set the network between client and database is cut as a partition cuts
it, not as a crash does: nothing passes either way on the open connections and a new connection
is accepted but never answered, so the client learns only by its own timeouts (``connect_timeout``,
``statement_timeout``, a lease's term). Nothing is refused or reset. When it is cleared, what
waited is delivered, as TCP's retransmissions deliver it after a short partition heals.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["PgFaultProxy"]

_SSL_REQUEST = 80877103
_GSS_REQUEST = 80877104
_CANCEL_REQUEST = 80877102

How = Literal["answer", "request"]


@dataclass
class _Armed:
    matches: Callable[[str], bool]
    how: How
    then_down: bool


class PgFaultProxy:
    """See the module docstring. ``upstream_port``: PostgreSQL on 127.0.0.1."""

    def __init__(self, upstream_port: int, *, host: str = "127.0.0.1") -> None:
        self.upstream = (host, upstream_port)
        self.host = host
        self.port = 0
        self.lost = 0  # COMMITs whose answer (or request) this proxy lost
        self.down = False  # while set, a new connection is closed at once (nothing reaches the database)
        self._blackhole = False  # while set, nothing passes either way and nothing is answered (a partition)
        self._flowing: asyncio.Event | None = None  # set while not blackholed (lives on the proxy's loop)
        self._armed: list[_Armed] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._ready = threading.Event()
        self._writers: set[asyncio.StreamWriter] = set()

    def conninfo(self, dbname: str, user: str | None = None) -> str:
        who = f" user={user}" if user else ""
        return f"host={self.host} port={self.port} dbname={dbname}{who} sslmode=disable gssencmode=disable"

    def arm(self, matches: Callable[[str], bool], how: How = "answer", *, then_down: bool = False) -> None:
        """Lose the next ``COMMIT`` of a transaction whose SQL ``matches`` (module docstring);
        ``then_down``: and from then on close every new connection at once (:attr:`down`), as a
        database that went away right after it committed."""
        with self._lock:
            self._armed.append(_Armed(matches, how, then_down))

    @property
    def blackhole(self) -> bool:
        """While set, nothing passes and nothing is answered (module docstring); thread-safe."""
        return self._blackhole

    @blackhole.setter
    def blackhole(self, on: bool) -> None:
        self._blackhole = on
        loop, flowing = self._loop, self._flowing
        if loop is not None and flowing is not None:
            loop.call_soon_threadsafe(flowing.clear if on else flowing.set)

    @property
    def armed(self) -> int:
        with self._lock:
            return len(self._armed)

    def disarm(self) -> None:
        with self._lock:
            self._armed.clear()

    # ------------------------------------------------------------------ life cycle

    def start(self) -> PgFaultProxy:
        self._thread = threading.Thread(target=self._run, name="pg-fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the PostgreSQL fault proxy did not start")
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop = None

    def __enter__(self) -> PgFaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._server = loop.run_until_complete(asyncio.start_server(self._serve, self.host, 0))
        self._flowing = asyncio.Event()
        if not self._blackhole:
            self._flowing.set()
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            self._server.close()
            for w in list(self._writers):
                w.close()
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    # ------------------------------------------------------------------ one client connection

    async def _pass(self) -> None:
        """Return once nothing holds traffic back (:attr:`blackhole`)."""
        if self._flowing is not None:
            await self._flowing.wait()

    def _take(self, sql: str) -> _Armed | None:
        with self._lock:
            for i, armed in enumerate(self._armed):
                if armed.matches(sql):
                    return self._armed.pop(i)
        return None

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self._writers.add(client_w)
        server_w: asyncio.StreamWriter | None = None
        try:
            await self._pass()  # accepted (the kernel did that), never answered while cut off
            if self.down:
                return
            startup = await _untyped(client_r)
            code = struct.unpack("!I", startup[4:8])[0] if len(startup) >= 8 else 0
            while code in (_SSL_REQUEST, _GSS_REQUEST):  # no encryption: the protocol is read in clear
                client_w.write(b"N")
                await client_w.drain()
                startup = await _untyped(client_r)
                code = struct.unpack("!I", startup[4:8])[0]
            await self._pass()
            server_r, server_w = await asyncio.open_connection(*self.upstream)
            self._writers.add(server_w)
            server_w.write(startup)
            await server_w.drain()
            if code == _CANCEL_REQUEST:
                return
            dropping = asyncio.Event()
            pumps = {
                asyncio.ensure_future(self._requests(client_r, server_w, dropping)),
                asyncio.ensure_future(self._answers(server_r, client_w, dropping)),
            }
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in pumps:
                    pump.cancel()
                    with contextlib.suppress(BaseException):
                        await pump
        except (OSError, asyncio.IncompleteReadError, struct.error):
            pass
        finally:
            for w in (client_w, server_w):
                if w is not None:
                    self._writers.discard(w)
                    w.close()

    async def _requests(
        self,
        client_r: asyncio.StreamReader,
        server_w: asyncio.StreamWriter,
        dropping: asyncio.Event,
    ) -> None:
        """Client to server, message by message, noting each transaction's SQL: a query's, a parsed
        statement's, and a prepared statement's each time it is bound (psycopg prepares a statement
        it ran 5 times on a connection and then sends only its name)."""
        sql: list[str] = []
        prepared: dict[bytes, str] = {}  # this connection's named statements
        while True:
            kind, body = await _typed(client_r)
            text = ""
            if kind == b"Q":
                text = body[:-1].decode("utf-8", "replace")
            elif kind == b"P":  # Parse: name\0 query\0 ...
                parts = body.split(b"\0", 2)
                text = parts[1].decode("utf-8", "replace") if len(parts) > 1 else ""
                if parts[0]:
                    prepared[parts[0]] = text
            elif kind == b"B":  # Bind: portal\0 statement\0 ...; the unnamed one was noted at its Parse
                parts = body.split(b"\0", 2)
                text = prepared.get(parts[1], "") if len(parts) > 1 and parts[1] else ""
            head = text.strip().upper()
            if kind == b"Q" and head in ("COMMIT", "END"):
                armed = self._take("\n".join(sql))
                sql.clear()
                if armed is not None:
                    self.lost += 1
                    self.down = self.down or armed.then_down
                    if armed.how == "request":  # never sent: the database rolls the transaction back
                        return
                    dropping.set()  # sent; its answer is swallowed and both connections close
                    server_w.write(_frame(kind, body))
                    await server_w.drain()
                    await asyncio.Future()  # until the answer pump has swallowed the answer

            elif head.startswith(("ROLLBACK", "ABORT")):
                sql.clear()
            elif text:
                sql.append(text)
            await self._pass()
            server_w.write(_frame(kind, body))
            await server_w.drain()
            if kind == b"X":
                return

    async def _answers(
        self, server_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, dropping: asyncio.Event
    ) -> None:
        """Server to client, message by message; while ``dropping``, up to the next ReadyForQuery
        is swallowed and then both connections are closed."""
        while True:
            kind, body = await _typed(server_r)
            if dropping.is_set():
                if kind == b"Z":
                    client_w.close()
                    raise ConnectionResetError("the answer to a COMMIT was lost (fault injected)")
                continue
            await self._pass()
            client_w.write(_frame(kind, body))
            await client_w.drain()


async def _untyped(r: asyncio.StreamReader) -> bytes:
    head = await r.readexactly(4)
    (n,) = struct.unpack("!I", head)
    return head + await r.readexactly(n - 4)


async def _typed(r: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await r.readexactly(5)
    (n,) = struct.unpack("!I", head[1:])
    return head[:1], await r.readexactly(n - 4)


def _frame(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack("!I", len(body) + 4) + body
