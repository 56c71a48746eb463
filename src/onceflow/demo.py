"""``onceflow demo``: an end-to-end exactly-once run through crashes, on this machine alone.

1. Starts an onceflow server on a free loopback port, in a temporary directory.
2. Produces events with the idempotent producer through a proxy that drops acknowledgements (the
   server commits, the producer never hears back and sends again).
3. Runs a Spark Structured Streaming pipeline (onceflow → onceflow: an enriched copy of every event
   and running per-user counts) in a driver process of its own.
4. Kills that driver with SIGKILL: once right after the sink committed a batch but before Spark
   wrote its commit log (the moment at-least-once sinks duplicate), once inside ``write()`` with
   rows written but not committed, then at random moments; restarts it from its checkpoint each time.
5. Reads everything back and prints what was produced, read, written, duplicated and missing, and
   ``exactly-once: OK`` or ``exactly-once: FAILED`` (then exits non-zero).

With ``--ha`` the server is two servers over a PostgreSQL primary and its synchronous standby
(docs/ha.md, :class:`~onceflow.testing.HaCluster`), and everything (the producer through a proxy per
server, Spark, the checks) names both: between the driver's crashes, the leading onceflow server is
killed with ``kill -9`` (the other takes the store over), then the PostgreSQL primary (the standby is
promoted); the summary says how long each took.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from ._progress import Display, Task, progress_display

__all__ = ["PipelineCheck", "add_demo_parser", "check_pipeline", "run_demo", "sink_batch", "spark_missing"]


def _say(msg: str, display: Display | None = None) -> None:
    """A timestamped log line: on stdout, or above the progress bars when they are shown."""
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    if display is not None and display.active:
        display.log(line)
    else:
        print(line, flush=True)


@dataclass
class _Driver:
    url: str
    checkpoint: Path
    log: Path
    stop_file: Path
    max_records_per_trigger: int
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    kills: list[str] = field(default_factory=list)

    def start(self, *extra: str) -> None:
        self.starts += 1
        with open(self.log, "ab") as out:
            out.write(f"\n=== driver start {self.starts} {' '.join(extra)}\n".encode())
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "onceflow.spark.pipeline",
                    "--url",
                    self.url,
                    "--checkpoint",
                    str(self.checkpoint),
                    "--stop-file",
                    str(self.stop_file),
                    "--max-records-per-trigger",
                    str(self.max_records_per_trigger),
                    *extra,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: JVM and workers die with it
            )

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None

    def wait(self, timeout: float) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


def sink_batch(url: str, sink: str) -> int:
    """The last batch the Spark sink ``sink`` committed (``GET /v1/sinks/<sink>``); -1 if none or unreachable."""
    from .client.lowlevel import http_client, request_url

    try:
        with http_client(url, timeout=5) as client:
            batch = client.get(f"{request_url(url)}/v1/sinks/{sink}").json().get("batch")
    except httpx.HTTPError:
        return -1
    return -1 if batch is None else int(batch)


def _read_all(url: str, stream: str) -> list[Any]:
    """Every committed message of ``stream`` (none when it does not exist yet)."""
    from .client import Stream

    with Stream.connect(url, stream) as s:
        return list(s.messages()) if s.exists() else []


def _produce(
    ports: list[int], n: int, drop: float, seed: int, seconds: float, stats: dict[str, int], bar: Task | None = None
) -> None:
    """Produce ``n`` events through a proxy per server (``ports``) that drops acknowledgements."""
    from .client import IdempotentProducer
    from .testing import FaultProxy

    rng = random.Random(seed)  # noqa: S311 (demo data)
    with ExitStack() as stack:
        proxies = [
            stack.enter_context(FaultProxy(port, drop_probability=drop, seed=seed + i)) for i, port in enumerate(ports)
        ]
        url = "http://" + ",".join(p.url.removeprefix("http://") for p in proxies)  # several: the client fails over
        # small batches, so that many requests (and many dropped acknowledgements) carry the events
        with IdempotentProducer(
            url, "demo/events", producer_id="demo-producer", linger_ms=2, max_batch_bytes=4 << 10
        ) as producer:
            pause = seconds / max(1, n // 200)
            for i in range(n):
                producer.append(
                    {"id": i, "user": f"user-{rng.randrange(40):02d}", "amount": round(rng.uniform(1, 100), 2)}
                )
                if i % 200 == 199:
                    time.sleep(pause)  # a steady stream over `seconds` rather than one burst
                stats["produced"] = i + 1
                if bar is not None and i % 100 == 99:
                    bar.update(i + 1, acked=producer.stats.acked)
            producer.flush()
            if bar is not None:
                bar.update(n, acked=producer.stats.acked)
        stats["acks_dropped"] = sum(p.responses_dropped for p in proxies)


def run_demo(args: argparse.Namespace) -> int:
    missing = spark_missing()
    if missing is None and args.ha and importlib.util.find_spec("psycopg_pool") is None:
        missing = "psycopg for the PostgreSQL store: pip install 'onceflow[postgresql]' (./run.sh --ha does this)"
    if missing is not None:
        print(f"onceflow demo needs {missing}", file=sys.stderr)
        return 2
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="onceflow-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)  # noqa: S311
    _say(f"working in {work}")
    from .client import Stream
    from .testing import onceflow_server

    ha: Any = None
    if args.ha:
        from .testing import HaCluster, ServiceUnavailable

        try:
            ha = HaCluster(work=work / "ha", lease_seconds=3.0)
        except ServiceUnavailable as exc:
            print(f"onceflow demo --ha needs PostgreSQL's server binaries: {exc} (./run.sh --ha installs them)")
            return 2
        _say("starting a PostgreSQL primary and its synchronous standby, and two onceflow servers on them")
        ha.start()
        url, ports = ha.url, [s.port for s in ha.servers]
        _say(f"onceflow servers {url}; {ha.leader().name} leads (the store's lease: 3 s)")
        stop_servers = ha.stop
    else:
        server = onceflow_server(work / "data")
        server.start()
        url, stop_servers = server.url, server.stop
        ports = [int(url.rsplit(":", 1)[1])]
        _say(f"onceflow server on {url} (fsync on every append)")
    failovers: list[str] = []
    ha_faults = [partial(_kill_leader, ha), partial(_fail_over_database, ha, url)] if ha is not None else []
    driver = _Driver(url, work / "checkpoint", work / "driver.log", work / "stop", args.max_records_per_trigger)
    stats: dict[str, int] = {"produced": 0, "acks_dropped": 0}
    bars = ExitStack()
    # bars on stderr when both stdout and stderr are a terminal; when stdout goes to a log (CI, a pipe)
    # the timestamped lines stay there as they were
    display = bars.enter_context(progress_display(enabled=sys.stdout.isatty()))
    say = partial(_say, display=display)
    produced = display.task("produced", args.events, unit="events", text="{acked:,} acked", acked=0)
    pipeline = display.task(
        "pipeline", args.events, unit="rows", text="{crashes} of {planned} crashes", crashes=0, planned=args.crashes
    )
    try:
        with Stream.connect(url, "demo/events") as events:
            events.create("application/json")
        producer = threading.Thread(
            target=_produce,
            args=(ports, args.events, args.drop_acks, args.seed, 20.0, stats, produced),
            daemon=True,
        )
        producer.start()
        say(
            f"producing {args.events:,} events with the idempotent producer; {args.drop_acks:.0%} of acknowledgements are dropped"
        )

        plan = ["after-commit", "in-write"] + ["random"] * max(0, args.crashes - 2)
        plan = plan[: args.crashes]
        planned_notes = {
            "after-commit": "crashing on purpose: after the sink committed",
            "in-write": "crashing on purpose: inside write()",
        }
        crash_log = driver.checkpoint / "crashes.log"
        retries = 3  # planned crashes tried again after the driver failed by itself
        while plan:
            kind = plan.pop(0)
            done = sink_batch(url, "demo-enrich")
            target = done + 2
            noted = crash_log.read_text() if crash_log.exists() else ""
            if kind == "after-commit":
                driver.start("--crash-after-commit", str(target))
            elif kind == "in-write":
                driver.start("--crash-in-write", str(target))
            else:
                driver.start()
            say(
                f"spark driver #{driver.starts} started (resumes after batch {done})"
                + ("" if kind == "random" else f"; it will be killed {kind.replace('-', ' ')} of batch {target}")
            )
            if kind == "random":
                deadline = time.monotonic() + 45  # with no data left, it is killed idle: a crash too
                while (
                    sink_batch(url, "demo-enrich") < done + 1
                    and time.monotonic() < deadline
                    and driver.wait(0.5) is None
                ):
                    pass
                time.sleep(rng.uniform(0.2, 3.0))
                driver.kill()
                driver.kills.append("kill -9 at a random moment")
            else:
                code, give_up = None, time.monotonic() + 240
                # wait for the planned crash; it cannot come once the sink has moved past its batch
                while code is None and time.monotonic() < give_up and sink_batch(url, "demo-enrich") <= target:
                    code = driver.wait(1.0)
                if code is None:
                    driver.kill()
                    driver.kills.append(
                        f"kill -9 from outside (the planned crash {kind.replace('-', ' ')} did not come: "
                        "too few events for that batch)"
                    )
                elif (
                    retries > 0
                    and planned_notes[kind] not in (crash_log.read_text() if crash_log.exists() else "")[len(noted) :]
                ):
                    # it ended, but not by the planned crash (Spark failed by itself: see driver.log);
                    # restarting from the checkpoint is a crash recovery too, and the plan is tried again
                    driver.proc = None
                    driver.kills.append(
                        f"exited by itself with code {code} before its planned crash (see driver.log); planned again"
                    )
                    plan.insert(0, kind)
                    retries -= 1
                else:
                    driver.proc = None
                    driver.kills.append(
                        "kill -9 "
                        + (
                            "right after the sink committed, before Spark's commit log"
                            if kind == "after-commit"
                            else "inside write(), rows written but not committed"
                        )
                    )
            say(
                f"spark driver #{driver.starts} killed: {driver.kills[-1]} (sink at batch {sink_batch(url, 'demo-enrich')})"
            )
            if display.active:
                pipeline.update(len(_read_all(url, "demo/enriched")), crashes=len(driver.kills))
            if ha_faults:  # --ha: between the driver's crashes, a onceflow server dies, then the database's primary
                failovers.append(ha_faults.pop(0)())
                say(failovers[-1])

        while ha_faults:  # fewer crashes than failovers
            failovers.append(ha_faults.pop(0)())
            say(failovers[-1])
        driver.start()
        say(f"spark driver #{driver.starts} started; it runs until every event is processed")
        producer.join()
        say(f"produced {stats['produced']:,} events; {stats['acks_dropped']} acknowledgements were dropped and retried")
        deadline = time.monotonic() + args.timeout
        last_report = 0.0
        while time.monotonic() < deadline:
            n = len(_read_all(url, "demo/enriched"))
            counted = sum(c["events"] for c in {c["user"]: c for c in _read_all(url, "demo/counts")}.values())
            pipeline.update(n, crashes=len(driver.kills))
            if n >= args.events and counted >= args.events:
                break
            if not display.active and time.monotonic() - last_report > 5:  # the bar says it on a terminal
                say(f"  pipeline progress: {n:,} of {args.events:,} events enriched, {counted:,} counted")
                last_report = time.monotonic()
            if driver.wait(1.0) is not None:
                say(f"the spark driver exited early; see {driver.log}")
                break
        driver.stop_file.touch()
        if driver.proc is not None and driver.wait(60) is None:
            driver.kill()
        bars.close()  # the summary goes to stdout below the bars
        return _verify(url, args.events, stats, driver, failovers)
    finally:
        bars.close()
        driver.kill()
        stop_servers()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def _kill_leader(ha: Any) -> str:
    """``kill -9`` of the leading onceflow server; the other takes over; the killed one comes back as a follower."""
    old = ha.leader()
    began = time.monotonic()
    ha.kill(old)
    new = ha.leader(timeout=120)
    took = time.monotonic() - began
    ha.restart(old)
    return (
        f"onceflow {old.name} (the leader) killed with kill -9: {new.name} took the store over after "
        f"{took:.1f} s; {old.name} restarted as a follower"
    )


def _fail_over_database(ha: Any, url: str) -> str:
    """``kill -9`` of the PostgreSQL primary, promotion of the standby, then the time until an append
    is acknowledged again (through every server: the client fails over)."""
    from .client import Stream
    from .errors import OnceflowError

    with Stream.connect(url, "demo/probe") as probe:
        probe.create("application/json")
        promoted = ha.fail_over_database()
        began = time.monotonic()
        while True:
            try:
                probe.append({"probe": 1})
                break
            except OnceflowError:
                if time.monotonic() - began > 120:
                    raise
                time.sleep(0.05)
    return (
        f"PostgreSQL primary killed with kill -9: the standby was promoted in {promoted:.1f} s, and the first "
        f"append was acknowledged {time.monotonic() - began:.1f} s after the promotion"
    )


def spark_missing() -> str | None:
    """What the demo pipeline lacks to run here (PySpark, Java), or None when it can run."""
    import importlib.util

    if importlib.util.find_spec("pyspark") is None:
        return "PySpark: pip install 'onceflow[spark]' (./run.sh does this)"
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "Java 17+ for Spark (./run.sh installs it from Debian's packages)"
    return None


@dataclass(frozen=True)
class PipelineCheck:
    """The demo pipeline's output against its input: ``events``, ``enriched`` and ``counts`` as read
    back (read_committed). Ids are the events' ``id``; users whose latest count record disagrees with
    the events are in ``wrong_counts``."""

    events: int
    enriched: int
    users: int
    source_duplicates: list[int]  # ids twice in the input
    duplicates: list[int]  # ids enriched more than once (each extra copy once)
    missing: list[int]  # ids of the input never enriched
    extra: list[int]  # enriched ids that are not in the input
    wrong_counts: list[str]

    @property
    def ok(self) -> bool:
        return not (self.source_duplicates or self.duplicates or self.missing or self.extra or self.wrong_counts)


def check_pipeline(events: list[Any], enriched: list[Any], counts: list[Any]) -> PipelineCheck:
    """Every event enriched exactly once, and each user's last count record equal to its events."""
    produced = Counter(e["id"] for e in events)
    written = Counter(e["id"] for e in enriched)
    truth: dict[str, tuple[int, float]] = {}
    for e in events:
        n, amount = truth.get(e["user"], (0, 0.0))
        truth[e["user"]] = (n + 1, amount + e["amount"])
    latest = {c["user"]: c for c in counts}
    wrong_counts = sorted(
        u
        for u, (n, amount) in truth.items()
        if u not in latest or latest[u]["events"] != n or abs(latest[u]["amount"] - amount) > 1e-6 * max(1.0, amount)
    )
    return PipelineCheck(
        events=len(events),
        enriched=len(enriched),
        users=len(truth),
        source_duplicates=sorted(i for i, c in produced.items() for _ in range(c - 1)),
        duplicates=sorted(i for i, c in written.items() for _ in range(c - 1)),
        missing=sorted(set(produced) - set(written)),
        extra=sorted(set(written) - set(produced)),
        wrong_counts=wrong_counts,
    )


