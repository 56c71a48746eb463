"""``onceflow sim``: run seeds of the deterministic simulation, or replay one with its trace."""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
import time
import traceback
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from contextlib import ExitStack
from typing import Any

from onceflow._progress import progress_display

__all__ = ["add_sim_parser"]


def add_sim_parser(sub: Any) -> None:
    p = sub.add_parser(
        "sim",
        help="deterministic simulation: the server, its disk, the network and the clients on simulated time",
        description="Run seeds of the deterministic simulation (docs/reliability.md). Each seed draws a workload "
        "(idempotent and transactional producers, a transactional copier, readers, forks, the Spark "
        "sink's protocol) and faults (kill -9, power loss, failing writes and syncs, lost, duplicated "
        "and delayed messages), runs it on simulated time and checks the history. A failing seed "
        "replays exactly: `onceflow sim --seed S` prints its trace. With --cluster, each seed is a cluster of "
        "two or three servers on a simulated PostgreSQL (the lease, takeovers, lost COMMIT answers, partitions, "
        "database failovers, clock steps and drift); --mutate puts a known hole back, to see the seeds find it.",
    )
    p.add_argument("--seeds", type=int, default=200, metavar="N", help="how many seeds to run (default: 200)")
    p.add_argument("--start", type=int, default=0, metavar="K", help="the first seed (default: 0)")
    p.add_argument(
        "--seed", type=int, default=None, metavar="S", help="run only seed S and print its trace and anomalies"
    )
    p.add_argument("--jobs", type=int, default=1, metavar="J", help="worker processes (default: 1)")
    p.add_argument(
        "--trace-lines", type=int, default=60, metavar="L", help="trace lines printed for a failing seed (default: 60)"
    )
    p.add_argument("--check-replay", action="store_true", help="run every seed twice and fail unless both runs agree")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="simulate the multi-server tier: servers sharing a simulated PostgreSQL store",
    )
    p.add_argument(
        "--mutate",
        action="append",
        default=[],
        metavar="NAME",
        choices=sorted(_mutations()),
        help="with --cluster: put a fixed hole back (guess-lost-commits, lease-by-db-clock); the seeds must find it",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_sim)


def _mutations() -> list[str]:
    from .mutations import MUTATIONS

    return list(MUTATIONS)


def _run(seed: int, cluster: bool, mutations: tuple[str, ...]) -> Any:
    if cluster:
        from .cluster import run_cluster_seed

        return run_cluster_seed(seed, mutations=mutations)
    from .run import run_seed

    return run_seed(seed)


def _deterministic_env() -> None:
    """Re-run this command with a fixed string hash seed (set iteration must not vary between runs)."""
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "onceflow.cli", *sys.argv[1:]])  # noqa: S606


def _settle_heap(cluster: bool) -> None:
    """Load the simulation's modules and move everything alive now out of the collector's sight
    (``gc.freeze``): each seed starts with a full collection (sim/run.py), which then looks only at
    what the seeds made, not at every module's objects again (5 % of a seed's time otherwise)."""
    importlib.import_module(".cluster" if cluster else ".run", __package__)

    gc.collect()
    gc.freeze()


def _one(seed: int, replay: bool, cluster: bool = False, mutations: tuple[str, ...] = ()) -> dict[str, Any]:
    """One seed's summary. A seed whose run raised fails (``harness-error``, with the traceback);
    the seeds after it run all the same."""
    t = time.perf_counter()
    try:
        r = _run(seed, cluster, mutations)
        wall = time.perf_counter() - t
        again = _run(seed, cluster, mutations).fingerprint if replay else r.fingerprint
    except Exception as exc:  # noqa: BLE001 - one seed's failure, not the whole run's
        return {
            "seed": seed,
            "ok": False,
            "replayed": True,
            "anomalies": [["harness-error", None, "".join(traceback.format_exception(exc))[-3000:]]],
            "wall": time.perf_counter() - t,
            "sim_seconds": 0.0,
            "requests": 0,
            "fingerprint": "",
            "clients": [],
        }
    return {
        "seed": seed,
        "ok": r.ok and again == r.fingerprint,
        "replayed": again == r.fingerprint,
        "anomalies": [[a.kind, a.stream, a.detail] for a in r.check.anomalies],
        "wall": wall,
        "sim_seconds": r.sim_seconds,
        "requests": r.requests,
        "fingerprint": r.fingerprint,
        "clients": [a[0] for a in r.workload.actors],
    }


