"""The simulated cluster: several onceflow servers on one simulated PostgreSQL (:mod:`.pg`), the
multi-server tier of docs/ha.md, with the faults that tier is for.

- :class:`NodeClock`: a server's clocks. Its monotonic clock runs at a rate of its own (drift, within
  the 20 % the lease assumes: :class:`~onceflow.server.leader.Lease`); its wall clock steps.
- :class:`ClusterNode`: a server process as ``onceflow serve --store`` runs it
  (``server/leader.py``): it takes the store's lease or follows (answering 503 ``not_leader``
  naming the leader), and as the leader recovers the streams from the database, serves behind
  :class:`~onceflow.server.leader.Leading` and renews the lease (:class:`~onceflow.server.leader.
  Renewals`, the server's own schedule) until it loses it; then it exits and its supervisor starts
  it again. The real PostgreSQL store (``storage/pgfs.py``) runs on the simulated database, its
  lost COMMIT answers, read-backs and fencing included.
- :class:`ClusterWorld`: the world of one seed: the servers, the database, clients given every
  server (the real failover transport of ``client/_failover.py``), and the faults: ``kill -9`` of a
  server (the leader most often), a server cut from the database, a database failover (synchronous
  standby: nothing committed is lost), failing and lost COMMIT answers, steps of the database's
  wall clock and of the servers', and drift of the servers' clocks. The workload and the checks are
  the single-server simulation's (:mod:`.run`), plus the checks of :mod:`.cluster_actors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from onceflow.client._failover import AsyncFailoverTransport, Servers
from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig
from onceflow.server.leader import ROOT, Leading, Lease, NotLeader, Renewals, take_lease
from onceflow.storage.pgfs import PgFileSystem

from . import actors
from .cluster_actors import CLUSTER_ACTORS, ClusterChecks
from .loop import SimLoop, owner
from .mutations import mutated
from .pg import PgFaults, SimPostgres
from .run import SeedResult, SimClient, Workload, World
from .world import WALL_ORIGIN, ServerNode, SimNet, SimTransport, Trace

__all__ = ["ClusterNode", "ClusterWorkload", "ClusterWorld", "NodeClock"]

HOSTS = ("onceflow.sim", "n1.sim", "n2.sim")  # the first is the single-server world's: the actors' URL


class NodeClock:
    """A server's clocks (module docstring): ``monotonic`` at :attr:`rate` of the simulation's time,
    ``time`` (the wall clock) the simulation's plus :attr:`wall_offset`."""

    def __init__(self, loop: SimLoop) -> None:
        self.loop = loop
        self.rate = 1.0
        self.wall_offset = 0.0
        self._at = loop.time()
        self._mono = loop.time()

    def monotonic(self) -> float:
        return self._mono + (self.loop.time() - self._at) * self.rate

    def time(self) -> float:
        return WALL_ORIGIN + self.loop.time() + self.wall_offset

    def set_rate(self, rate: float) -> None:
        self._mono, self._at, self.rate = self.monotonic(), self.loop.time(), rate

    def real(self, seconds: float) -> float:
        """Simulated seconds in which this clock counts ``seconds``."""
        return seconds / self.rate


