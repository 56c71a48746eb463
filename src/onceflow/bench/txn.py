"""``onceflow bench txn``: transactions of N messages beside plain idempotent appends, same run.

Both sides send the same 100-byte JSON messages in requests of ``--txn-messages`` messages to the
same number of streams on one ``onceflow serve --fsync always``. The idempotent side waits for each
batch (flush); the transactional side appends the batch inside a transaction and commits it, which
adds the coordinator's records and a marker per stream. Reported: messages/s for both, the ratio
(target >= 0.8), and commit latency p50 / p99.
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

from ..client import AsyncIdempotentProducer, AsyncStream, AsyncTransactionalProducer
from .append import _run_loop, _say, make_message, onceflow_server

__all__ = ["run"]


@dataclass
class TxnBench:
    streams: int
    txn_messages: int
    idempotent_msg_s: float
    transactional_msg_s: float
    ratio: float
    commit_p50_ms: float
    commit_p99_ms: float
    transactions: int


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))] if ordered else 0.0


async def _measure(url: str, seconds: float, txn_messages: int, streams: int) -> TxnBench:
    msg = make_message()
    names = {kind: [f"bench-{kind}/{i}" for i in range(streams)] for kind in ("idem", "txn")}
    for group in names.values():
        for n in group:
            async with AsyncStream.connect(url, n) as s:
                await s.create("application/json")
    chunk = [msg] * txn_messages

    producers = [AsyncIdempotentProducer(url, n, content_type="application/json", max_in_flight=1) for n in names["idem"]]
    for p in producers:
        await p.start()
    sent = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for p in producers:
            p.extend(chunk)
            await p.flush()
            sent += txn_messages
    idem_rate = sent / (time.perf_counter() - t0)
    for p in producers:
        await p.close()

    tp = AsyncTransactionalProducer(url, "bench-txn", max_batch_bytes=1 << 30)
    await tp.init()
    commits: list[float] = []
    sent = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for n in names["txn"]:
            await tp.extend(n, chunk)
        c0 = time.perf_counter()
        await tp.commit()  # sends the batches, then the commit
        commits.append(time.perf_counter() - c0)
        sent += txn_messages * streams
    txn_rate = sent / (time.perf_counter() - t0)
    await tp.close()
    return TxnBench(streams, txn_messages, idem_rate, txn_rate, txn_rate / idem_rate,
                    statistics.median(commits) * 1e3, _pct(commits, 99) * 1e3, len(commits))


def run(args: argparse.Namespace) -> int:
    root = Path(tempfile.mkdtemp(prefix="onceflow-bench-txn-"))
    server = onceflow_server(root / "data")
    try:
        startup = server.start()
        _say(f"onceflow serve ready at {server.url} in {startup * 1e3:,.0f} ms; {args.seconds:.0f} s per side")
        res = _run_loop(_measure(server.url, args.seconds, args.txn_messages, args.streams))
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nonceflow bench txn: 100 B JSON messages, {res.txn_messages:,} per request, {res.streams} stream(s), fsync always")
    print(f"  idempotent appends (flush per batch)      {res.idempotent_msg_s:>12,.0f} msg/s")
    print(f"  transactions of {res.txn_messages:,} x {res.streams} stream(s)    {res.transactional_msg_s:>12,.0f} msg/s"
          f"   ({res.transactions:,} transactions)")
    verdict = "PASS" if res.ratio >= 0.8 else "MISS"
    print(f"  ratio transactional / idempotent          {res.ratio:>12.2f}x   target >= 0.80x   {verdict}")
    print(f"  commit latency (flush + commit)  p50 {res.commit_p50_ms:.2f} ms   p99 {res.commit_p99_ms:.2f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps(asdict(res), indent=2))
    return 0
