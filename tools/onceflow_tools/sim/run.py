"""Running one seed: the world, the workload, the faults, the final read-back and the verdict.

A seed decides everything: which clients run (:mod:`onceflow_tools.sim.actors`), how hostile the disk and
the network are, when the server is killed or loses power. The run has three phases, all in
simulated time:

1. **Work** (``duration`` seconds): the clients run while faults are injected: ``kill -9`` of the
   server (restarted after a pause), power loss, windows of failing writes (``ENOSPC``) and syncs
   (``EIO``), windows of lost, duplicated and slow messages.
2. **Quiet**: faults stop, the server is brought up, the clients are told to stop and given time
   to finish; every transactional id is initialised once more (which aborts what it left open), and
   the run waits past the transaction timeout.
3. **Read-back and checks**: every stream is read back read_committed (``final`` reads) and the
   history is checked by :func:`onceflow_tools.chaos.history.check`; on top of that the simulation checks
   liveness: a client that never finished, a request the server never answered, a stream whose last
   stable offset stays short of its tail (``stuck``, ``lso-stuck``), and a simulation that stalled
   with nothing runnable (a deadlock).

A run that raises (the harness's own failure, or one it did not foresee) is the seed's anomaly
``harness-error``, with its traceback and the trace so far: the seed fails, the run of many seeds
goes on.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import hashlib
import http.cookiejar
import logging
import random
import re
import traceback
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..chaos.history import Anomaly, CheckResult, check
from ..chaos.worker import parse_records
from . import actors
from .disk import SimDisk
from .fast import fast_httpx
from .loop import SimLoop, Stalled, owner
from .world import DATA, NetFaults, ServerNode, SimClock, SimNet, SimTransport, Trace

__all__ = ["SeedResult", "Workload", "run_seed"]

URL = actors.URL


@dataclass(slots=True)
class Workload:
    """What a seed runs (drawn from the seed by :meth:`draw`)."""

    duration: float = 12.0
    txn_timeout: float = 3.0
    actors: list[tuple[str, str, tuple[Any, ...]]] = field(default_factory=list)  # (name, kind, args)
    kills: float = 0.0  # server kills per simulated second
    power: float = 0.0  # of those, the share that are power losses
    disk_faults: bool = False
    net_faults: bool = False

    @classmethod
    def draw(cls, rng: random.Random) -> Workload:
        w = cls()
        w.duration = rng.choice([3.0, 4.0, 6.0, 8.0, 12.0, 16.0])  # most short, some long
        w.txn_timeout = rng.choice([1.5, 3.0, 6.0])
        w.kills = rng.choice([0.0, 0.05, 0.15, 0.3])
        w.power = rng.choice([0.0, 0.3, 1.0])
        w.disk_faults = rng.random() < 0.5
        w.net_faults = rng.random() < 0.6
        kinds = ["idempotent", "txn", "copier", "reader", "group", "forker", "spark_stream", "spark_batch"]
        chosen = [k for k in kinds if rng.random() < 0.55] or [rng.choice(kinds)]
        if "copier" in chosen and "idempotent" not in chosen:
            chosen.append("idempotent")
        if "forker" in chosen and "txn" not in chosen:
            chosen.append("txn")
        if "group" in chosen and "idempotent" not in chosen:
            chosen.append("idempotent")
        streams = ["in/0", "in/1"]
        tx = ["tx/0", "tx/1"]
        for kind in chosen:
            if kind == "idempotent":
                for i in range(rng.randint(1, 2)):
                    w.actors.append((f"p{i}", kind, (streams[i],)))
            elif kind == "txn":
                for i in range(rng.randint(1, 2)):
                    w.actors.append((f"t{i}", kind, (tx[: rng.randint(1, 2)],)))
            elif kind == "copier":
                w.actors.append(("copier", kind, (streams[:1], ["out/0", "out/1"], "copy")))
            elif kind == "reader":
                w.actors.append(("r0", kind, (streams + tx,)))
            elif kind == "group":
                w.actors.append(("g0", kind, (streams, "members")))
            elif kind == "forker":
                w.actors.append(("f0", kind, ("tx/0",)))
            elif kind == "spark_stream":
                w.actors.append(("spark", kind, ("sinkA", "spark/out")))
            elif kind == "spark_batch":
                w.actors.append(("job", kind, ("spark/batch-out",)))
        return w


@dataclass(slots=True)
class SeedResult:
    seed: int
    check: CheckResult
    trace: list[str]
    fingerprint: str  # a digest of the whole trace: the same seed must give the same one
    sim_seconds: float
    requests: int
    stats: dict[str, Any]
    workload: Workload

    @property
    def ok(self) -> bool:
        return self.check.ok


class _NoCookies(http.cookiejar.CookieJar):
    """onceflow sets no cookies: skip the cookie jar's work on every response (a third of the
    client's time in a simulation)."""

    def extract_cookies(self, response: Any, request: Any) -> None:
        pass


