"""``onceflow bench takeover``: how long appends stop when the leader of a PostgreSQL store dies.

Two ``onceflow serve --store`` servers over a PostgreSQL primary and its synchronous standby
(``onceflow.testing.ha``), ``--streams`` streams with a message each, written through the leader. Then
the leader is killed (``kill -9``) and an append to one stream is tried through both servers,
again and again, until one is acknowledged. Reported, in seconds from the kill:

- ``taken``: when the other server reported that it leads (``GET /v1/leader``);
- ``first_ack``: when the first append was acknowledged (the figure docs/ha.md promises);
- ``recovery``: the new leader's own line saying how long its recovery took, as it printed it.

The lease's term (``--lease-seconds``) bounds ``taken`` from below: a follower takes the lease only
once it saw no renewal for a whole term. Issue 30's goal: first ack <= 5 s with 10,000 streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from onceflow.testing.ha import HaCluster

from .append import _say

__all__ = ["run"]


@dataclass
class TakeoverBench:
    streams: int
    lease_seconds: float
    fill_seconds: float
    taken_s: float
    first_ack_s: float
    recovery_line: str


async def _fill(url: str, streams: int, concurrency: int = 32) -> None:
    """Create ``streams`` streams with one message each, ``concurrency`` requests at a time."""
    headers = {"Content-Type": "application/json"}
    done = 0
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=concurrency)) as c:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(streams):
            queue.put_nowait(i)

        async def worker() -> None:
            nonlocal done
            while not queue.empty():
                i = queue.get_nowait()
                r = await c.put(f"/v1/stream/takeover/{i}", headers=headers)
                r.raise_for_status()
                r = await c.post(f"/v1/stream/takeover/{i}", content=b'[{"n": 1}]', headers=headers)
                r.raise_for_status()
                done += 1
                if done % 1000 == 0:
                    _say(f"{done:,} of {streams:,} streams written")

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def _first_ack(urls: list[str], deadline: float) -> float:
    """Append through each server in turn until one acknowledges; the moment it did."""
    headers = {"Content-Type": "application/json", "Producer-Id": "takeover-probe", "Producer-Epoch": "0"}
    seq = 0
    with httpx.Client(timeout=2.0) as c:
        while time.monotonic() < deadline:
            for url in urls:
                try:
                    r = c.post(
                        f"{url}/v1/stream/takeover/0",
                        content=b'[{"probe": 1}]',
                        headers={**headers, "Producer-Seq": str(seq)},
                    )
                except httpx.HTTPError:
                    continue
                if r.is_success:
                    return time.monotonic()
            time.sleep(0.02)
    raise RuntimeError("no append was acknowledged before the deadline")


def measure(streams: int, lease_seconds: float, *, timeout: float) -> TakeoverBench:
    with HaCluster(servers=2, lease_seconds=lease_seconds) as cluster:
        leader = cluster.leader()
        _say(f"writing {streams:,} streams through {leader.url}")
        t = time.monotonic()
        asyncio.run(_fill(leader.url, streams))
        fill = time.monotonic() - t
        other = next(s for s in cluster.servers if s is not leader)
        _say(f"{streams:,} streams in {fill:.1f} s; kill -9 of the leader")
        killed = time.monotonic()
        cluster.kill(leader)
        taken = -1.0
        deadline = killed + timeout
        while time.monotonic() < deadline:
            if other.leads():
                taken = time.monotonic() - killed
                break
            time.sleep(0.02)
        acked = _first_ack([other.url, leader.url], deadline) - killed
        lines = [ln for ln in other.log.read_text(errors="replace").splitlines() if "recovered" in ln]
        line = lines[-1].strip() if lines else ""
        _say(f"taken {taken:.2f} s, first ack {acked:.2f} s after the kill; {line}")
        return TakeoverBench(streams, lease_seconds, round(fill, 2), round(taken, 2), round(acked, 2), line)


def run(args: argparse.Namespace) -> int:
    results = [
        measure(n, args.lease_seconds, timeout=args.timeout)
        for n in [int(x) for x in re.split(r"[ ,]+", args.streams) if x]
    ]
    print("streams  lease_s  taken_s  first_ack_s  recovery")
    for r in results:
        print(f"{r.streams:7d}  {r.lease_seconds:7.1f}  {r.taken_s:7.2f}  {r.first_ack_s:11.2f}  {r.recovery_line}")
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    return 0
