"""Recorded histories of a chaos run and the checker that looks for anomalies in them.

A history is a set of JSON-lines files, one object per line, written by every client as it goes
(``HistoryWriter``; a line is flushed before the operation it describes goes further, so a client
killed with ``kill -9`` loses at most its last, partial line, which the reader skips). Each object
has ``client`` (who), ``op`` (what), ``t`` (wall-clock seconds) and the fields of its kind:

``append``
    An append is about to be sent: ``id`` (unique per client), ``stream``, ``values`` (the JSON
    messages), and ``txn`` (a client-chosen label of its transaction, absent for plain appends).
``ack``
    The answer to append ``id``: ``outcome`` ``ok`` (stored; ``offset`` is the record offset of
    its first value when the server said where) or ``fail`` (definitely rejected, nothing stored).
    An append without an ``ack`` is indeterminate: it may have been stored, but at most once.
``txn``
    The end of transaction ``txn`` (the label used by its appends): ``decision`` ``commit`` or
    ``abort`` and ``outcome`` ``ok`` (the server confirmed the decision) or ``unknown``.
``read``
    A read of ``stream`` at ``isolation`` (``read_committed`` or ``read_uncommitted``) from token
    ``start`` to token ``next``, with ``records``: ``[[record offset, value], ...]`` in the order
    returned. ``final: true`` marks the read-back of a whole stream at the end of a run, made when
    nothing is in flight and every transaction is decided (the last final read of a stream counts).
    Optional: ``t0``, when the request was sent, and ``up_to_date: true`` when the server said the
    read reached the end of what is committed (``Stream-Up-To-Date``).
``commit-offset``
    Consumer group ``group`` committed ``offset`` (a token) for ``stream``; ``outcome`` ``ok`` or
    ``unknown``.
``fetch-offsets``
    Consumer group ``group``'s committed ``offsets`` (``{stream: token}``) as read from the server;
    ``t0`` is when the request was sent.
``copy``
    Declares that the ``outputs`` together must hold every message of the ``inputs`` exactly once
    (transactional copiers, sinks): checked against the final reads. An output may be a stream or
    a ``target``.
``target``
    The final content of something outside the server that a client writes to (a sink's Redis
    list): ``name`` and ``values``, read back at the end of a run like a final read.
``pipeline``
    Declares a Spark pipeline of the demo's shape (:mod:`onceflow.spark.pipeline`): every event of
    stream ``events`` must be in stream ``enriched`` exactly once, and the last record of each user
    in stream ``counts`` must count that user's events (checked on the final reads with
    :func:`onceflow.demo.check_pipeline`).

Values must be unique within a run (every client writes values carrying its id and a counter), so a
value identifies the write that produced it. The checker (:func:`check`) reports:

- ``lost-write``: an acknowledged append (or a transaction whose commit was acknowledged) missing
  from the final read, a copier's (or sink's) input missing from its outputs, or a pipeline's event
  never enriched;
- ``duplicate``: a value twice in a stream's final read or a target, twice across a copier's
  outputs, or an event enriched twice;
- ``aborted-read``: a read_committed read returned data of an aborted transaction, or data that is
  not in the final committed log at that offset (an abort or a loss made visible); an output of a
  copy (or sink, or pipeline) that is in no input;
- ``partial-transaction``: some but not all values of a transaction are in the final log;
- ``non-monotonic-read``: record offsets within one read do not strictly increase, or fall outside
  the read's ``[start, next)`` range;
- ``stale-read``: a read_committed read that said it was up to date, sent after an append to its
  stream had been acknowledged, ended before that append (a server answered from an older view than
  an acknowledged write, e.g. a deposed leader from its memory). Judged on streams that no
  transaction writes to, whose committed end no open transaction holds back (the simulator's
  cluster judges it too, :mod:`onceflow_tools.sim.cluster_actors`);
- ``offset-conflict``: the same offset of a stream was seen (read or acknowledged) with two values;
- ``offset-backwards``: a group's committed offset was seen lower than one acknowledged earlier;
- ``wrong-aggregate``: a pipeline's last count record of a user does not count that user's events;
- ``refused-write-stored``: a plain append answered as definitely not stored (``ack`` ``fail``) is in
  the final read;
- ``server-error``: a 500 answer (judged by the simulator's cluster).
"""

from __future__ import annotations

import bisect
import json
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO, get_args

from onceflow.demo import check_pipeline

