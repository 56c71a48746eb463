"""``onceflow bench ...`` sub-commands."""

from __future__ import annotations

import argparse
from typing import Any

from .progress import bench_progress

__all__ = ["add_bench_parser"]


def add_bench_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="benchmarks against the peers (not tests)")
    bsub = b.add_subparsers(dest="bench", required=True, metavar="BENCH")
    a = bsub.add_parser(
        "append", help="single-message appends at concurrency N: onceflow vs the Durable Streams reference server"
    )
    a.add_argument("--seconds", type=float, default=10.0, help="duration of each measurement (default: 10)")
    a.add_argument("--concurrency", type=int, default=75, help="concurrent requests (default: 75)")
    a.add_argument("--skip-reference", action="store_true", help="measure onceflow only")
    a.add_argument(
        "--recovery-gib", type=float, default=1.0, help="size of the log for the recovery-time measurement (0 to skip)"
    )
    a.add_argument("--out", default=None, help="also write the results as JSON to this file")
    a.add_argument(
        "--generator",
        choices=["auto", "wrk", "python"],
        default="auto",
        help="load generator: wrk (installed with apt-get if missing), the Python aiohttp client, "
        "or auto: wrk when it can be had (default)",
    )
    a.set_defaults(func=_bench_append)
    t = bsub.add_parser("txn", help="transactions of N messages beside plain idempotent appends, same run")
    t.add_argument(
        "--seconds", type=float, default=10.0, help="time spent on each side, in alternating 1 s bursts (default: 10)"
    )
    t.add_argument("--txn-messages", type=int, default=1000, help="messages per transaction and stream (default: 1000)")
    t.add_argument("--streams", type=int, default=1, help="streams written by each transaction (default: 1)")
    t.add_argument("--out", default=None, help="also write the results as JSON to this file")
    t.set_defaults(func=_bench_txn)
    p = bsub.add_parser(
        "produce",
        help="idempotent producer throughput (100 B messages) and append-to-live-reader latency, "
        "onceflow vs the Durable Streams reference server",
    )
    p.add_argument("--seconds", type=float, default=10.0, help="duration of each throughput measurement (default: 10)")
    p.add_argument(
        "--latency-rate",
        type=float,
        default=200.0,
        help="messages per second in the latency measurement (default: 200)",
    )
    p.add_argument(
        "--latency-messages",
        type=int,
        default=None,
        help="messages per latency measurement (default: rate x seconds, 2,000 with the defaults)",
    )
    p.add_argument("--skip-reference", action="store_true", help="measure onceflow only")
    p.add_argument("--no-profile", action="store_true", help="no cProfile run, even when a throughput target is missed")
    p.add_argument(
        "--compression",
        choices=["gzip", "zstd"],
        default=None,
        help="also measure the producer with compression= on varied JSON events, plain then compressed, and a "
        "catch-up read plain then compressed, in the same run: throughput and bytes on the wire as ratios",
    )
    p.add_argument("--out", default=None, help="also write the results as JSON to this file")
    p.set_defaults(func=_bench_produce)
    s = bsub.add_parser(
        "spark",
        help="rows/s through Spark: onceflow source -> onceflow exactly-once sink, beside an "
        "in-memory Python source -> no-op sink, same run; and the fixed cost of a micro-batch",
    )
    s.add_argument("--rows", type=int, default=1_000_000, help="rows through each pipeline (default: 1,000,000)")
    s.add_argument("--cores", type=int, default=2, help="local[N] (default: 2)")
    s.add_argument(
        "--max-records-per-trigger", type=int, default=500_000, help="rows per micro-batch (default: 500,000)"
    )
    s.add_argument("--per-partition", type=int, default=250_000, help="rows per Spark partition (default: 250,000)")
    s.add_argument(
        "--repeat", type=int, default=2, help="runs of each pipeline, interleaved; the best counts (default: 2)"
    )
    s.add_argument(
        "--tiny-batches", type=int, default=10, help="one-row micro-batches for the fixed cost (default: 10)"
    )
    s.add_argument("--out", default=None, help="also write the results as JSON to this file")
    s.set_defaults(func=_bench_spark)
    k = bsub.add_parser(
        "sinks", help="rows/s into PostgreSQL and Redis: exactly-once sinks beside at-least-once, same run"
    )
    k.add_argument(
        "--rows", type=int, default=200_000, help="rows read from onceflow into each sink (default: 200,000)"
    )
    k.add_argument("--checkpoint-messages", type=int, default=5_000, help="rows per checkpoint (default: 5,000)")
    k.add_argument("--repeat", type=int, default=3, help="runs of each sink, interleaved; the best counts (default: 3)")
    k.add_argument("--out", default=None, help="also write the results as JSON to this file")
    k.set_defaults(func=_bench_sinks)
    r = bsub.add_parser(
        "processors",
        help="processor latency p50/p99 and throughput (Cues exactly-once, parallel consumer) "
        "beside a plain consumer doing the same work, same run",
    )
    r.add_argument(
        "--messages", type=int, default=20_000, help="backlog for the throughput measurement (default: 20,000)"
    )
    r.add_argument(
        "--rate", type=float, default=200.0, help="messages per second in the latency measurement (default: 200)"
    )
    r.add_argument("--seconds", type=float, default=5.0, help="duration of the latency measurement (default: 5)")
    r.add_argument("--concurrency", type=int, default=4, help="handlers of the parallel consumer (default: 4)")
    r.add_argument("--out", default=None, help="also write the results as JSON to this file")
    r.set_defaults(func=_bench_processors)
    o = bsub.add_parser(
        "takeover",
        help="seconds without appends after a kill -9 of the leader of a PostgreSQL store, by stream count",
    )
    o.add_argument(
        "--streams", default="1000,10000", help="stream counts to measure, comma-separated (default: 1000,10000)"
    )
    o.add_argument("--lease-seconds", type=float, default=3.0, help="the servers' lease term (default: 3)")
    o.add_argument("--timeout", type=float, default=300.0, help="give up on a takeover after this long (default: 300)")
    o.add_argument("--out", default=None, help="also write the results as JSON to this file")
    o.set_defaults(func=_bench_takeover)
    from .compare import add_parser as _add_compare

    _add_compare(bsub)


def _bench_txn(args: argparse.Namespace) -> int:
    from .txn import run

    with bench_progress("txn"):  # a bar on a terminal, the plain [bench] lines elsewhere
        return run(args)


def _bench_append(args: argparse.Namespace) -> int:
    from .append import run

    with bench_progress("append"):  # a bar on a terminal, the plain [bench] lines elsewhere
        return run(args)


def _bench_produce(args: argparse.Namespace) -> int:
    from .produce import run

    with bench_progress("produce"):  # a bar on a terminal, the plain [bench] lines elsewhere
        return run(args)


def _bench_spark(args: argparse.Namespace) -> int:
    from .spark import run

    with bench_progress("spark"):  # a bar on a terminal, the plain [bench] lines elsewhere
        return run(args)


def _bench_sinks(args: argparse.Namespace) -> int:
    from .sinks import run

    with bench_progress("sinks"):  # a bar on a terminal, the plain [bench] lines elsewhere
        return run(args)


def _bench_processors(args: argparse.Namespace) -> int:
    from .processors import run

    with bench_progress("processors"):  # a bar on a terminal, the plain [bench] lines elsewhere
        return run(args)


def _bench_takeover(args: argparse.Namespace) -> int:
    from .takeover import run

    with bench_progress("takeover"):  # a bar on a terminal, the plain [bench] lines elsewhere
        return run(args)
