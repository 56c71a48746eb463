"""The simulated world: one onceflow server process on a simulated disk, and a network to it.

- :class:`SimClock`: the broker's clocks, read off the simulated loop.
- :class:`ServerNode`: the server process (a :class:`~onceflow.core.broker.Broker` and its ASGI
  :class:`~onceflow.server.app.App`) that can be started, killed (``kill -9``: the page cache
  survives) or taken down by a power loss (it does not), and restarted on the same disk, running
  the real recovery.
- :class:`SimNet` and :class:`SimTransport`: an ``httpx`` transport that carries each request to
  the node and its answer back after a random delay, or loses either (the client then times out,
  not knowing whether the request was carried out), delivers a request twice (the copy arrives
  later: a late duplicate), and resets connections when the node dies. Clients are the real
  onceflow client classes with this transport injected.

Everything random is drawn from the world's seeded ``random.Random``; the loop's clock is the only
clock. So a seed replays exactly.
"""

from __future__ import annotations

import asyncio
import contextvars
import random
import re
from collections import Counter, deque
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx

from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig

from .disk import SimDisk
from .fast import response
from .loop import SimLoop, owner

__all__ = ["NetFaults", "ServerNode", "SimClock", "SimNet", "SimTransport", "Trace"]

DATA = Path("/sim/data")
WALL_ORIGIN = 1_790_000_000.0  # the simulated wall clock at loop time 0 (late 2026)


class SimClock:
    """The broker's :class:`~onceflow.core.clock.Clock` on simulated time."""

    def __init__(self, loop: SimLoop) -> None:
        self._loop = loop

    def time(self) -> float:
        return WALL_ORIGIN + self._loop.time()

    def monotonic(self) -> float:
        return self._loop.time()


class Trace:
    """The last ``size`` events of a run, printed when a seed fails."""

    def __init__(self, loop: SimLoop, size: int = 400) -> None:
        self._loop = loop
        self.events: deque[str] = deque(maxlen=size)
        self.count = 0

    def __call__(self, who: str, what: str) -> None:
        self.count += 1
        self.events.append(f"{self._loop.time() - 1000:10.4f} {who:<10} {what}")


@dataclass(slots=True)
class NetFaults:
    """What the network does to messages; the simulation changes these while it runs."""

    loss: float = 0.0  # a request, or its answer, is lost (the client times out)
    dup: float = 0.0  # a request is delivered a second time, later
    slow: float = 0.02  # a message takes a long time (reorders it behind later ones)
    latency: tuple[float, float] = (0.0002, 0.002)  # seconds, one way
    slow_latency: tuple[float, float] = (0.05, 1.5)