def _verify(url: str, expected: int, stats: dict[str, int], driver: _Driver, failovers: list[str]) -> int:
    result = check_pipeline(
        _read_all(url, "demo/events"), _read_all(url, "demo/enriched"), _read_all(url, "demo/counts")
    )
    dup_source, duplicates, missing = len(result.source_duplicates), len(result.duplicates), len(result.missing)
    extra, wrong_counts = len(result.extra), result.wrong_counts
    rows = [
        ("events the producer sent", f"{expected:,}"),
        ("acknowledgements dropped (retried)", f"{stats['acks_dropped']:,}"),
        ("events in demo/events", f"{result.events:,}"),
        ("  duplicates there", f"{dup_source:,}"),
        ("spark driver crashes", f"{len(driver.kills)}"),
        ("events read and written to demo/enriched", f"{result.enriched:,}"),
        ("  duplicates", f"{duplicates:,}"),
        ("  missing", f"{missing:,}"),
        ("  not from the input", f"{extra:,}"),
        ("users whose running count is wrong", f"{len(wrong_counts)} of {result.users}"),
    ]
    width = max(len(k) for k, _ in rows)
    print()
    for k, v in rows:
        print(f"  {k:<{width}}  {v:>10}")
    print()
    for i, k in enumerate(driver.kills, 1):
        print(f"  crash {i}: {k}")
    for k in failovers:
        print(f"  failover: {k}")
    planned = driver.checkpoint / "crashes.log"
    if planned.exists():
        print("  the driver's own notes on its planned crashes:")
        for line in planned.read_text().splitlines():
            print(f"    {line.removeprefix('pipeline: crashing on purpose: ')}")
    ok = result.events == expected and result.ok
    if ok:
        print(
            f"\nexactly-once: OK ({expected:,} events, {len(driver.kills)} driver crashes, "
            + (f"{len(failovers)} failovers, " if failovers else "")
            + f"{stats['acks_dropped']} dropped acks: 0 duplicates, 0 missing)"
        )
        return 0
    print(
        f"\nexactly-once: FAILED ({duplicates} duplicates, {missing} missing, {dup_source} duplicated at the source, "
        f"{len(wrong_counts)} wrong counts; driver log: {driver.log})"
    )
    return 1


