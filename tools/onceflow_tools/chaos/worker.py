"""The clients of a chaos run, each a process that records its history (``onceflow chaos`` starts them).

``python -m onceflow_tools.chaos.worker KIND --url URL --history FILE --client NAME [...]``

- ``producer``: an idempotent producer (raw HTTP, so that every request and answer is recorded):
  batches of 1-4 unique values, each retried with the same ``Producer-Seq`` until it is answered.
  With ``--events`` its values are events for the Spark pipeline (``{"id", "user", "amount"}``,
  ids unique in the run).
- ``txn``: a transactional producer: transactions over one or two streams, committing about three
  in four and aborting the rest; a refused commit or a lost server re-initialises (fencing itself).
- ``group``: a consumer-group member reading read_committed and committing its offsets outside
  transactions, and reading them back.
- ``reader``: a read_committed reader of many streams; every read is recorded.
- ``sink``: a :class:`~onceflow.sinks.SinkRunner` feeding the streams (read_committed) into a
  :class:`~onceflow.sinks.RedisAtomicSink` (``--redis``, job ``--job``); records each restore and
  each committed checkpoint. After an error it starts a new runner, which restores from Redis.
  SIGTERM ends it at once, like a crash (the sink is built to survive one).

``--url`` names one server or several (``http://127.0.0.1:P1,127.0.0.1:P2``, ``onceflow chaos
--store postgresql``): every client is made by :func:`onceflow.client.lowlevel.http_client`, so it
fails over between them as any onceflow client does; requests are addressed to
:func:`~onceflow.client.lowlevel.request_url` of it (``args.base``).

Each worker runs until SIGTERM or SIGKILL. Killed with ``kill -9`` it loses at most the last line of
its history; a restarted worker writes to the same file under a new producer id, so its values stay
unique.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

import httpx

from onceflow.client.lowlevel import http_client, request_url
from onceflow.wire import iter_frames

from .history import HistoryWriter

__all__ = ["main", "parse_records"]

_running = True


def _stop(signum: int, frame: object) -> None:
    global _running
    _running = False


def parse_records(body: bytes) -> list[list[Any]]:
    """``[[record offset, value], ...]`` of a ``format=records`` read of a JSON stream."""
    out: list[list[Any]] = []
    for base, count, _ts, payload in iter_frames(body):
        values = json.loads(b"[" + payload[:-1] + b"]") if payload else []
        if len(values) != count:
            raise ValueError(f"a frame at offset {base} says {count} records but holds {len(values)}")
        out += [[base + i, v] for i, v in enumerate(values)]
    return out


def _offset_of(token: str) -> int:
    return int(token.split("_", 1)[0])


def _surl(url: str, stream: str) -> str:
    return f"{url}/v1/stream/{quote(stream, safe='/')}"


def _nap(rng: random.Random, lo: float = 0.02, hi: float = 0.08) -> None:
    time.sleep(rng.uniform(lo, hi))


def run_producer(args: argparse.Namespace, h: HistoryWriter, rng: random.Random) -> None:
    pid = f"{args.client}.{os.getpid()}"
    seqs: dict[str, int] = {}  # Producer-Seq is per stream
    n = 0
    # event ids: this process's start in ms, times a million, plus a counter (unique across restarts)
    id_base = time.time_ns() // 1_000_000 * 1_000_000
    with http_client(args.url, timeout=args.timeout) as c:
        while _running:
            stream = rng.choice(args.stream)
            values: list[dict[str, Any]]
            if args.events:
                values = [
                    {"id": id_base + n + i, "user": f"user-{rng.randrange(8)}", "amount": round(rng.uniform(1, 100), 2)}
                    for i in range(rng.randint(1, 4))
                ]
            else:
                values = [{"c": pid, "n": n + i} for i in range(rng.randint(1, 4))]
            n += len(values)
            op_id = h.next_id()
            seq = seqs.get(stream, 0)
            h.record("append", id=op_id, stream=stream, values=values, producer=pid, seq=seq)
            headers = {
                "content-type": "application/json",
                "producer-id": pid,
                "producer-epoch": "0",
                "producer-seq": str(seq),
            }
            body = json.dumps(values).encode()
            while _running:  # the same sequence number until answered: retries are deduplicated
                try:
                    r = c.post(_surl(args.base, stream), content=body, headers=headers)
                except httpx.TransportError:
                    _nap(rng, 0.05, 0.2)
                    continue
                if r.status_code == 200:
                    h.record(
                        "ack", id=op_id, outcome="ok", offset=_offset_of(r.headers["stream-next-offset"]) - len(values)
                    )
                    seqs[stream] = seq + 1
                    break
                if r.status_code == 204:  # a duplicate: stored by an earlier attempt
                    h.record("ack", id=op_id, outcome="ok", duplicate=True)
                    seqs[stream] = seq + 1
                    break
                if r.status_code >= 500 or r.status_code == 429:
                    _nap(rng, 0.1, 0.3)
                    continue
                # anything else leaves this append indeterminate; start a fresh producer id
                h.record("note", id=op_id, status=r.status_code, text=r.text[:200])
                pid, seqs = f"{args.client}.{os.getpid()}.{time.monotonic_ns()}", {}
                break
            _nap(rng)  # when stopping, an unanswered append stays indeterminate


class _Txn:
    def __init__(self, args: argparse.Namespace, h: HistoryWriter, rng: random.Random, c: httpx.Client) -> None:
        self.args, self.h, self.rng, self.c = args, h, rng, c
        self.tid = args.client
        self.epoch = -1
        self.seqs: dict[str, int] = {}
        self.ended = 0  # the number of the last transaction this epoch ended
        self.committed = False  # whether the last append's answer said it committed its transaction

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response | None:
        """POST until answered with anything but 5xx; None if the worker is stopping."""
        while _running:
            try:
                r = self.c.post(f"{self.args.base}/v1/txn/{self.tid}/{path}", json=body)
            except httpx.TransportError:
                _nap(self.rng, 0.05, 0.2)
                continue
            if r.status_code < 500:
                return r
            _nap(self.rng, 0.1, 0.3)
        return None

    def init(self) -> bool:
        # one request id for every retry of this init, so that a lost answer cannot fence us
        r = self.post("init", {"timeout_ms": int(self.args.txn_timeout * 1000), "request_id": uuid.uuid4().hex})
        if r is None or r.status_code != 200:
            return False
        self.epoch, self.seqs, self.ended = int(r.json()["epoch"]), {}, int(r.json()["txn"])
        return True

    def append(self, stream: str, values: list[Any], label: str, commit: int | None = None) -> int | None:
        """The transaction number, or None if the append was not acknowledged. With ``commit``, the
        append is the transaction's last and commits it (``Transaction-Commit``); ``self.committed``
        says whether the answer confirmed that."""
        op_id = self.h.next_id()
        seq = self.seqs.get(stream, 0)
        self.committed = False
        self.h.record("append", id=op_id, stream=stream, values=values, txn=label, epoch=self.epoch, seq=seq)
        headers = {
            "content-type": "application/json",
            "producer-id": f"txn:{self.tid}",
            "producer-epoch": str(self.epoch),
            "producer-seq": str(seq),
            "transaction-id": self.tid,
        }
        if commit is not None:
            headers["transaction-commit"] = str(commit)
        body = json.dumps(values).encode()
        for _ in range(20):
            if not _running:
                return None
            try:
                r = self.c.post(_surl(self.args.base, stream), content=body, headers=headers)
            except httpx.TransportError:
                _nap(self.rng, 0.05, 0.2)
                continue
            if r.status_code in (200, 204):
                self.seqs[stream] = seq + 1
                ack: dict[str, Any] = {"outcome": "ok"}
                if r.status_code == 200:
                    ack["offset"] = _offset_of(r.headers["stream-next-offset"]) - len(values)
                self.h.record("ack", id=op_id, **ack)
                self.committed = r.headers.get("transaction-committed") == "true"
                return int(r.headers.get("transaction-number", "-1"))
            if r.status_code < 500 and r.status_code != 429:
                self.h.record("note", id=op_id, status=r.status_code, text=r.text[:200])
                return None
            _nap(self.rng, 0.1, 0.3)
        return None

    def run(self) -> None:
        k = 0
        while _running:
            if not self.init():
                continue
            while _running:
                k += 1
                label = f"{self.tid}.{os.getpid()}:{k}"
                decision = "commit" if self.rng.random() < 0.75 else "abort"
                with_last = decision == "commit" and self.rng.random() < 0.5  # commit on the last append
                numbers: list[int | None] = []
                streams = self.rng.sample(self.args.stream, self.rng.randint(1, len(self.args.stream)))
                for i, stream in enumerate(streams):
                    values = [{"c": label, "n": j, "s": stream} for j in range(self.rng.randint(1, 3))]
                    last = with_last and i == len(streams) - 1
                    number = (numbers[0] if numbers else self.ended + 1) if last else None
                    numbers.append(self.append(stream, values, label, commit=number))
                    _nap(self.rng)
                if None in numbers or len(set(numbers)) != 1:
                    self.h.record("txn", txn=label, decision="commit" if with_last else "abort", outcome="unknown")
                    break  # re-init: it aborts whatever this epoch left open
                if with_last:
                    outcome = "ok" if self.committed else "unknown"
                    self.h.record("txn", txn=label, decision=decision, outcome=outcome, via="append")
                else:
                    r = self.post(decision, {"epoch": self.epoch, "txn": numbers[0]})
                    outcome = "ok" if r is not None and r.status_code == 200 else "unknown"
                    self.h.record(
                        "txn",
                        txn=label,
                        decision=decision,
                        outcome=outcome,
                        status=None if r is None else r.status_code,
                    )
                if outcome != "ok":
                    break
                self.ended = numbers[0] or self.ended
                _nap(self.rng, 0.05, 0.15)


def _read_committed(
    c: httpx.Client, args: argparse.Namespace, rng: random.Random, stream: str, start: str, max_bytes: int
) -> tuple[str, list[list[Any]], dict[str, Any]] | None:
    """One read_committed ``format=records`` read of ``stream`` from ``start``: (next offset,
    records, what the history says of the request besides: ``t0``, when it was sent, and
    ``up_to_date`` when the server said it reached the end), or None when it got no answer (after
    a short nap) or not a 200."""
    t0 = time.time()
    try:
        r = c.get(
            _surl(args.base, stream),
            params={"offset": start, "format": "records", "isolation": "read_committed", "max_bytes": str(max_bytes)},
        )
    except httpx.TransportError:
        _nap(rng, 0.1, 0.3)
        return None
    if r.status_code != 200:
        return None
    seen: dict[str, Any] = {"t0": t0}
    if r.headers.get("stream-up-to-date") == "true":
        seen["up_to_date"] = True
    return r.headers["stream-next-offset"], parse_records(r.content), seen


def run_group(args: argparse.Namespace, h: HistoryWriter, rng: random.Random) -> None:
    group = args.group
    member_epoch = time.time_ns() // 1_000_000  # a restarted member is newer than its predecessor
    with http_client(args.url, timeout=args.timeout) as c:
        offsets: dict[str, str] = {}
        while _running and not offsets:
            t0 = time.time()
            try:
                r = c.get(f"{args.base}/v1/groups/{group}/offsets")
            except httpx.TransportError:
                _nap(rng, 0.1, 0.3)
                continue
            if r.status_code == 200:
                got = dict(r.json()["offsets"])
                h.record("fetch-offsets", group=group, offsets=got, t0=t0)
                offsets = {s: got.get(s, "-1") for s in args.stream}
        while _running:
            for stream in args.stream:
                start = offsets[stream]
                answer = _read_committed(c, args, rng, stream, start, 4096)
                if answer is None:
                    continue
                nxt, records, seen = answer
                h.record(
                    "read", stream=stream, isolation="read_committed", start=start, next=nxt, records=records, **seen
                )
                if nxt == start:
                    continue
                body = {"offsets": {stream: nxt}, "member_epoch": member_epoch}
                try:
                    r = c.post(f"{args.base}/v1/groups/{group}/offsets", json=body)
                except httpx.TransportError:
                    h.record("commit-offset", group=group, stream=stream, offset=nxt, outcome="unknown")
                    continue
                if r.status_code == 200:
                    h.record("commit-offset", group=group, stream=stream, offset=nxt, outcome="ok")
                    offsets[stream] = nxt
                else:
                    h.record(
                        "commit-offset", group=group, stream=stream, offset=nxt, outcome="unknown", status=r.status_code
                    )
            t0 = time.time()
            try:
                r = c.get(f"{args.base}/v1/groups/{group}/offsets")
                if r.status_code == 200:
                    h.record("fetch-offsets", group=group, offsets=dict(r.json()["offsets"]), t0=t0)
            except httpx.TransportError:
                pass
            _nap(rng, 0.1, 0.3)


def run_reader(args: argparse.Namespace, h: HistoryWriter, rng: random.Random) -> None:
    offsets = dict.fromkeys(args.stream, "-1")
    with http_client(args.url, timeout=args.timeout) as c:
        while _running:
            for stream in args.stream:
                answer = _read_committed(c, args, rng, stream, offsets[stream], 16384)
                if answer is None:
                    continue
                nxt, records, seen = answer
                if records or seen.get("up_to_date"):  # an empty read at the end says how far it is
                    h.record(
                        "read",
                        stream=stream,
                        isolation="read_committed",
                        start=offsets[stream],
                        next=nxt,
                        records=records,
                        **seen,
                    )
                offsets[stream] = nxt
            _nap(rng, 0.05, 0.15)


def run_sink(args: argparse.Namespace, h: HistoryWriter, rng: random.Random) -> None:
    from onceflow.sinks import RedisAtomicSink, SinkRunner, Step

    def on_step(step: Step, checkpoint_id: int) -> None:
        if step in ("restored", "committed"):
            h.record("sink-" + step, job=args.job, checkpoint=checkpoint_id)

    while True:  # until SIGTERM or SIGKILL
        try:
            sink = RedisAtomicSink(args.redis, job=args.job)
            with SinkRunner(
                args.url,
                sink,
                job=args.job,
                streams=args.stream,
                live=True,
                checkpoint_messages=100,
                checkpoint_interval=0.5,
                max_read_bytes=8192,
                on_step=on_step,
            ) as runner:
                runner.run()
        except Exception as exc:  # noqa: BLE001 - a server fault: start again from the last checkpoint
            h.record("note", job=args.job, error=repr(exc)[:300])
            _nap(rng, 0.2, 0.5)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m onceflow_tools.chaos.worker", description="One client of a chaos run.")
    p.add_argument("kind", choices=["producer", "txn", "group", "reader", "sink"])
    p.add_argument(
        "--url",
        required=True,
        help="server (or fault proxy) base URL; several as http://a:P1,b:P2 (the client fails over between them)",
    )
    p.add_argument("--history", required=True, help="JSON-lines file to append this client's history to")
    p.add_argument("--client", required=True, help="client name (the transactional id for txn)")
    p.add_argument("--stream", action="append", required=True, help="a stream to use (repeatable)")
    p.add_argument("--group", default="chaos-group", help="consumer group (group)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3.0, help="HTTP timeout in seconds (default: 3)")
    p.add_argument("--txn-timeout", type=float, default=5.0, help="transaction timeout in seconds (txn; default: 5)")
    p.add_argument("--events", action="store_true", help="write Spark pipeline events (producer)")
    p.add_argument("--redis", help="Redis URL of the sink's target (sink)")
    p.add_argument("--job", default="chaos-sink", help="the sink's job name (sink)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.base = request_url(args.url)  # what requests are addressed to (the failover transport routes them)
    if args.kind == "sink" and not args.redis:
        build_parser().error("sink needs --redis")
    if args.kind != "sink":  # a sink is ended by SIGTERM at once, as by a crash
        signal.signal(signal.SIGTERM, _stop)
    rng = random.Random(f"{args.seed}/{args.client}/{os.getpid()}")  # noqa: S311 - a workload, not security
    # a restarted worker writes to the same file: its own name keeps (client, id) pairs unique
    with HistoryWriter(args.history, f"{args.client}.{os.getpid()}") as h:
        if args.kind == "producer":
            run_producer(args, h, rng)
        elif args.kind == "txn":
            with http_client(args.url, timeout=args.timeout) as c:
                _Txn(args, h, rng, c).run()
        elif args.kind == "group":
            run_group(args, h, rng)
        elif args.kind == "sink":
            run_sink(args, h, rng)
        else:
            run_reader(args, h, rng)
    return 0


if __name__ == "__main__":
    sys.exit(main())