__all__ = [
    "ANOMALY_KINDS",
    "Anomaly",
    "CheckResult",
    "HistoryWriter",
    "check",
    "load_history",
    "main",
    "value_key",
]

AnomalyKind = Literal[
    "lost-write",
    "duplicate",
    "aborted-read",
    "partial-transaction",
    "non-monotonic-read",
    "stale-read",
    "offset-conflict",
    "offset-backwards",
    "wrong-aggregate",
    "refused-write-stored",
    "server-error",
    # liveness, judged by the simulator (onceflow_tools.sim): a client, request or stream that never got
    # done, and a client that failed with an error no user code should see
    "stuck",
    "lso-stuck",
    "client-error",
    "spurious-fence",  # a sole producer fenced with nothing of its own open (onceflow_tools.sim)
    "harness-error",  # a seed's run raised (onceflow_tools.sim): the seed fails, the other seeds run on
]
ANOMALY_KINDS: tuple[AnomalyKind, ...] = get_args(AnomalyKind)  # in the order reports list them


def value_key(value: Any) -> str:
    """A canonical text of a JSON value, used as its identity."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _token_offset(text: str) -> int | None:
    """The record offset of an offset token (``-1`` is 0; anything else unknown is None)."""
    if text == "-1":
        return 0
    head, sep, _ = text.partition("_")
    return int(head) if sep and head.isdigit() else None


class HistoryWriter:
    """Appends history lines to a file, one flushed line per operation; thread-safe."""

    def __init__(self, path: str | Path, client: str) -> None:
        self.client = client
        self._file: TextIO = open(path, "a", encoding="utf-8")  # closed by close()
        self._lock = threading.Lock()
        self._next_id = 0

    def next_id(self) -> int:
        with self._lock:
            self._next_id += 1
            return self._next_id

    def record(self, op: str, **fields: Any) -> None:
        line = json.dumps({"client": self.client, "op": op, "t": time.time(), **fields}, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> HistoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parse_lines(lines: Iterable[str], where: str, skipped: list[str]) -> Iterator[dict[str, Any]]:
    pending: str | None = None
    for n, line in enumerate(lines, 1):
        if pending is not None:  # a bad line followed by more lines is not a torn tail
            raise ValueError(f"{where}:{n - 1}: not a JSON object: {pending[:80]!r}")
        text = line.strip()
        if not text:
            continue
        try:
            obj = json.loads(text)
        except ValueError:
            pending = text
            continue
        if not isinstance(obj, dict) or "op" not in obj or "client" not in obj:
            raise ValueError(f"{where}:{n}: a history line needs 'client' and 'op': {text[:80]!r}")
        yield obj
    if pending is not None:
        skipped.append(f"{where}: torn last line {pending[:60]!r}")


def load_history(paths: Iterable[str | Path], skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """Every operation of the history files (directories: their ``*.jsonl``), in time order.

    A torn last line (a client killed mid-write) is skipped and noted in ``skipped``; any other
    malformed line is an error.
    """
    notes = skipped if skipped is not None else []
    ops: list[dict[str, Any]] = []
    for p in paths:
        path = Path(p)
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        for f in files:
            with open(f, encoding="utf-8") as fh:
                ops.extend(_parse_lines(fh, str(f), notes))
    ops.sort(key=lambda o: float(o.get("t", 0.0)))
    return ops


@dataclass(frozen=True, slots=True)
class Anomaly:
    kind: AnomalyKind
    stream: str | None
    detail: str


@dataclass(slots=True)
class CheckResult:
    anomalies: list[Anomaly] = field(default_factory=list)
    ops: Counter[str] = field(default_factory=Counter)
    values_checked: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.anomalies

    def by_kind(self) -> dict[str, int]:
        counts = Counter(a.kind for a in self.anomalies)
        return {k: counts.get(k, 0) for k in ANOMALY_KINDS}

    def report(self, out: TextIO, *, limit: int = 20) -> None:
        ops = ", ".join(f"{k} {v}" for k, v in sorted(self.ops.items()))
        print(f"history: {sum(self.ops.values())} operations ({ops}); {self.values_checked} values checked", file=out)
        for note in self.notes:
            print(f"  note: {note}", file=out)
        print("anomalies: " + ", ".join(f"{k} {v}" for k, v in self.by_kind().items()), file=out)
        for a in self.anomalies[:limit]:
            print(f"  {a.kind} [{a.stream}]: {a.detail}", file=out)
        if len(self.anomalies) > limit:
            print(f"  ... and {len(self.anomalies) - limit} more", file=out)
        print("history check: " + ("OK" if self.ok else f"FAILED ({len(self.anomalies)} anomalies)"), file=out)


class _Checker:
    def __init__(self, ops: Sequence[Mapping[str, Any]]) -> None:
        self.ops = ops
        self.result = CheckResult()
        self.result.ops.update(str(o["op"]) for o in ops)
        self.appends: dict[tuple[str, int], Mapping[str, Any]] = {}
        self.acks: dict[tuple[str, int], Mapping[str, Any]] = {}
        self.txn_values: dict[str, list[tuple[str, str]]] = defaultdict(list)  # label -> (stream, value key)
        self.txn_end: dict[str, Mapping[str, Any]] = {}
        self.final: dict[str, dict[int, str]] = {}  # stream -> offset -> value key
        self.final_counts: dict[str, Counter[str]] = {}
        self.final_values: dict[str, list[Any]] = {}  # stream -> its final read's values, in order
        self.targets: dict[str, Counter[str]] = {}  # target name -> value key -> count
        self.seen: dict[tuple[str, int], tuple[str, str]] = {}  # (stream, offset) -> (value key, who)

    def add(self, kind: AnomalyKind, stream: str | None, detail: str) -> None:
        self.result.anomalies.append(Anomaly(kind, stream, detail))

    def run(self) -> CheckResult:
        for o in self.ops:
            op, client = o["op"], str(o["client"])
            if op == "append":
                self.appends[(client, int(o["id"]))] = o
                if o.get("txn") is not None:
                    for v in o["values"]:
                        self.txn_values[str(o["txn"])].append((str(o["stream"]), value_key(v)))
            elif op == "ack":
                self.acks[(client, int(o["id"]))] = o
            elif op == "txn":
                self.txn_end[str(o["txn"])] = o
            elif op == "read" and o.get("final"):
                self._final_read(o)
            elif op == "target":
                self.targets[str(o["name"])] = Counter(value_key(v) for v in o["values"])
        if not self.final:
            self.result.notes.append("no final reads: loss, duplicate and visibility checks were skipped")
        for o in self.ops:
            if o["op"] == "read":
                self._read(o)
        self._acked_offsets()
        self._stale_reads()
        self._lost_and_duplicates()
        self._transactions()
        self._copies()
        self._pipelines()
        self._group_offsets()
        return self.result

    # ---------------------------------------------------------------- reads

    def _final_read(self, o: Mapping[str, Any]) -> None:
        stream = str(o["stream"])
        recs = self.final[stream] = {}  # the last final read of a stream is its final content
        counts = self.final_counts[stream] = Counter()
        self.final_values[stream] = [v for _, v in o["records"]]
        for off, v in o["records"]:
            k = value_key(v)
            recs[int(off)] = k
            counts[k] += 1

    def _read(self, o: Mapping[str, Any]) -> None:
        stream, who = str(o["stream"]), f"{o['client']} at t={float(o['t']):.3f}"
        lo, hi = _token_offset(str(o.get("start", "-1"))), _token_offset(str(o.get("next", "")))
        prev: int | None = None
        for off, v in o["records"]:
            off = int(off)
            if prev is not None and off <= prev:
                self.add("non-monotonic-read", stream, f"read by {who}: offset {off} after {prev}")
            elif (lo is not None and off < lo) or (hi is not None and off >= hi):
                self.add("non-monotonic-read", stream, f"read by {who}: offset {off} outside [{lo}, {hi})")
            prev = off
            self._observe(stream, off, value_key(v), f"read by {who}")
            if o.get("isolation", "read_committed") == "read_committed" and not o.get("final") and stream in self.final:
                if off not in self.final[stream]:
                    self.add(
                        "aborted-read",
                        stream,
                        f"read_committed read by {who} returned {value_key(v)} at offset {off}, "
                        "which the committed log does not hold",
                    )

    def _observe(self, stream: str, off: int, key: str, who: str) -> None:
        old = self.seen.setdefault((stream, off), (key, who))
        if old[0] != key:
            self.add("offset-conflict", stream, f"offset {off}: {old[0]} ({old[1]}) but {key} ({who})")

    def _acked_offsets(self) -> None:
        for (client, op_id), ack in self.acks.items():
            append = self.appends.get((client, op_id))
            if append is None or ack.get("outcome") != "ok" or ack.get("offset") is None:
                continue
            stream = str(append["stream"])
            for i, v in enumerate(append["values"]):
                self._observe(stream, int(ack["offset"]) + i, value_key(v), f"ack to {client}#{op_id}")

    def _stale_reads(self) -> None:
        """Up-to-date reads sent after an append was acknowledged must reach past it (module docstring)."""
        with_txns = {str(a["stream"]) for a in self.appends.values() if a.get("txn") is not None}
        acked: dict[str, list[tuple[float, int, str]]] = defaultdict(list)  # stream -> (when, end offset, who)
        for (client, op_id), ack in self.acks.items():
            append = self.appends.get((client, op_id))
            if append is None or ack.get("outcome") != "ok" or ack.get("offset") is None:
                continue
            stream = str(append["stream"])
            if stream not in with_txns:
                end = int(ack["offset"]) + len(append["values"])
                acked[stream].append((float(ack["t"]), end, f"{client}#{op_id}"))
        times: dict[str, list[float]] = {}
        highest: dict[str, list[tuple[int, float, str]]] = {}  # the furthest end acknowledged up to each ack
        for stream, entries in acked.items():
            entries.sort()
            times[stream] = [when for when, _, _ in entries]
            best: list[tuple[int, float, str]] = []
            for when, end, who in entries:
                best.append((end, when, who) if not best or end > best[-1][0] else best[-1])
            highest[stream] = best
        for o in self.ops:
            stream = str(o.get("stream"))
            if o["op"] != "read" or not o.get("up_to_date") or o.get("t0") is None or stream not in acked:
                continue
            if o.get("isolation", "read_committed") != "read_committed":
                continue
            nxt = _token_offset(str(o.get("next", "")))
            sent = float(o["t0"])
            n = bisect.bisect_left(times[stream], sent)  # the acks before the read was sent
            if nxt is None or n == 0:
                continue
            end, when, who = highest[stream][n - 1]
            if nxt < end:
                self.add(
                    "stale-read",
                    stream,
                    f"read by {o['client']} sent at t={sent:.3f} said it was up to date at offset {nxt}, "
                    f"but {who}, acknowledged at t={when:.3f}, ends at offset {end}",
                )

    # ---------------------------------------------------------------- the final log

    def _lost_and_duplicates(self) -> None:
        for stream, counts in self.final_counts.items():
            for k, n in counts.items():
                if n > 1:
                    self.add("duplicate", stream, f"{k} is in the final log {n} times")
        for name, counts in self.targets.items():
            for k, n in counts.items():
                if n > 1:
                    self.add("duplicate", name, f"{k} is in the target {n} times")
        for (client, op_id), append in self.appends.items():
            stream = str(append["stream"])
            if stream not in self.final:
                continue
            ack = self.acks.get((client, op_id))
            label = append.get("txn")
            if label is not None:
                end = self.txn_end.get(str(label))
                must = end is not None and end.get("decision") == "commit" and end.get("outcome") == "ok"
            else:
                must = ack is not None and ack.get("outcome") == "ok"
            for v in append["values"]:
                k = value_key(v)
                self.result.values_checked += 1
                present = self.final_counts[stream][k] > 0
                if must and not present:
                    why = f"transaction {label} was committed" if label is not None else "it was acknowledged"
                    self.add("lost-write", stream, f"{k} from {client}#{op_id} is missing although {why}")
                if label is None and present and ack is not None and ack.get("outcome") == "fail":
                    self.add(
                        "refused-write-stored",
                        stream,
                        f"{k} from {client}#{op_id} is in the final log although it was refused as not stored",
                    )

    def _transactions(self) -> None:
        invisible: dict[str, tuple[str, str]] = {}  # value key -> (transaction, why it must stay invisible)
        for label, members in self.txn_values.items():
            present = [(s, k) for s, k in members if s in self.final_counts and self.final_counts[s][k] > 0]
            checked = [(s, k) for s, k in members if s in self.final_counts]
            end = self.txn_end.get(label)
            aborted = end is not None and end.get("decision") == "abort" and end.get("outcome") == "ok"
            if aborted and present:
                self.add(
                    "aborted-read",
                    present[0][0],
                    f"transaction {label} was aborted, yet {len(present)} of its "
                    f"values are in the committed log, e.g. {present[0][1]}",
                )
            elif present and len(present) != len(checked):
                self.add(
                    "partial-transaction",
                    present[0][0],
                    f"transaction {label}: {len(present)} of {len(checked)} values are in the committed log",
                )
            if aborted or (not present and len(checked) == len(members)):
                for _, k in members:  # its data must never have been visible to read_committed readers
                    invisible[k] = (label, "aborted" if aborted else "not committed")
        for o in self.ops:
            if o["op"] != "read" or o.get("isolation", "read_committed") != "read_committed":
                continue
            for off, v in o["records"]:
                hit = invisible.get(value_key(v))
                if hit is not None:
                    self.add(
                        "aborted-read",
                        str(o["stream"]),
                        f"read_committed read by {o['client']} returned "
                        f"{value_key(v)} at offset {off} of {hit[1]} transaction {hit[0]}",
                    )

    def _copies(self) -> None:
        for o in self.ops:
            if o["op"] != "copy":
                continue
            inputs, outputs = [str(s) for s in o["inputs"]], [str(s) for s in o["outputs"]]
            contents = {**self.final_counts, **self.targets}
            if not all(s in self.final_counts for s in inputs) or not all(s in contents for s in outputs):
                self.result.notes.append(
                    f"copy {inputs} -> {outputs}: not every stream or target was read back; skipped"
                )
                continue
            want = Counter[str]()
            for s in inputs:
                want.update(set(self.final_counts[s]))
            got = Counter[str]()
            for s in outputs:
                got.update(contents[s])
            name = f"{','.join(inputs)}->{','.join(outputs)}"
            for k, n in got.items():
                if n > 1:
                    self.add("duplicate", name, f"{k} was copied {n} times")
            for k in want:
                self.result.values_checked += 1
                if k not in got:
                    self.add("lost-write", name, f"{k} of the input is in no output")
            for k in got:
                if k not in want:
                    self.add("aborted-read", name, f"{k} is in an output but in no input")

    def _pipelines(self) -> None:
        for o in self.ops:
            if o["op"] != "pipeline":
                continue
            events, enriched, counts = str(o["events"]), str(o["enriched"]), str(o["counts"])
            if not all(s in self.final_values for s in (events, enriched, counts)):
                self.result.notes.append(
                    f"pipeline {events} -> {enriched}, {counts}: not every stream was read back; skipped"
                )
                continue
            r = check_pipeline(self.final_values[events], self.final_values[enriched], self.final_values[counts])
            self.result.values_checked += r.events
            # ids twice in the input are duplicates of the input stream, reported there already
            for i in sorted(set(r.duplicates)):
                self.add("duplicate", enriched, f"event {i} was enriched {r.duplicates.count(i) + 1} times")
            for i in r.missing:
                self.add("lost-write", enriched, f"event {i} of {events} was never enriched")
            for i in r.extra:
                self.add("aborted-read", enriched, f"event {i} was enriched but is not in {events}")
            for user in r.wrong_counts:
                self.add("wrong-aggregate", counts, f"the last count of {user} does not match its events in {events}")

    # ---------------------------------------------------------------- consumer groups

    def _group_offsets(self) -> None:
        committed: dict[tuple[str, str], tuple[str, float]] = {}  # (group, stream) -> highest ok offset, when acked
        for o in self.ops:
            if o["op"] == "commit-offset" and o.get("outcome") == "ok":
                key, off = (str(o["group"]), str(o["stream"])), str(o["offset"])
                prev = committed.get(key)
                if prev is not None and off < prev[0]:
                    self.add(
                        "offset-backwards", key[1], f"group {key[0]}: commit of {off} acknowledged after {prev[0]}"
                    )
                if prev is None or off > prev[0]:
                    committed[key] = (off, float(o["t"]))
            elif o["op"] == "fetch-offsets":
                sent = float(o.get("t0", o["t"]))
                for stream, off in dict(o["offsets"]).items():
                    prev = committed.get((str(o["group"]), str(stream)))
                    if prev is not None and prev[1] < sent and str(off) < prev[0]:
                        self.add(
                            "offset-backwards",
                            str(stream),
                            f"group {o['group']}: read {off} after {prev[0]} had been committed",
                        )


def check(ops: Sequence[Mapping[str, Any]]) -> CheckResult:
    """Check a history (see the module docstring for what is looked for)."""
    return _Checker(ops).run()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m onceflow_tools.chaos.history FILE_OR_DIR...``: check recorded histories; 1 on any anomaly."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m onceflow_tools.chaos.history", description="Check recorded chaos histories."
    )
    p.add_argument("paths", nargs="+", type=Path, help="history files (JSON lines) or directories of *.jsonl")
    args = p.parse_args(argv)
    skipped: list[str] = []
    try:
        ops = load_history(args.paths, skipped)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = check(ops)
    result.notes.extend(skipped)
    result.report(sys.stdout)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