class _Cookies(httpx.Cookies):
    """No cookies, and no urllib request and response built for the jar on every response
    (``httpx.Cookies.extract_cookies`` builds both before the jar can say it wants nothing)."""

    def extract_cookies(self, response: httpx.Response) -> None:
        pass


class SimClient(httpx.AsyncClient):
    """An ``httpx.AsyncClient`` whose cookies are :class:`_Cookies` (always none: onceflow sets none)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cookies=_NoCookies(), **kwargs)
        self._no_cookies = _Cookies(_NoCookies())

    @property  # type: ignore[misc]
    def cookies(self) -> httpx.Cookies:
        return self._no_cookies


class World:
    """One seed's world (see the module docstring); :meth:`run` returns its result."""

    ACTORS = actors.ACTORS  # the clients a workload names, by kind

    def __init__(self, seed: int, workload: Workload | None = None, *, detail: str | None = None) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.workload = workload or Workload.draw(self.rng)
        self.txn_timeout = self.workload.txn_timeout
        self.loop = SimLoop(executor_delay=self._io_delay)
        self.trace = Trace(self.loop)
        self.disk = SimDisk(random.Random(self.rng.getrandbits(64)))
        fs = self.disk.mount()  # the data directory exists before the server first starts, as on a real machine
        fs.mkdir(DATA)
        for d in (*reversed(DATA.parents), DATA):
            fs.sync_dir(d)
        self.clock = SimClock(self.loop)
        self.node = ServerNode(self.loop, self.disk, self.clock, self.trace, txn_timeout=self.txn_timeout)
        self.net = SimNet(self.loop, random.Random(self.rng.getrandbits(64)), self.node, self.trace)
        if detail:
            self.net.detail = re.compile(detail)
        self.ops: list[dict[str, Any]] = []
        self._stop = False
        self._stop_late = False  # copiers stop once everything they copy is written
        self._clients: dict[str, httpx.AsyncClient] = {}
        self.extra: list[Anomaly] = []

    # ------------------------------------------------------------------ what actors see (actors.Env)

    def client(self, name: str) -> httpx.AsyncClient:
        c = self._clients.get(name)
        if c is None:
            c = self._clients[name] = SimClient(
                transport=SimTransport(self.net, name), base_url=URL, timeout=httpx.Timeout(2.0)
            )
        return c

    def record(self, client: str, op: str, **fields: Any) -> None:
        self.ops.append({"client": client, "op": op, "t": self.loop.time(), **fields})

    def anomaly(self, kind: str, stream: str | None, detail: str) -> None:
        self.trace("sim", f"ANOMALY {kind}: {detail[:200]}")
        self.extra.append(Anomaly(kind, stream, detail))  # type: ignore[arg-type]

    def crashes(self) -> int:
        return self.node.crashes

    def stopping(self, late: bool = False) -> bool:
        return self._stop_late if late else self._stop

    def _io_delay(self, fn: Callable[..., Any]) -> float:
        r = self.disk.rng
        return r.uniform(0.0001, 0.004) if r.random() > 0.02 else r.uniform(0.02, 0.3)

    # ------------------------------------------------------------------ running

    def run(self) -> SeedResult:
        random.seed(self.seed)  # the clients' backoff jitter and the server's cursors
        uuid4 = uuid.uuid4
        ids = random.Random(self.seed ^ 0x5EED)
        uuid.uuid4 = lambda: uuid.UUID(int=ids.getrandbits(128), version=4)
        quiet = [logging.getLogger(n) for n in ("onceflow", "asyncio", "httpx")]
        levels = [(lg.level, lg.propagate) for lg in quiet]
        caught = _Tracebacks(self)
        for lg in quiet:
            # silent, but an error logged with its traceback (an exception nothing expected: the
            # app's "unhandled error", a task's exception nobody retrieved) is an anomaly, which
            # a 500 alone would not show when its answer never reached a client
            lg.setLevel(logging.ERROR)
            lg.propagate = False
            lg.addHandler(caught)
        # Garbage of earlier runs is collected now, and no collection runs during this one: a
        # finalizer running at a moment that depends on what ran before would break replays.
        gc.collect()
        gc.disable()
        try:
            with fast_httpx():
                self.loop.run_until_complete(self._main())
        except Stalled as exc:
            self.extra.append(Anomaly("stuck", None, f"the simulation stalled: {exc}"))
        except Exception as exc:  # noqa: BLE001 - the seed fails with it; a run of many seeds goes on
            self.trace("sim", f"the run raised {exc!r}")
            self.extra.append(Anomaly("harness-error", None, "".join(traceback.format_exception(exc))[-3000:]))
        finally:
            uuid.uuid4 = uuid4
            for lg, (level, propagate) in zip(quiet, levels, strict=True):
                lg.removeHandler(caught)
                lg.setLevel(level)
                lg.propagate = propagate
            with fast_httpx():  # the tasks left run to their end
                self._close_loop()
            gc.enable()
        result = check(self.ops)
        result.anomalies.extend(self.extra)
        digest = hashlib.sha256("\n".join(self.trace.events).encode())
        digest.update(str(self.trace.count).encode())
        return SeedResult(
            self.seed,
            result,
            list(self.trace.events),
            digest.hexdigest()[:16],
            self.loop.time() - 1000.0,
            self.net.stats["requests"],
            self._stats(),
            self.workload,
        )

    def _stats(self) -> dict[str, Any]:
        return {
            "net": dict(self.net.stats),
            "disk": dict(self.disk.stats),
            "server_starts": self.node.starts,
            "crashes": self.node.crashes,
        }

    async def _bring_up(self) -> None:
        """The server up (started again until it starts)."""
        while not self.node.up:
            if not await self.node.start():
                await asyncio.sleep(0.5)

    def _in_flight(self) -> list[tuple[float, str]]:
        """The requests the servers are serving: (since, what)."""
        return [(t0, what) for t0, what, _ in self.node.in_flight.values()]

    def _close_loop(self) -> None:
        loop = self.loop
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            try:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            except (Stalled, RuntimeError):
                pass
        loop.close()

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        ctx = contextvars.copy_context()
        ctx.run(owner.set, name)
        return self.loop.create_task(self._guard(name, coro), context=ctx)

    async def _guard(self, name: str, coro: Coroutine[Any, Any, None]) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a client's crash is a finding, not the end of the run
            self.trace(name, f"client crashed: {exc!r}")
            self.extra.append(
                Anomaly("client-error", None, f"{name}: {''.join(traceback.format_exception(exc))[-1500:]}")
            )

    async def _main(self) -> None:
        w = self.workload
        self.trace(
            "sim",
            f"seed {self.seed}: {w.duration:.1f}s, txn timeout {w.txn_timeout}s, kills {w.kills}/s "
            f"(power {w.power}), disk faults {w.disk_faults}, net faults {w.net_faults}, "
            f"clients {[a[0] for a in w.actors]}",
        )
        await self._bring_up()
        tasks = {name: self._spawn(name, self.ACTORS[kind](self, name, *args)) for name, kind, args in w.actors}
        await self._faults(self.loop.time() + w.duration)
        # Phase 2: quiet
        self.net.faults = NetFaults(slow=0.0)
        self._calm()
        await self._bring_up()
        self._stop = True
        self.trace("sim", "quiet: clients stopping")
        # writers first; copiers last, once there is nothing more to copy
        late = {n for n, kind, _ in w.actors if kind == "copier"}
        for group in ([n for n in tasks if n not in late], [n for n in tasks if n in late]):
            if group and group[0] in late:
                # A writer that stopped may have left a request in the network (a late copy, or a
                # retry it gave up on): the copiers stop only once nothing of the writers' can still
                # land, or they would leave behind what lands after their last read.
                deadline = self.loop.time() + 30.0
                while self.net.busy(but=late) and self.loop.time() < deadline:  # noqa: ASYNC110 - polls simulated time
                    await asyncio.sleep(0.1)
                self._stop_late = True
            if not group:
                continue
            done, running = await asyncio.wait([tasks[n] for n in group], timeout=60.0)
            for name in group:
                t = tasks[name]
                if t in running:
                    where = "\n".join(awaiting(x) for x in self.loop.tasks_of(name))
                    self.extra.append(
                        Anomaly(
                            "stuck",
                            None,
                            f"client {name} did not finish within 60 s of being told to stop; "
                            f"its tasks wait in:\n{where}",
                        )
                    )
                    t.cancel()
        await self._settle()
        await self._read_back()

    def _calm(self) -> None:
        """The faults of the world stop (the quiet phase)."""
        self.disk.faults.write_enospc = self.disk.faults.sync_eio = self.disk.faults.meta_enospc = 0.0

    async def _faults(self, until: float) -> None:
        w, rng = self.workload, self.rng
        while self.loop.time() < until:
            await asyncio.sleep(rng.uniform(0.2, 1.0))
            roll = rng.random()
            if w.kills and roll < w.kills:
                if self.node.up:
                    self.node.crash(power=rng.random() < w.power, why="(fault)")
                    await asyncio.sleep(rng.uniform(0.0, 1.0))
                    await self.node.start()
                continue
            if not self.node.up:
                await self.node.start()
            if w.disk_faults and rng.random() < 0.3:
                f = self.disk.faults
                f.write_enospc = rng.choice([0.0, 0.0, 0.2, 1.0])
                f.sync_eio = rng.choice([0.0, 0.0, 0.2, 1.0])
                f.meta_enospc = rng.choice([0.0, 0.5])
                self.trace(
                    "sim", f"disk faults: write ENOSPC {f.write_enospc}, sync EIO {f.sync_eio}, meta {f.meta_enospc}"
                )
            elif w.disk_faults:
                self.disk.faults.write_enospc = self.disk.faults.sync_eio = self.disk.faults.meta_enospc = 0.0
            self._network_faults()

    def _network_faults(self) -> None:
        """A new window of the network's faults (or none), when the workload has them."""
        rng = self.rng
        if self.workload.net_faults and rng.random() < 0.4:
            self.net.faults = NetFaults(
                loss=rng.choice([0.0, 0.1, 0.4]), dup=rng.choice([0.0, 0.1, 0.3]), slow=rng.choice([0.02, 0.1, 0.3])
            )
            self.trace("sim", f"network: {self.net.faults}")
        elif self.workload.net_faults:
            self.net.faults = NetFaults()

    async def _settle(self) -> None:
        """Every transactional id initialised once more (aborting what it left open), then wait
        past the transaction timeout so nothing is open any more."""
        c = self.client("sim")
        tids = {a[0] for a in self.workload.actors if a[1] in ("txn", "copier")}
        for tid in sorted(tids):
            for _ in range(10):
                try:
                    r = await c.post(f"{URL}/v1/txn/{tid}/init", json={})
                    if r.status_code in (200, 404):
                        break
                except httpx.TransportError:
                    pass
                await self._serving()
                await asyncio.sleep(0.2)
        await asyncio.sleep(self.txn_timeout * 2 + 2.0)

    async def _serving(self) -> None:
        """Return once a server can take the harness's own requests (after the quiet phase). The
        single server is up by then; the cluster waits for a leader."""

    async def _final(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """A request of the harness's own after the quiet phase (the final reads). The single
        server answers it; the cluster sends it again while it finds no leader."""
        return await self.client("sim").request(method, url, **kwargs)

    async def _read_back(self) -> None:
        r = await self._final("GET", f"{URL}/v1/streams")
        names = [s["name"] for s in r.json()["streams"]]
        for name in names:
            at, records = "-1", []
            while True:
                r = await self._final(
                    "GET",
                    actors.surl(name),
                    params={"offset": at, "format": "records", "isolation": "read_committed"},
                )
                if r.status_code != 200:
                    self.extra.append(
                        Anomaly(
                            "stuck", name, f"the final read of {name} at {at} failed: {r.status_code} {r.text[:300]}"
                        )
                    )
                    break
                nxt, recs = r.headers["stream-next-offset"], parse_records(r.content)
                records += recs
                if nxt == at:
                    break
                at = nxt
            self.record(
                "sim", "read", stream=name, isolation="read_committed", start="-1", next=at, records=records, final=True
            )
            head = await self._final("HEAD", actors.surl(name))
            if head.status_code == 200 and head.headers.get("stream-last-stable-offset") != head.headers.get(
                "stream-next-offset"
            ):
                self.extra.append(
                    Anomaly(
                        "lso-stuck",
                        name,
                        f"last stable offset {head.headers.get('stream-last-stable-offset')} "
                        f"short of the tail {head.headers.get('stream-next-offset')} "
                        f"{self.txn_timeout * 2 + 2:.0f} s after the last transaction could be open",
                    )
                )
        stuck = [(t0, what) for t0, what in self._in_flight() if self.loop.time() - t0 > 30.0]
        for t0, what in stuck:
            self.extra.append(Anomaly("stuck", None, f"the server has not answered {what} since t={t0 - 1000:.2f}"))


def awaiting(task: asyncio.Task[Any]) -> str:
    """Where a suspended task waits: its chain of awaited coroutines, outermost first."""
    lines = [f"task {task.get_name()}:"]
    obj: Any = task.get_coro()
    while obj is not None and len(lines) < 40:
        frame = getattr(obj, "cr_frame", None) or getattr(obj, "gi_frame", None)
        if frame is not None:
            lines.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        nxt = getattr(obj, "cr_await", None) or getattr(obj, "gi_yieldfrom", None)
        if nxt is None and isinstance(obj, asyncio.Future):
            lines.append(f"  (a future: {obj!r:.200})")
        obj = nxt
    return "\n".join(lines)


def run_seed(seed: int, workload: Workload | None = None) -> SeedResult:
    """Run one seed (see the module docstring)."""
    return World(seed, workload).run()


class _Tracebacks(logging.Handler):
    """An error logged with a traceback, in a seed's run, is its world's anomaly (``exception``)."""

    def __init__(self, world: World) -> None:
        super().__init__(logging.ERROR)
        self.world = world

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info is None or record.exc_info[1] is None:
            return  # a failure the code reports and handles (a write that failed, rolled back)
        exc = record.exc_info[1]
        tb = traceback.extract_tb(exc.__traceback__)
        where = " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(tb[-6:])) or "?"
        self.world.anomaly("exception", None, f"{record.getMessage()[:120]}: {exc!r} at {where}")