def cmd_sim(args: argparse.Namespace) -> int:
    _deterministic_env()
    if args.mutate and not args.cluster:
        print("onceflow sim: --mutate needs --cluster (the holes it puts back are the multi-server tier's)")
        return 2
    mutations = tuple(args.mutate)
    if args.seed is not None:
        return _replay(args.seed, args.trace_lines, args.cluster, mutations)
    seeds = range(args.start, args.start + args.seeds)
    t0 = time.perf_counter()
    results: list[dict[str, Any]] = []
    with ExitStack() as stack:
        display = stack.enter_context(progress_display())  # a bar on stderr when it is a terminal, else nothing
        bar = display.task("onceflow sim", len(seeds), unit="seeds", text="{failed} failed", failed=0)
        if args.jobs > 1:
            pool = stack.enter_context(
                ProcessPoolExecutor(args.jobs, initializer=_settle_heap, initargs=(args.cluster,))
            )
            n = len(seeds)
            runs: Iterable[dict[str, Any]] = pool.map(
                _one, seeds, [args.check_replay] * n, [args.cluster] * n, [mutations] * n, chunksize=8
            )
        else:
            _settle_heap(args.cluster)
            runs = (_one(s, args.check_replay, args.cluster, mutations) for s in seeds)
        bad = 0
        for res in runs:
            results.append(res)
            bad += not res["ok"]
            bar.update(len(results), failed=bad)
    wall = time.perf_counter() - t0
    failed = [r for r in results if not r["ok"]]
    kinds = Counter(a[0] for r in failed for a in r["anomalies"])
    summary = {
        "seeds": len(results),
        "failed": len(failed),
        "failing_seeds": [r["seed"] for r in failed][:200],
        "anomalies_by_kind": dict(kinds),
        "not_replayed": [r["seed"] for r in results if not r["replayed"]],
        "wall_seconds": round(wall, 1),
        "seeds_per_second": round(len(results) / wall, 2) if wall else None,
        "simulated_seconds": round(sum(r["sim_seconds"] for r in results), 1),
        "requests": sum(r["requests"] for r in results),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        world = "cluster " if args.cluster else ""
        holes = f" with {', '.join(mutations)} put back" if mutations else ""
        print(
            f"onceflow sim: {summary['seeds']} {world}seeds{holes} ({args.start}..{args.start + args.seeds - 1}), "
            f"{summary['failed']} failed, {summary['wall_seconds']} s ({summary['seeds_per_second']} seeds/s on "
            f"{args.jobs} process{'es' if args.jobs > 1 else ''}), {summary['requests']} requests in "
            f"{summary['simulated_seconds']} simulated seconds"
        )
        for r in failed[:20]:
            first = r["anomalies"][0] if r["anomalies"] else ["not replayed", None, "two runs of the seed differ"]
            print(f"  seed {r['seed']}: {len(r['anomalies'])} anomalies, e.g. {first[0]}: {str(first[2])[:160]}")
        if failed:
            again = " --cluster" if args.cluster else ""
            again += "".join(f" --mutate {m}" for m in mutations)
            print(f"replay one with: onceflow sim{again} --seed {failed[0]['seed']}")
    return 1 if failed else 0


def _replay(seed: int, lines: int, cluster: bool = False, mutations: tuple[str, ...] = ()) -> int:
    r = _run(seed, cluster, mutations)
    w = r.workload
    print(
        f"seed {seed}: {w.duration:.1f} simulated s, clients {[a[0] for a in w.actors]}, txn timeout {w.txn_timeout} s, "
        f"kills {w.kills}/s (power {w.power}), disk faults {w.disk_faults}, net faults {w.net_faults}"
    )
    store = f"database {r.stats['db']}" if cluster else f"disk {r.stats['disk']}"
    print(
        f"  {r.requests} requests, {r.stats['server_starts']} server starts, {r.stats['crashes']} crashes; "
        f"{store}; network {r.stats['net']}; fingerprint {r.fingerprint}"
    )
    if r.ok:
        print("  OK: no anomaly")
        return 0
    print(f"  {len(r.check.anomalies)} anomalies:")
    for a in r.check.anomalies[:15]:
        print(f"    {a.kind} [{a.stream}] {a.detail[:3000] if a.kind == 'stuck' else a.detail[:300]}")
    print(f"  the last {min(lines, len(r.trace))} trace lines (simulated seconds, who, what):")
    for line in r.trace[-lines:]:
        print("   ", line)
    return 1