class ServerNode:
    """The simulated onceflow server process (see the module docstring)."""

    def __init__(
        self,
        loop: SimLoop,
        disk: SimDisk,
        clock: SimClock,
        trace: Trace,
        *,
        txn_timeout: float,
        long_poll_timeout: float = 1.0,
    ) -> None:
        self.loop = loop
        self.disk = disk
        self.clock = clock
        self.trace = trace
        self.txn_timeout = txn_timeout
        self.long_poll_timeout = long_poll_timeout
        self.token: object | None = None  # the running process (tasks are tagged with it), None when down
        self.broker: Broker | None = None
        self.app: App | None = None
        self.starts = 0
        self.crashes = 0
        self.failed_starts = 0
        self.in_flight: dict[asyncio.Task[Any], tuple[float, str, str]] = {}  # request handlers: start, what, client
        self._replies: dict[asyncio.Future[httpx.Response], None] = {}  # ordered: replays must not depend on addresses

    @property
    def up(self) -> bool:
        return self.token is not None and self.app is not None

    async def start(self) -> bool:
        """Start the process on the disk: recovery, then serving. False if it could not start
        (an I/O error during recovery); the process is then down again."""
        token = object()
        self.token = token
        self.starts += 1
        ctx = contextvars.copy_context()
        ctx.run(owner.set, token)
        task = self.loop.create_task(self._boot(token), context=ctx)
        try:
            await task
        except OSError as exc:
            self.failed_starts += 1
            self.trace("server", f"start failed: {exc}")
            self.crash(power=False, why="failed start")
            return False
        self.trace("server", f"up (start {self.starts})")
        return True

    async def _boot(self, token: object) -> None:
        broker = Broker(
            DATA,
            fs=self.disk.mount(),
            clock=self.clock,
            txn_timeout=self.txn_timeout,
            reorder_wait=0.5,
        )
        broker.open()
        app = App(broker, AppConfig(long_poll_timeout=self.long_poll_timeout, max_body_bytes=1 << 20))
        await broker.start()
        if self.token is token:
            self.broker, self.app = broker, app

    def crash(self, *, power: bool, why: str = "") -> None:
        """``kill -9`` (or a power loss, ``power``): every task of the process stops; connections reset."""
        if self.token is None:
            return
        self.crashes += 1
        token, self.token = self.token, None
        self.broker, self.app = None, None
        if power:
            self.disk.power_loss()
        else:
            self.disk.crash()
        self.trace("server", f"{'POWER LOSS' if power else 'kill -9'} {why}".strip())
        self._end_process(token)

    def _end_process(self, token: object) -> None:
        """The process ``token`` is gone: its tasks are cancelled, its connections reset."""
        for t in self.loop.tasks_of(token):
            t.cancel()
        self.in_flight.clear()
        for fut in list(self._replies):
            if not fut.done():
                fut.set_exception(httpx.ReadError("connection reset by peer (the server died)"))
                fut.exception()  # a client that gave up no longer awaits it: not worth a log line
        self._replies.clear()

    # ------------------------------------------------------------------ requests

    def deliver(self, request: _Wire, reply: Callable[[httpx.Response], None], gone: asyncio.Future[None]) -> None:
        """A request arrives (dropped if the process is down: the client times out)."""
        if not self.up:
            return
        ctx = contextvars.copy_context()
        ctx.run(owner.set, self.token)
        task = self.loop.create_task(self._serve(request, reply, gone), context=ctx)
        self.in_flight[task] = (self.loop.time(), f"{request.method} {request.target}", request.client)
        task.add_done_callback(lambda t: self.in_flight.pop(t, None))

    async def _serve(self, req: _Wire, reply: Callable[[httpx.Response], None], gone: asyncio.Future[None]) -> None:
        app = self.app
        assert app is not None
        path, _, query = req.target.partition("?")
        scope: MutableMapping[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": req.method,
            "scheme": "http",
            "path": unquote(path),
            "raw_path": path.encode(),
            "query_string": query.encode(),
            "root_path": "",
            "headers": req.headers,
            "client": (req.client, 1),
            "server": ("sim", 4437),
        }
        sent_body = False

        async def receive() -> MutableMapping[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": req.body, "more_body": False}
            await asyncio.shield(gone)
            return {"type": "http.disconnect"}

        status = 500
        headers: list[tuple[bytes, bytes]] = []
        chunks: list[bytes] = []

        async def send(msg: MutableMapping[str, Any]) -> None:
            nonlocal status, headers
            if msg["type"] == "http.response.start":
                status, headers = msg["status"], list(msg.get("headers", []))
            elif msg["type"] == "http.response.body":
                chunks.append(msg.get("body", b""))

        await app(scope, receive, send)
        reply(response(status, headers, b"".join(chunks)))

    def watch_reply(self, fut: asyncio.Future[httpx.Response]) -> None:
        self._replies[fut] = None
        fut.add_done_callback(lambda f: self._replies.pop(f, None))


@dataclass(slots=True)
class _Wire:
    method: str
    target: str  # raw path and query
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: str


@dataclass
class SimNet:
    loop: SimLoop
    rng: random.Random
    node: ServerNode  # the server of a URL's host not in ``nodes`` (the one of a single-server world)
    trace: Trace
    faults: NetFaults = field(default_factory=NetFaults)
    detail: re.Pattern[str] | None = None  # requests whose bodies and answers go into the trace (debugging)
    stats: dict[str, int] = field(
        default_factory=lambda: {"requests": 0, "lost": 0, "dups": 0, "refused": 0, "timeouts": 0}
    )
    # requests on their way to the node, by client: a late copy can still be in the network long
    # after its client gave up on it
    on_the_way: Counter[str] = field(default_factory=Counter)
    nodes: dict[str, ServerNode] = field(default_factory=dict)  # by host: the servers of a cluster
    # a request on its way to a process that dies is never delivered to the next one (its connection
    # died with the first); the single-server world delivers it (harsher than TCP, kept for its seeds)
    bind: bool = False

    def node_at(self, host: str) -> ServerNode:
        return self.nodes.get(host, self.node)

    def carry(
        self,
        delay: float,
        wire: _Wire,
        reply: Callable[[httpx.Response], None],
        gone: asyncio.Future[None],
        node: ServerNode | None = None,
        *,
        again: bool = False,
    ) -> None:
        """Deliver ``wire`` to ``node`` (by default the world's one) after ``delay``; ``again``: a
        copy sent anew (a retrying proxy: a connection of its own)."""
        self.on_the_way[wire.client] += 1
        to = node or self.node
        process = to.token

        def arrive() -> None:
            self.on_the_way[wire.client] -= 1
            if self.bind and not again and to.token is not process:
                return  # reset: its connection was to a process that died meanwhile
            to.deliver(wire, reply, gone)

        self.loop.call_later(delay, arrive)

    def busy(self, but: set[str]) -> bool:
        """Whether a request of a client not in ``but`` is on its way or being served."""
        return any(n for c, n in self.on_the_way.items() if c not in but) or any(
            c not in but
            for node in {id(n): n for n in (self.node, *self.nodes.values())}.values()
            for _, _, c in node.in_flight.values()
        )

    def one_way(self) -> float:
        f = self.faults
        if self.rng.random() < f.slow:
            return self.rng.uniform(*f.slow_latency)
        return self.rng.uniform(*f.latency)


class SimTransport(httpx.AsyncBaseTransport):
    """An ``httpx`` transport over :class:`SimNet` to the node (see the module docstring)."""

    def __init__(self, net: SimNet, client: str, *, once: bool = False) -> None:
        self.net = net
        self.client = client
        self.once = once  # never delivered twice: a plain append is no retry the client chose

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        net, loop, rng = self.net, self.net.loop, self.net.rng
        body = await request.aread()
        timeouts = request.extensions.get("timeout", {})
        timeout = timeouts.get("read") or 30.0
        target = request.url.raw_path.decode("ascii")
        what = (
            f"{request.method} {target[:90]}" if not net.nodes else f"{request.method} {request.url.host}{target[:80]}"
        )
        net.stats["requests"] += 1
        node = net.node_at(request.url.host)
        if not node.up:
            await asyncio.sleep(net.one_way())
            net.stats["refused"] += 1
            raise httpx.ConnectError("connection refused (the server is down)", request=request)
        wire = _Wire(request.method, target, [(k.lower(), v) for k, v in request.headers.raw], body, self.client)
        answer: asyncio.Future[httpx.Response] = loop.create_future()
        node.watch_reply(answer)
        gone: asyncio.Future[None] = loop.create_future()
        faults = net.faults

        def reply(resp: httpx.Response) -> None:
            if answer.done():
                return  # a duplicate's answer, or the client gave up
            if rng.random() < faults.loss:
                net.stats["lost"] += 1
                net.trace(self.client, f"answer lost: {what} -> {resp.status_code}")
                return

            def arrive() -> None:
                if not answer.done():
                    answer.set_result(resp)

            loop.call_later(net.one_way(), arrive)

        copies = 1
        if rng.random() < faults.dup and not self.once:
            copies = 2
            net.stats["dups"] += 1
        for n in range(copies):
            if n == 0 and rng.random() < faults.loss:
                net.stats["lost"] += 1
                net.trace(self.client, f"request lost: {what}")
                continue
            delay = net.one_way() + (rng.uniform(0.05, 3.0) if n else 0.0)
            net.carry(delay, wire, reply, gone, node, again=n > 0)
        try:
            # asyncio.wait, not wait_for: on Python 3.11 wait_for can lose a cancellation that
            # arrives as the answer does, which a real transport would not
            await asyncio.wait({answer}, timeout=timeout)
            if not answer.done():
                net.stats["timeouts"] += 1
                raise httpx.ReadTimeout(f"no answer in {timeout:g} s", request=request)
            resp = answer.result()
        finally:
            if not gone.done():
                gone.set_result(None)
        if net.detail is not None and net.detail.search(target):
            net.trace(
                self.client,
                f"{what} {body[:300]!r} -> {resp.status_code} {resp.content[:300]!r} "
                f"{[(k, v) for k, v in resp.headers.items() if k.startswith(('transaction', 'producer'))]}",
            )
        else:
            net.trace(self.client, f"{what} -> {resp.status_code}")
        resp.request = request
        return resp
