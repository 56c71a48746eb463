"""``onceflow bench txn``: transactions of N messages beside plain idempotent appends, same run.

Both sides send the same 100-byte JSON messages in requests of ``--txn-messages`` messages to the
same number of streams on one ``onceflow serve --fsync always``. The idempotent side waits for each
batch (flush); the transactional side appends the batch inside a transaction and commits it, which
adds the coordinator's records and a marker per stream. The sides run in alternating 1 s bursts.
Reported: messages/s for both, the ratio (target >= 0.8: the median of the per-round ratios), and
commit latency p50 / p99.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from onceflow.client import AsyncIdempotentProducer, AsyncStream, AsyncTransactionalProducer
from onceflow.testing import onceflow_server

from .append import _run_loop, _say, make_message

__all__ = ["run"]


@dataclass
class TxnBench:
    streams: int
    txn_messages: int
    idempotent_msg_s: float
    transactional_msg_s: float
    ratio: float  # of the totals
    round_ratio_median: float  # median over rounds of (transactional / idempotent) in that round
    rounds: int
    commit_p50_ms: float
    commit_p99_ms: float
    transactions: int


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))] if ordered else 0.0


async def _measure(url: str, seconds: float, txn_messages: int, streams: int, round_seconds: float = 1.0) -> TxnBench:
    """Alternate bursts of ``round_seconds`` of each side (which goes first alternates too), so
    load from other processes that comes and goes weighs on both sides alike."""
    msg = make_message()
    names = {kind: [f"bench-{kind}/{i}" for i in range(streams)] for kind in ("idem", "txn")}
    for group in names.values():
        for n in group:
            async with AsyncStream.connect(url, n) as s:
                await s.create("application/json")
    chunk = [msg] * txn_messages
    producers = [
        AsyncIdempotentProducer(url, n, content_type="application/json", max_in_flight=1) for n in names["idem"]
    ]
    for p in producers:
        await p.start()
    tp = AsyncTransactionalProducer(url, "bench-txn", max_batch_bytes=1 << 30)
    await tp.init()
    commits: list[float] = []

    async def idempotent_burst() -> tuple[int, float]:
        sent, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < round_seconds:
            for p in producers:
                p.extend(chunk)
                await p.flush()
                sent += txn_messages
        return sent, time.perf_counter() - t0

    async def transactional_burst() -> tuple[int, float]:
        sent, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < round_seconds:
            for n in names["txn"]:
                await tp.extend(n, chunk)
            c0 = time.perf_counter()
            await tp.commit()  # sends the batches; the last one carries the commit
            commits.append(time.perf_counter() - c0)
            sent += txn_messages * streams
        return sent, time.perf_counter() - t0

    await idempotent_burst()  # warm-up, not counted
    await transactional_burst()
    commits.clear()
    totals = {"idem": [0, 0.0], "txn": [0, 0.0]}
    ratios: list[float] = []
    rounds = max(1, round(seconds / round_seconds))
    for i in range(rounds):
        order = [("idem", idempotent_burst), ("txn", transactional_burst)]
        rates: dict[str, float] = {}
        for kind, burst in order if i % 2 == 0 else order[::-1]:
            sent, took = await burst()
            totals[kind][0] += sent
            totals[kind][1] += took
            rates[kind] = sent / took
        ratios.append(rates["txn"] / rates["idem"])
    for p in producers:
        await p.close()
    await tp.close()
    idem_rate = totals["idem"][0] / totals["idem"][1]
    txn_rate = totals["txn"][0] / totals["txn"][1]
    return TxnBench(
        streams,
        txn_messages,
        idem_rate,
        txn_rate,
        txn_rate / idem_rate,
        statistics.median(ratios),
        rounds,
        statistics.median(commits) * 1e3,
        _pct(commits, 99) * 1e3,
        len(commits),
    )


def run(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="onceflow-bench-txn-"))
    server = onceflow_server(root / "data")
    try:
        startup = server.start()
        _say(
            f"onceflow serve ready at {server.url} in {startup * 1e3:,.0f} ms; {args.seconds:.0f} s per side, "
            "in alternating 1 s bursts"
        )
        res = _run_loop(_measure(server.url, args.seconds, args.txn_messages, args.streams))
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"\nonceflow bench txn: 100 B JSON messages, {res.txn_messages:,} per request, {res.streams} stream(s), fsync always"
    )
    print(f"  idempotent appends (flush per batch)      {res.idempotent_msg_s:>12,.0f} msg/s")
    print(
        f"  transactions of {res.txn_messages:,} x {res.streams} stream(s)    {res.transactional_msg_s:>12,.0f} msg/s"
        f"   ({res.transactions:,} transactions)"
    )
    verdict = "PASS" if res.round_ratio_median >= 0.8 else "MISS"
    print(f"  ratio transactional / idempotent, totals  {res.ratio:>12.2f}x")
    print(
        f"  ratio, median of {res.rounds} paired rounds       {res.round_ratio_median:>12.2f}x   target >= 0.80x   {verdict}"
    )
    print(f"  commit latency (last append + commit)  p50 {res.commit_p50_ms:.2f} ms   p99 {res.commit_p99_ms:.2f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(asdict(res), indent=2))
    return 0