async def _starting(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("a request reached a server before it listened")


class ClusterNode(ServerNode):
    """A server process of the cluster (module docstring)."""

    def __init__(self, world: ClusterWorld, index: int) -> None:
        # not ServerNode's: no disk of its own (its files are in the database)
        self.world = world
        self.loop = world.loop
        self.trace = world.trace
        self.db = world.db
        self.name = f"s{index}"
        self.url = f"http://{HOSTS[index]}"
        self.clocks = NodeClock(world.loop)
        self.clock = self.clocks  # type: ignore[assignment] # the broker's Clock
        self.term = world.workload.term
        self.txn_timeout = world.txn_timeout
        self.long_poll_timeout = 1.0
        self.token: object | None = None
        self.broker: Broker | None = None
        self.app = None
        self.starts = self.crashes = self.failed_starts = 0
        self.in_flight = {}
        self._replies = {}
        self.target: Callable[..., Any] = _starting
        self.lease: Lease | None = None
        self.leaderships = 0
        self.step_downs = 0
        self.held_until = 0.0  # a fault keeps the process down until then

    @property
    def leads(self) -> bool:
        return self.up and self.lease is not None and self.lease.valid() and isinstance(self.target, Leading)

    async def start(self) -> bool:
        """Start the process (it runs until it exits or is killed)."""
        token = object()
        self.token = token
        self.starts += 1
        ctx = contextvars.copy_context()
        ctx.run(owner.set, token)
        self.loop.create_task(self._process(token), context=ctx)
        return True

    async def _dispatch(self, scope: Any, receive: Any, send: Any) -> None:
        await self.target(scope, receive, send)

    async def _process(self, token: object) -> None:
        try:
            why = await self._serve_store(token)
        except OSError as exc:
            why = f"could not start: {exc}"
        except Exception as exc:  # noqa: BLE001 - psycopg_pool's PoolTimeout at start, as a real process dies of it
            why = f"died: {exc!r}"
        if self.token is token:
            self.step_downs += 1
            self.crash(power=False, why=f"exits: {why}")

    async def _serve_store(self, token: object) -> str:
        """``serve_store`` of server/leader.py, on simulated time; why the process exits."""
        db, term = self.db, self.term
        fs = PgFileSystem(
            "sim",
            pool_size=4,
            connect_timeout=2.0,
            idle_timeout=term / 2,
            connector=db.connector(self.name, alive=lambda: self.token is token),
            clock=self.clocks.monotonic,
            sleep=self.loop.advance,  # a blocking wait inside a call: the world waits with it
        )
        follower = NotLeader(fs, term, me=self.url, forward=False, max_body=1 << 20, long_poll_timeout=1.0)
        self.target = follower
        self.app = self._dispatch  # type: ignore[assignment] # listening

        async def call(fn: Callable[..., Any], *args: Any) -> Any:
            return fn(*args)  # a call into the simulated database: at once, on the loop

        async def pause(seconds: float) -> bool:
            await asyncio.sleep(self.clocks.real(seconds))
            return False  # a process waits for the lease until it is killed

        taken = await take_lease(
            fs,
            f"{self.name}/{self.starts}",
            self.url,
            term,
            clock=self.clocks.monotonic,
            call=call,
            pause=pause,
            unreachable=lambda exc: self.trace(self.name, f"could not reach the store: {exc}"),
        )
        assert taken is not None
        lease_token, began = taken
        fs.token = lease_token
        lease = Lease(lease_token, term, began, clock=self.clocks.monotonic)
        self.lease = lease
        fs.alive = lease.valid
        wake = asyncio.Event()
        renewals = Renewals(fs, lease, wake.set)
        fs.on_unsure = lambda why: wake.set()
        holding = asyncio.ensure_future(self._hold(renewals, wake, token))
        self.leaderships += 1
        self.trace(self.name, f"takes the lease (token {lease_token})")
        broker = Broker(ROOT, fs=fs, clock=self.clocks, txn_timeout=self.txn_timeout, reorder_wait=0.5)
        try:
            broker.open()
        except OSError as exc:
            wake.set()
            with contextlib.suppress(OSError):
                fs.release(lease_token)
            return f"could not recover the store's streams ({exc})"
        # Unlike serve_store, which reads the subscriptions before it leads and steps down if it
        # cannot, this server leaves them to the app's own start: scheduled when the app is made,
        # then tried again at each stream change and subscription request until the store reads
        # them (the path of an app served without a lifespan start; seed 116471 found a 500 on it).
        app = App(broker, AppConfig(long_poll_timeout=self.long_poll_timeout, max_body_bytes=1 << 20))
        await broker.start()
        self.broker = broker
        self.target = Leading(app, follower, lease)
        self.trace(self.name, f"leads ({len(broker.streams)} streams)")
        why = await holding
        lease.lose()
        return why

    async def _hold(self, renewals: Renewals, wake: asyncio.Event, token: object) -> str:
        """``_hold`` of server/leader.py on the loop: each attempt a moment later, apart."""
        while True:
            woken = False
            with contextlib.suppress(TimeoutError):
                # at least a microsecond: a wait shorter than the loop's resolution lets no time pass
                await asyncio.wait_for(wake.wait(), self.clocks.real(max(1e-6, renewals.wait())))
                woken = True
            why = renewals.verdict(woken)
            if why is not None:
                return why or "stopped"
            attempt = renewals.due()
            if attempt is not None:
                self.loop.call_later(self.world.db_latency(), self._if_alive, token, attempt)

    def _if_alive(self, token: object, fn: Callable[[], None]) -> None:
        if self.token is token:  # a dead process's renewal thread is gone with it
            fn()

    def crash(self, *, power: bool = False, why: str = "") -> None:
        """The process dies (``kill -9``, or it exits): its tasks stop, its connections close."""
        if self.token is None:
            return
        self.crashes += 1
        token, self.token = self.token, None
        self.app, self.broker, self.lease, self.target = None, None, None, _starting
        self.db.process_died(self.name)
        self.trace(self.name, why or "kill -9")
        self.loop.thaw(token)  # SIGKILL ends a stopped process too: its tasks see their cancellation
        self._end_process(token)


@dataclass
class ClusterWorkload(Workload):
    """A seed's cluster: how many servers, their lease's term, which faults."""

    nodes: int = 2
    term: float = 2.0
    partitions: bool = False
    db_failovers: bool = False
    commit_faults: bool = False
    clock_faults: bool = False
    pauses: bool = False

    @classmethod
    def draw(cls, rng: random.Random) -> ClusterWorkload:
        w = super().draw(rng)
        assert isinstance(w, ClusterWorkload)
        w.nodes = rng.choice([2, 2, 3])
        w.term = rng.choice([1.0, 2.0, 3.0])
        w.partitions = rng.random() < 0.5
        w.db_failovers = rng.random() < 0.4
        w.commit_faults = rng.random() < 0.6
        w.clock_faults = rng.random() < 0.5
        w.pauses = rng.random() < 0.4
        # a0 and l0 keep to the server that last answered them, a1 and l1 start each request at a
        # random one (behind a load balancer): reads and writes of one stream through different servers
        w.actors += [
            ("a0", "plain", ("plain/0",)),
            ("a1", "plain", ("plain/0",)),
            ("l0", "linear", (["plain/0"],)),
            ("l1", "linear", (["plain/0"],)),
            ("d0", "deleter", ()),
        ]
        return w


class _Watched(SimTransport):
    """The network, and a 500 answer is an anomaly: a store that fails answers 503, never 500."""

    def __init__(self, net: SimNet, client: str, world: ClusterWorld, *, once: bool) -> None:
        super().__init__(net, client, once=once)
        self.world = world

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        resp = await super().handle_async_request(request)
        if resp.status_code == 500:
            self.world.anomaly(
                "server-error",
                None,
                f"{request.method} {request.url.raw_path.decode()[:100]}: 500 {resp.content[:300]!r}",
            )
        return resp


class _Balanced(AsyncFailoverTransport):
    """A client behind a load balancer: each request starts at a server drawn at random (then
    fails over as any client does)."""

    def __init__(self, servers: Servers, inner: httpx.AsyncBaseTransport, rng: random.Random) -> None:
        super().__init__(servers, inner)
        self._rng = rng

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self._route.current = self._rng.randrange(len(self._route.servers.hosts))
        return await super().handle_async_request(request)


class ClusterWorld(World):
    """One seed's cluster (module docstring)."""

    ACTORS = {**actors.ACTORS, **CLUSTER_ACTORS}

    def __init__(
        self,
        seed: int,
        workload: ClusterWorkload | None = None,
        *,
        detail: str | None = None,
        mutations: tuple[str, ...] = (),
    ) -> None:
        # not World's: servers on a database instead of one on a disk
        self.mutations = mutations  # holes put back on purpose (sim/mutations.py)
        self.seed = seed
        self.rng = random.Random(seed)
        self.workload: ClusterWorkload = workload or ClusterWorkload.draw(self.rng)
        self.txn_timeout = self.workload.txn_timeout
        self.loop = SimLoop(executor_delay=self._io_delay, pausable=True)
        self.trace = Trace(self.loop)
        self._db_rng = random.Random(self.rng.getrandbits(64))
        self.db = SimPostgres(self.loop.time, self._db_rng, self.trace, WALL_ORIGIN)
        self.nodes = [ClusterNode(self, i) for i in range(self.workload.nodes)]
        self.net = SimNet(self.loop, random.Random(self.rng.getrandbits(64)), self.nodes[0], self.trace)
        self.net.nodes = {HOSTS[i]: n for i, n in enumerate(self.nodes)}
        self.net.bind = True
        self.servers = Servers("http", HOSTS[: len(self.nodes)])
        if detail:
            self.net.detail = re.compile(detail)
        self.ops: list[dict[str, Any]] = []
        self._stop = False
        self._stop_late = False
        self._clients: dict[str, httpx.AsyncClient] = {}
        self.extra = []
        self._faulty = False
        self.checks = ClusterChecks()
        self._once = {n for n, kind, _ in self.workload.actors if kind in ("plain", "deleter")}
        self._balanced = {n for n, kind, _ in self.workload.actors if kind in ("plain", "linear") and n.endswith("1")}

    def now(self) -> float:
        return self.loop.time()

    def run(self) -> SeedResult:
        with mutated(self.mutations):
            return super().run()

    def client(self, name: str) -> httpx.AsyncClient:
        c = self._clients.get(name)
        if c is None:
            # each client starts at a server of its own, as clients given the list in another order
            first = sum(name.encode()) % len(self.servers.hosts)
            servers = Servers("http", self.servers.hosts[first:] + self.servers.hosts[:first])
            inner = _Watched(self.net, name, self, once=name in self._once)
            balanced = name in self._balanced
            c = self._clients[name] = SimClient(
                transport=_Balanced(servers, inner, self.rng) if balanced else AsyncFailoverTransport(servers, inner),
                base_url=actors.URL,
                timeout=httpx.Timeout(2.0),
            )
        return c

    def crashes(self) -> int:
        return sum(n.crashes for n in self.nodes)

    def db_latency(self) -> float:
        r = self._db_rng
        return r.uniform(0.0005, 0.005) if r.random() > 0.05 else r.uniform(0.05, 0.5)

    def _io_delay(self, fn: Callable[..., Any]) -> float:
        return self.db_latency()

    def _stats(self) -> dict[str, Any]:
        return {
            "net": dict(self.net.stats),
            "db": dict(self.db.stats),
            "server_starts": sum(n.starts for n in self.nodes),
            "crashes": self.crashes(),
            "leaderships": sum(n.leaderships for n in self.nodes),
        }

    def _in_flight(self) -> list[tuple[float, str]]:
        return [(t0, what) for n in self.nodes for t0, what, _ in n.in_flight.values()]

    async def _bring_up(self) -> None:
        """Every server up, and one of them leading."""
        for n in self.nodes:
            n.held_until = 0.0
            if not n.up:
                await n.start()
        if not self._faulty:
            self._faulty = True
            self.loop.create_task(self._supervise())
        await self._serving()

    async def _serving(self) -> None:
        """Return once a server leads, or after 30 s (the supervisor starts a server that exited
        again; the lease is free a term after its holder's last renewal)."""
        deadline = self.loop.time() + 30.0
        while self._leader() is None and self.loop.time() < deadline:  # noqa: ASYNC110 - polls simulated time
            await asyncio.sleep(0.1)

    async def _final(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """Sent once a server leads, and again while it finds none (the leader exited, or its lease
        lapsed, at that moment: every server answers 503 ``not_leader``, or none takes it), for up to
        30 s; then the last answer, or its error. Quiet as the world is then, a leader can still step
        down (seed 126311: two slow renewals in a row, before the fix of ``Renewals``), and the final
        reads must not take that moment for the end of the seed."""
        c = self.client("sim")
        deadline = self.loop.time() + 30.0
        while True:
            await self._serving()
            try:
                r = await c.request(method, url, **kwargs)
            except httpx.TransportError:
                if self.loop.time() >= deadline:
                    raise
            else:
                if r.status_code != 503 or self.loop.time() >= deadline:
                    return r
            await asyncio.sleep(0.1)

    async def _supervise(self) -> None:
        """The servers' supervisor (systemd, Kubernetes): a process that exited is started again."""
        while True:
            await asyncio.sleep(0.3)
            for n in self.nodes:
                if not n.up and self.loop.time() >= n.held_until:
                    await n.start()

    def _calm(self) -> None:
        for n in self.nodes:
            if n.token is not None:
                self._resume(n, n.token)
        self.db.faults = PgFaults()
        self.db.cut.clear()
        if self.db.down:
            self.db.promoted()

    def _leader(self) -> ClusterNode | None:
        return next((n for n in self.nodes if n.leads), None)

    async def _faults(self, until: float) -> None:
        w, rng, db = self.workload, self.rng, self.db
        self.trace(
            "sim",
            f"cluster: {w.nodes} servers, term {w.term}s, partitions {w.partitions}, failovers {w.db_failovers}, "
            f"commit faults {w.commit_faults}, clock faults {w.clock_faults}, pauses {w.pauses}",
        )
        while self.loop.time() < until:
            await asyncio.sleep(rng.uniform(0.2, 1.0))
            victim = self._leader() if rng.random() < 0.7 else None
            victim = victim or rng.choice(self.nodes)
            roll = rng.random()
            if w.kills and roll < w.kills:
                if victim.up:
                    victim.crash(why="kill -9 (fault)")
                    victim.held_until = self.loop.time() + rng.uniform(0.0, 2.0)
            elif w.partitions and roll < 0.3:
                if victim.name not in db.cut:
                    db.cut.add(victim.name)
                    self.trace("sim", f"{victim.name} cut from the database")
                    self.loop.call_later(rng.uniform(0.2, 2.5 * w.term), self._heal, victim.name)
            elif w.db_failovers and roll < 0.4:
                if not db.down:
                    db.fail_over()
                    self.loop.call_later(rng.uniform(0.05, 1.5 * w.term), db.promoted)
            elif w.pauses and roll < 0.5:
                if victim.up and not self.loop.frozen(victim.token):
                    self.loop.freeze(victim.token)
                    self.trace("sim", f"{victim.name} stopped (SIGSTOP)")
                    self.loop.call_later(rng.uniform(0.1, 3.0 * w.term), self._resume, victim, victim.token)
            if w.commit_faults and rng.random() < 0.3:
                db.faults = PgFaults(
                    commit_fails=rng.choice([0.0, 0.0, 0.05, 0.3]),
                    commit_lost=rng.choice([0.0, 0.05, 0.2, 0.5]),
                    statement_fails=rng.choice([0.0, 0.0, 0.02, 0.1]),
                )
                self.trace("sim", f"database faults: {db.faults}")
            if w.clock_faults and rng.random() < 0.4:
                kind = rng.random()
                if kind < 0.5:
                    db.clock_offset += rng.choice([-1, 1]) * rng.uniform(0.5, 15.0)
                    self.trace("sim", f"the database's clock steps to {db.clock_offset:+.1f} s")
                elif kind < 0.7:
                    victim.clocks.wall_offset += rng.choice([-1, 1]) * rng.uniform(0.5, 15.0)
                    self.trace("sim", f"{victim.name}'s wall clock steps to {victim.clocks.wall_offset:+.1f} s")
                else:
                    rate = rng.uniform(0.95, 1.05)
                    victim.clocks.set_rate(rate)
                    self.trace("sim", f"{victim.name}'s clock runs at {rate:.3f}")
            self._network_faults()

    async def _read_back(self) -> None:
        await super()._read_back()
        final: dict[str, list[Any]] = {}
        for o in self.ops:
            if o["op"] == "read" and o.get("final"):
                final[o["stream"]] = [v for _, v in o["records"]]
        self.extra.extend(self.checks.check(final))

    def _resume(self, node: ClusterNode, token: object) -> None:
        if self.loop.frozen(token):
            self.loop.thaw(token)
            self.trace("sim", f"{node.name} resumed (SIGCONT)")

    def _heal(self, name: str) -> None:
        if name in self.db.cut:
            self.db.cut.discard(name)
            self.trace("sim", f"{name} reaches the database again")


def run_cluster_seed(seed: int, workload: ClusterWorkload | None = None, mutations: tuple[str, ...] = ()) -> SeedResult:
    """Run one seed of the cluster (see the module docstring)."""
    return ClusterWorld(seed, workload, mutations=mutations).run()
