"""``onceflow bench sinks``: rows/s into PostgreSQL and Redis, exactly-once beside at-least-once.

One run starts ``onceflow serve --fsync always``, a throwaway PostgreSQL (fsync on, the defaults
otherwise) and a throwaway Redis (``appendonly yes``, ``appendfsync everysec``), all on loopback
ports of their own, and loads one JSON stream with ``--rows`` messages of about 100 bytes. Then,
for each sink, a :class:`~onceflow.sinks.SinkRunner` reads the whole stream from the start into a
fresh target, in checkpoints of ``--checkpoint-messages``, acknowledging each checkpoint to its
consumer group; the time from ``run()`` to the end of the input gives rows/s. Every run is checked:
the target must hold exactly ``--rows`` rows.

Sinks, per target (the first two give the ratio, target >= 0.8):

- PostgreSQL: at-least-once ``PostgresInsertSink`` (COPY, commit) beside exactly-once
  ``PostgresTransactionalSink`` (COPY + the offsets row, one commit); also ``PostgresUpsertSink``
  (idempotent) and ``PostgresTwoPhaseSink`` (``PREPARE TRANSACTION``, a checkpoint file).
- Redis: at-least-once ``RedisListSink`` (pipelined ``RPUSH``) beside exactly-once
  ``RedisAtomicSink`` (one Lua script: ``RPUSH`` + the checkpoint); also ``RedisIdempotentSink``
  (``SET NX`` per row).

Each sink runs ``--repeat`` times, the sinks interleaved; the best run counts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from onceflow.client import IdempotentProducer, Stream
from onceflow.sinks import CheckpointAwareSink, FileCheckpointStore, SinkRunner
from onceflow.testing import PostgresServer, RedisServer, onceflow_server

from .append import BenchFailure, _say

__all__ = ["run"]

RATIO_TARGET = 0.8
STREAM = "bench-sinks"


@dataclass
class SinkResult:
    target: str
    sink: str
    mode: str
    rows_s: float
    seconds: float
    runs: list[float]


@dataclass
class Case:
    target: str
    sink: str
    mode: str
    make: Callable[[str, Path], tuple[CheckpointAwareSink, dict[str, Any]]]  # (job, workdir) -> sink, runner kw
    count: Callable[[str], int]  # job -> rows in its target
    drop: Callable[[str], None]


def _load(url: str, rows: int) -> None:
    with Stream.connect(url, STREAM) as s:
        s.create("application/json")
    pad = "x" * 80
    with IdempotentProducer(url, STREAM, content_type="application/json") as p:
        for start in range(0, rows, 10_000):
            p.extend([{"id": i, "v": pad} for i in range(start, min(rows, start + 10_000))])
            p.wait_for_capacity(50_000)
        p.flush()


def _postgres_cases(pg: PostgresServer) -> list[Case]:
    import psycopg

    from onceflow.sinks import PostgresInsertSink, PostgresTransactionalSink, PostgresTwoPhaseSink, PostgresUpsertSink

    conninfo = pg.conninfo()

    def table(job: str) -> str:
        return job.replace("-", "_")

    def create(job: str, key: bool) -> None:
        with psycopg.connect(conninfo, autocommit=True) as c:
            c.execute(f"CREATE TABLE {table(job)} (id bigint {'PRIMARY KEY' if key else ''}, v text NOT NULL)")

    def count(job: str) -> int:
        with psycopg.connect(conninfo) as c:
            row = c.execute(f"SELECT count(*) FROM {table(job)}").fetchone()  # noqa: S608 - our own table name
        return int(row[0]) if row else 0

    def drop(job: str) -> None:
        with psycopg.connect(conninfo, autocommit=True) as c:
            c.execute(f"DROP TABLE {table(job)}")

    def insert(job: str, work: Path) -> tuple[CheckpointAwareSink, dict[str, Any]]:
        create(job, False)
        return PostgresInsertSink(conninfo, table(job), ["id", "v"]), {}

    def transactional(job: str, work: Path) -> tuple[CheckpointAwareSink, dict[str, Any]]:
        create(job, False)
        return PostgresTransactionalSink(conninfo, table(job), ["id", "v"], job=job), {}

    def upsert(job: str, work: Path) -> tuple[CheckpointAwareSink, dict[str, Any]]:
        create(job, True)
        return PostgresUpsertSink(conninfo, table(job), ["id", "v"], key_columns=["id"]), {}

    def two_phase(job: str, work: Path) -> tuple[CheckpointAwareSink, dict[str, Any]]:
        create(job, False)
        return (
            PostgresTwoPhaseSink(conninfo, table(job), ["id", "v"], job=job),
            {"checkpoints": FileCheckpointStore(work / f"{job}.json")},
        )

    return [
        Case("PostgreSQL", "PostgresInsertSink", "at-least-once", insert, count, drop),
        Case("PostgreSQL", "PostgresTransactionalSink", "exactly-once", transactional, count, drop),
        Case("PostgreSQL", "PostgresUpsertSink", "exactly-once (idempotent)", upsert, count, drop),
        Case("PostgreSQL", "PostgresTwoPhaseSink", "exactly-once (2PC)", two_phase, count, drop),
    ]


def _redis_cases(rs: RedisServer) -> list[Case]:
    import redis

    from onceflow.sinks import RedisAtomicSink, RedisIdempotentSink, RedisListSink

    client = redis.Redis.from_url(rs.url)

    def key(job: str) -> str:
        return f"onceflow:{{{job}}}:out"

    def count_list(job: str) -> int:
        return int(client.llen(key(job)))

    def count_keys(job: str) -> int:
        return sum(1 for _ in client.scan_iter(match=f"{job}:*", count=10_000))

    def drop_list(job: str) -> None:
        client.delete(key(job), f"onceflow:{{{job}}}:checkpoint")

    def drop_keys(job: str) -> None:
        batch = list(client.scan_iter(match=f"{job}:*", count=10_000))
        for i in range(0, len(batch), 10_000):
            client.delete(*batch[i : i + 10_000])

    return [
        Case(
            "Redis",
            "RedisListSink",
            "at-least-once",
            lambda job, work: (RedisListSink(rs.url, key(job)), {}),
            count_list,
            drop_list,
        ),
        Case(
            "Redis",
            "RedisAtomicSink",
            "exactly-once",
            lambda job, work: (RedisAtomicSink(rs.url, job=job), {}),
            count_list,
            drop_list,
        ),
        Case(
            "Redis",
            "RedisIdempotentSink",
            "exactly-once (idempotent)",
            lambda job, work: (RedisIdempotentSink(rs.url, prefix=f"{job}:", key="id"), {}),
            count_keys,
            drop_keys,
        ),
    ]


def _measure(url: str, case: Case, job: str, work: Path, rows: int, checkpoint_messages: int) -> float:
    sink, kw = case.make(job, work)
    runner = SinkRunner(
        url, sink, job=job, streams=[STREAM], checkpoint_messages=checkpoint_messages, checkpoint_interval=60.0, **kw
    )
    t0 = time.perf_counter()
    with runner:
        stats = runner.run()
    seconds = time.perf_counter() - t0
    got = case.count(job)
    if stats.messages != rows or got != rows:
        raise BenchFailure(
            f"{case.sink}: read {stats.messages:,} messages and the target holds {got:,} rows; expected {rows:,}"
        )
    case.drop(job)
    return seconds


def run(args: argparse.Namespace) -> int:
    rows, per_cp, repeat = args.rows, args.checkpoint_messages, args.repeat
    root = Path(tempfile.mkdtemp(prefix="onceflow-bench-sinks-"))
    server = onceflow_server(root / "data")
    pg = PostgresServer(fsync=True)
    rs = RedisServer(appendonly=True, appendfsync="everysec")
    try:
        server.start()
        pg.start()
        rs.start()
        _say(f"onceflow at {server.url}, PostgreSQL on port {pg.port}, Redis on port {rs.port}; loading {rows:,} rows")
        _load(server.url, rows)
        cases = _postgres_cases(pg) + _redis_cases(rs)
        timings: dict[str, list[float]] = {c.sink: [] for c in cases}
        for rep in range(repeat):
            for case in cases:
                job = f"bench-{case.sink.lower()}-{rep}"
                seconds = _measure(server.url, case, job, root, rows, per_cp)
                timings[case.sink].append(seconds)
                _say(f"run {rep + 1}/{repeat}: {case.sink:<26} {rows / seconds:>10,.0f} rows/s")
    finally:
        rs.stop()
        pg.stop()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)

    results = [
        SinkResult(
            c.target,
            c.sink,
            c.mode,
            rows / min(timings[c.sink]),
            min(timings[c.sink]),
            [round(rows / t) for t in timings[c.sink]],
        )
        for c in cases
    ]
    by_sink = {r.sink: r for r in results}
    print(
        f"\nonceflow bench sinks: {rows:,} JSON rows (~100 B) read from onceflow, checkpoints of {per_cp:,}, "
        f"best of {repeat}"
    )
    print(f"  {'target':<11} {'sink':<26} {'mode':<26} {'rows/s':>10}")
    for r in results:
        print(f"  {r.target:<11} {r.sink:<26} {r.mode:<26} {r.rows_s:>10,.0f}")
    ratios = {
        "PostgreSQL transactional / insert": by_sink["PostgresTransactionalSink"].rows_s
        / by_sink["PostgresInsertSink"].rows_s,
        "PostgreSQL upsert / insert": by_sink["PostgresUpsertSink"].rows_s / by_sink["PostgresInsertSink"].rows_s,
        "PostgreSQL two-phase / insert": by_sink["PostgresTwoPhaseSink"].rows_s / by_sink["PostgresInsertSink"].rows_s,
        "Redis atomic / list": by_sink["RedisAtomicSink"].rows_s / by_sink["RedisListSink"].rows_s,
        "Redis SET NX / list": by_sink["RedisIdempotentSink"].rows_s / by_sink["RedisListSink"].rows_s,
    }
    print()
    for name, ratio in ratios.items():
        verdict = "PASS" if ratio >= RATIO_TARGET else "MISS"
        print(f"  ratio {name:<36} {ratio:>6.2f}x   target >= {RATIO_TARGET:.2f}x   {verdict}")
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "rows": rows,
                    "checkpoint_messages": per_cp,
                    "repeat": repeat,
                    "results": [asdict(r) for r in results],
                    "ratios": ratios,
                },
                indent=2,
            )
        )
    return 0