def add_demo_parser(sub: Any) -> None:
    d = sub.add_parser(
        "demo",
        help="run the end-to-end exactly-once demo (server + producer + Spark, with crashes)",
        description=__doc__.split("\n\n", 1)[0] + " Needs PySpark and Java; nothing else.",
    )
    d.add_argument("--events", type=int, default=20_000, help="events to produce (default: 20000)")
    d.add_argument("--crashes", type=int, default=3, help="times the Spark driver is killed (default: 3)")
    d.add_argument(
        "--drop-acks",
        type=float,
        default=0.2,
        metavar="P",
        help="fraction of append acknowledgements dropped (default: 0.2)",
    )
    d.add_argument(
        "--max-records-per-trigger", type=int, default=2000, help="rows per micro-batch at most (default: 2000)"
    )
    d.add_argument("--seed", type=int, default=1, help="random seed (default: 1)")
    d.add_argument(
        "--timeout",
        type=float,
        default=600,
        metavar="SECONDS",
        help="give up waiting for the pipeline after this (default: 600)",
    )
    d.add_argument(
        "--ha",
        action="store_true",
        help="highly available: two onceflow servers over a PostgreSQL primary and its synchronous standby "
        "(docs/ha.md); between the driver's crashes the leading server is killed, then the database's primary "
        "(the standby promoted). Needs PostgreSQL's binaries and psycopg: ./run.sh --ha installs them",
    )
    d.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (server data, Spark checkpoints, driver log)")
    d.set_defaults(func=lambda a: run_demo(a))
