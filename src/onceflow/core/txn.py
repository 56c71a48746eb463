"""The transaction coordinator: Kafka-style transactions across streams, plus consumer-group offsets.

Every state change is a JSON record in the coordinator's own log (``DATA/coordinator``). Each
``txn`` record holds the whole state of its transactional id (epoch, transaction number, status,
streams, offsets), so the last record of an id that reached the disk says all the log knows. A commit:

    1. ``ONGOING``: each stream is recorded before the transaction's first batch goes to it, but
       this record is *not* waited for: it is only ordered before every later record, so it is
       durable once any later record is. Recovery does not need it: every stream's log records the
       producers with an open transaction there, and :meth:`Coordinator.recover` reconciles them
       (see there). Group offsets (``add_offsets``) are still synced before the answer: unlike
       streams, no stream log could recover them.
    2. ``PREPARE_COMMIT`` (or ``PREPARE_ABORT``): the decision, one durable record holding every
       stream of the transaction. From here on the outcome is fixed; recovery finishes it.
    3. A commit (abort) marker batch is appended to every stream touched, naming the epoch and the
       transaction it ends; read_committed readers of that stream move past the transaction (or
       skip its data).
    4. ``COMPLETE_COMMIT``: group offsets carried by the transaction take effect; the producer may
       begin its next transaction. Not waited for either: recovery redoes steps 3 and 4 of a
       decision still last in the log, and applies the offsets of one that a later record of
       the id follows (its completion record failed and was rolled back).

Fencing: ``init`` bumps the transactional id's epoch and aborts what the previous epoch left open;
any request with an older epoch is refused. Each transaction has a number (``txn``) within its
epoch, and commit/abort must name it, so a delayed commit or abort of an earlier transaction cannot
touch a later one. Open transactions abort after their timeout, so the LSO always advances; such an
abort also bumps the epoch, fencing the producer that let it time out (its work must be redone by a
fresh ``init``, never half-committed). The fence rides in the abort decision (``fence``), so it
happens whoever finishes that abort: the sweep, a retry, an ``init`` or recovery.

A decision whose markers could not all be written (a full disk, an I/O error) leaves the
transaction in ``PREPARE_*`` until the sweep, a retry of the same commit (abort) or an ``init``
finishes it. Meanwhile every other request of that transactional id is refused as retriable
(``concurrent_transactions``) and changes nothing: the decision's streams and offsets are what the
finishing writes. Durable records are written before memory changes (:meth:`Coordinator._store`),
so a record that fails leaves memory as the disk has it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..storage.batch import FLAG_JSON
from ..storage.fs import FileSystem, OsFileSystem
from ..storage.log import FsyncPolicy, IoEvents, StreamLog
from ..storage.position import Position
from .clock import SYSTEM, Clock
from .limits import StateLimits
from .locks import KeyedLocks
from .refusal import Refusal, Refused

__all__ = [
    "CommitSeen",
    "Transactions",
    "Enlisted",
    "OpenTxn",
    "SinkState",
    "StateLimits",
    "TxnError",
    "TxnMeta",
    "TxnStatus",
]

log = logging.getLogger("onceflow.txn")

TXN_PRODUCER_PREFIX = "txn:"


class TxnStatus(enum.Enum):
    EMPTY = "empty"
    ONGOING = "ongoing"
    PREPARE_COMMIT = "prepare_commit"
    PREPARE_ABORT = "prepare_abort"
    COMPLETE_COMMIT = "complete_commit"
    COMPLETE_ABORT = "complete_abort"

    def can_become(self, new: TxnStatus) -> bool:
        return new in _TRANSITIONS[self]


_TRANSITIONS: dict[TxnStatus, set[TxnStatus]] = {
    TxnStatus.EMPTY: {TxnStatus.ONGOING, TxnStatus.EMPTY},
    # ONGOING -> COMPLETE_COMMIT: a one-stream transaction committed by its marker alone
    # (``Transaction-Commit`` on its last append; see Coordinator.commit_by_marker)
    TxnStatus.ONGOING: {
        TxnStatus.ONGOING,
        TxnStatus.PREPARE_COMMIT,
        TxnStatus.PREPARE_ABORT,
        TxnStatus.COMPLETE_COMMIT,
    },
    TxnStatus.PREPARE_COMMIT: {TxnStatus.COMPLETE_COMMIT},
    # PREPARE_ABORT -> EMPTY: an abort that fences its producer ends in the new epoch (TxnMeta.fence)
    TxnStatus.PREPARE_ABORT: {TxnStatus.COMPLETE_ABORT, TxnStatus.EMPTY},
    TxnStatus.COMPLETE_COMMIT: {TxnStatus.ONGOING, TxnStatus.EMPTY},
    TxnStatus.COMPLETE_ABORT: {TxnStatus.ONGOING, TxnStatus.EMPTY},
}


class TxnError(Refused):
    """A refused transactional request; ``refusal`` (also ``kind``) says why (mapped to a status by
    ``onceflow.server.answers``)."""

    @property
    def kind(self) -> Refusal:
        return self.refusal


SINK_TASK_PREFIX = "spark/"  # transactional ids of sinks' tasks: spark/<sink id>/p<n>/s<m> (begin_task)


@dataclass
class TxnMeta:
    tid: str
    epoch: int = -1
    txn: int = 0  # number of the current (or last) transaction within the epoch
    status: TxnStatus = TxnStatus.EMPTY
    streams: set[str] = field(default_factory=set)
    offsets: dict[str, dict[str, str]] = field(default_factory=dict)  # group -> stream -> offset
    timeout: float = 60.0
    started: float = 0.0  # monotonic time the transaction began
    init_id: str | None = None  # the request id of the init that began this epoch (retries repeat it)
    # digests of the request ids of the last inits that began an epoch, the newest last: a late copy
    # of an init that a later one replaced must not begin yet another epoch (see Coordinator.init)
    inits: tuple[str, ...] = ()
    # With an abort decision: finishing that abort also fences, moving the id past this epoch
    # (a timeout, or data recovery found undecided); recorded with the decision, so it is durable.
    fence: int | None = None

    @property
    def producer_id(self) -> str:
        return TXN_PRODUCER_PREFIX + self.tid

    def check_move(self, new: TxnStatus) -> None:
        """Refuse (``invalid_state``) a move the transitions table does not allow. Checked before a
        record of the move is written; ``status`` itself changes only when a record is applied
        (:meth:`Coordinator._apply_txn`), or when a move never stored is taken back."""
        if not self.status.can_become(new):
            raise TxnError(
                Refusal.INVALID_STATE, f"transaction {self.tid!r} cannot go from {self.status.value} to {new.value}"
            )

    @property
    def completing(self) -> bool:
        """The decision is logged, its markers (or its fence) are not all written yet."""
        return self.status in (TxnStatus.PREPARE_COMMIT, TxnStatus.PREPARE_ABORT)

    def record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "kind": "txn",
            "tid": self.tid,
            "epoch": self.epoch,
            "txn": self.txn,
            "status": self.status.value,
            "streams": sorted(self.streams),
            "offsets": self.offsets,
            "timeout": self.timeout,
            "init_id": self.init_id,
        }
        if self.inits:
            rec["inits"] = list(self.inits)
        if self.fence is not None:
            rec["fence"] = self.fence
        return rec


INIT_HISTORY = 4  # how many inits of an id are remembered (TxnMeta.inits)


def init_digest(request_id: str) -> str:
    """A short stand-in for an init's request id (up to 200 characters) in every record of its id."""
    return hashlib.blake2b(request_id.encode(), digest_size=8).hexdigest()


MarkerWriter = Callable[[str, str, int, int, bool], Awaitable[None]]  # (stream, producer id, epoch, txn, commit)
UNKNOWN_TXN = -1  # the transaction number of a marker that ends data no coordinator record describes


@dataclass(frozen=True, slots=True)
class OpenTxn:
    """A producer's transaction that a stream's log holds open after a restart (data, no marker)."""

    stream: str
    tid: str
    epoch: int  # the producer epoch of the open data
    ended: tuple[int, int] | None  # (epoch, txn) named by the producer's last marker in that stream


@dataclass(frozen=True, slots=True)
class CommitSeen:
    """The last commit marker of a transactional producer in a stream (durable state)."""

    stream: str
    tid: str
    epoch: int
    txn: int


@dataclass(frozen=True, slots=True)
class SinkState:
    """What the coordinator records of a sink (``/v1/sinks/<id>``, the Spark connector's): durable,
    rebuilt from the ``members`` decisions and ``sink`` records of its log."""

    batch: int | None = None  # the last batch committed (None: no batch yet, or writes without batch ids)
    owner: str | None = None  # the query the sink belongs to: bound by its first commit that names one
    decision: tuple[tuple[str, int, int], ...] | None = None  # the members of its last committed decision
    fingerprint: str | None = None  # of the rows of batch ``batch``, as its writers reported them
    rows: int | None = None  # rows the last committed decision published, as its writers reported them

    def record(self, sink: str) -> dict[str, Any]:
        return {
            "kind": "sink",
            "sink": sink,
            "batch": self.batch,
            "owner": self.owner,
            "fingerprint": self.fingerprint,
            "rows": self.rows,
            "decision": [list(m) for m in self.decision] if self.decision is not None else None,
        }


@dataclass(frozen=True, slots=True)
class Enlisted:
    """A task that began its part of a sink's batch (:meth:`Coordinator.begin_task`); memory only."""

    query: str | None
    task: str  # the writer's name for this task attempt (unique per attempt)
    batch: int | None
    epoch: int  # the epoch its transactional id was given


def _log_failure(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("a transaction completion record was not stored (recovery will redo it): %s", fut.exception())


class Transactions:
    """The coordinator's log, the meaning of its records, and transactions: the base of
    :class:`~onceflow.core.coordinator.Coordinator` (core/coordinator.py)."""

    def __init__(
        self,
        directory: Path,
        *,
        policy: FsyncPolicy,
        default_timeout: float = 60.0,
        compact_bytes: int = 64 << 20,
        fs: FileSystem | None = None,
        clock: Clock = SYSTEM,
        io: IoEvents | None = None,
        limits: StateLimits | None = None,
    ) -> None:
        self.directory = directory
        self.limits = limits or StateLimits()
        self.fs: FileSystem = fs or OsFileSystem()
        self.clock = clock
        self.io = io  # told of the coordinator log's writes, syncs and failures
        self.policy = policy
        self.default_timeout = default_timeout
        self.compact_bytes = compact_bytes  # rewrite the log at open when it is larger than this
        self.txns: dict[str, TxnMeta] = {}
        self.groups: dict[str, dict[str, str]] = {}  # group -> stream -> committed offset
        self.member_epochs: dict[str, int] = {}  # group -> highest member epoch seen
        self.sinks: dict[str, SinkState] = {}  # sink id -> what commit_members recorded of it
        # the lowest epoch an id may begin at: above every epoch of a deleted id (drop_txn), whose
        # producer state the streams keep (a new holder of the name must not be taken for a zombie)
        self.epoch_floor = 0
        self._enlisted: dict[str, dict[str, Enlisted]] = {}  # sink id -> tid -> the task holding it
        self._log: StreamLog | None = None
        self._locks = KeyedLocks()  # by transactional id, and "sink\0<id>" by sink
        self._pending: dict[str, set[str]] = {}  # kind -> names being created now (_creating)
        self._awaiting = 0  # durable writes whose callers have not yet applied them in memory
        # offsets into a deleted stream dropped before a stream of its name is created (forget_stream)
        self._forgotten: list[str] = []  # the stream of each forget staged since no _store was in flight
        self._forgetting: dict[str, asyncio.Task[None]] = {}  # a forget being written, by stream
        self._unsure: set[str] = set()  # dropped in memory; its record not known to be durable
        self._in_flight: dict[str, int] = {}  # streams named by offsets in records not yet durable
        self._in_flight_groups: dict[str, int] = {}  # groups named by transactions' records not yet durable
        self.compactions = 0
        self.write_marker: MarkerWriter | None = None

    @property
    def log(self) -> StreamLog | None:
        """The coordinator's own log (None before ``open``): a seam for tests and tools that inject
        disk faults into it, wait for it to drain, or drop its files as a crash would."""
        return self._log

    # ------------------------------------------------------------------ persistence

    def open(self) -> list[TxnMeta]:
        """Replay the coordinator log; returns transactions whose decision is logged but unfinished.
        A log larger than ``compact_bytes`` is then rewritten to hold only the current state."""
        self._finish_compaction()
        self._log = self._open_log(self.directory)
        at = self._log.base
        while at != self._log.durable.end:
            for batch in self._log.read(at, 4 << 20):
                for rec in json.loads(b"[" + batch.payload[:-1] + b"]"):
                    self._replay(rec)
                at = batch.end
        if at.pos - self._log.base.pos > self.compact_bytes:
            self._compact_or_go_on()
        for meta in self.txns.values():
            if meta.status is TxnStatus.ONGOING:
                meta.started = self.clock.monotonic()  # the timeout runs afresh after a restart
        return [m for m in self.txns.values() if m.status in (TxnStatus.PREPARE_COMMIT, TxnStatus.PREPARE_ABORT)]

    # Compaction, at open and while serving. Every record holds the whole state of what it names
    # (a transactional id, a group's offsets, a sink's batch), so the current state, written as
    # one record per item, is a log that replays to the same state. It is written to DIR.new and
    # synced, then swapped in with two renames; at open, a DIR.new without DIR (a crash between
    # the renames) is complete and takes its place, and any other leftover of a compaction is
    # removed. A compaction that fails (a full disk) is given up: the server goes on with the log
    # as it was.

    def _state_records(self) -> list[dict[str, Any]]:
        recs: list[dict[str, Any]] = [{"kind": "epoch_floor", "floor": self.epoch_floor}] if self.epoch_floor else []
        recs += [meta.record() for meta in self.txns.values()]
        # after the transactions: a committed transaction's offsets are applied when it replays,
        # and a group's offsets reset below them since must win
        for group in sorted(set(self.groups) | set(self.member_epochs)):
            recs.append(
                {
                    "kind": "offsets",
                    "group": group,
                    "offsets": self.groups.get(group, {}),
                    "member_epoch": self.member_epochs.get(group),
                    "reset": True,
                }
            )
        for sink, state in sorted(self.sinks.items()):
            recs.append(state.record(sink))
        return recs

    def _compact_or_go_on(self) -> None:
        try:
            self._compact()
        except Exception as exc:  # noqa: BLE001 - compaction is an optimisation: never lose the log over it
            log.warning("could not compact the coordinator log (%r); going on with it as it is", exc)
            self._finish_compaction()  # whichever complete log is left is the log again
            self._log = self._open_log(self.directory)

    async def maybe_compact(self, tries: int = 20) -> bool:
        """While serving (the server's sweep calls this every second): compact the log once it is
        larger than ``compact_bytes``. Only at an instant when nothing is staged or being written
        and no caller waits to apply a durable record, found and used without awaiting in between:
        then every state change is both in memory and on disk, and no request can stage a record
        into the old log while the new one is written and swapped in (all of it runs on the event
        loop, blocking it briefly: the state is small). Returns whether it compacted."""
        for _ in range(tries):
            logf = self._log
            if logf is None or logf.durable.end.pos - logf.base.pos <= self.compact_bytes:
                return False
            if logf.idle and not self._awaiting:
                self._compact_or_go_on()
                return True
            await asyncio.sleep(0.005)
        return False

    def _open_log(self, directory: Path) -> StreamLog:
        return StreamLog.open(
            directory, Position(0, 0), policy=self.policy, fs=self.fs, clock=self.clock.time, io=self.io
        )

    def _beside(self, suffix: str) -> Path:
        return self.directory.with_name(self.directory.name + suffix)

    def _compact(self) -> None:
        assert self._log is not None
        before = self._log.durable.end.pos - self._log.base.pos
        new, old = self._beside(".new"), self._beside(".old")
        fs = self.fs
        fs.rmtree(new)
        fresh = self._open_log(new)
        fresh.write_initial(
            [(json.dumps(r, separators=(",", ":")).encode() + b",", 1, FLAG_JSON) for r in self._state_records()]
        )
        after = fresh.durable.end.pos
        fresh.close_files()
        fs.sync_dir(new)
        self._log.close_files()
        fs.rename(self.directory, old)
        fs.rename(new, self.directory)
        fs.sync_dir(self.directory.parent)
        fs.rmtree(old)
        self._log = self._open_log(self.directory)
        self.compactions += 1
        log.info("compacted the coordinator log from %d to %d bytes", before, after)

    def _finish_compaction(self) -> None:
        new, old = self._beside(".new"), self._beside(".old")
        fs = self.fs
        if not fs.exists(self.directory):
            # the new log is complete once it is renamed at all; the old one is kept only in case
            # the swap failed in a way that left no new log
            for found in (new, old):
                if fs.exists(found):
                    fs.rename(found, self.directory)
                    fs.sync_dir(self.directory.parent)
                    break
        fs.rmtree(new)
        fs.rmtree(old)

    def _replay(self, rec: dict[str, Any]) -> None:
        """Apply one record of the log: the function of its kind (:data:`RECORDS`)."""
        getattr(self, RECORDS[rec["kind"]])(rec)

    def _apply_txn(self, rec: dict[str, Any], meta: TxnMeta | None = None) -> TxnMeta:
        """A ``txn`` record: a transactional id's whole state after a change. The one function
        that gives it its meaning, in replay and live (:meth:`_store` once the record is durable,
        :meth:`_transition` once it is staged): the id's :class:`TxnMeta` (``meta``, or the one
        known) takes the record's state in place, so every holder of it sees the change."""
        tid = rec["tid"]
        prev = meta if meta is not None else self.txns.get(tid)
        if (
            prev is not None
            and prev.status is TxnStatus.PREPARE_COMMIT
            and (prev.epoch, prev.txn) != (rec["epoch"], rec["txn"])
        ):
            # The id moved past a commit decision, so that commit completed: no request of an
            # id gets through while its decision is unfinished. Its completion record may still
            # be missing (its write failed and was rolled back while later ones reached the
            # disk): its offsets take effect here, or a copier would copy its input again.
            self._apply_offsets(prev.offsets)
        meta = prev if prev is not None else TxnMeta(tid)
        meta.epoch, meta.txn, meta.status = rec["epoch"], rec["txn"], TxnStatus(rec["status"])
        meta.streams, meta.offsets, meta.timeout = set(rec["streams"]), rec["offsets"], rec["timeout"]
        meta.init_id, meta.inits, meta.fence = rec.get("init_id"), tuple(rec.get("inits", ())), rec.get("fence")
        self.txns[tid] = meta
        for group in meta.offsets:  # named by a transaction's offsets: it exists (add_offsets)
            self.groups.setdefault(group, {})
        if meta.status is TxnStatus.COMPLETE_COMMIT:
            self._apply_offsets(meta.offsets)
        return meta

    def _apply_members(self, rec: dict[str, Any]) -> None:
        """A ``members`` record: one decision for several transactions (:meth:`commit_members`),
        each member applied as its own record, then the sink's part."""
        for member in rec["members"]:
            self._apply_txn(member)
        self._replay_decision(rec)

    def _apply_forget(self, rec: dict[str, Any]) -> None:
        self._forget(rec["stream"])

    def _apply_drop_group(self, rec: dict[str, Any]) -> None:
        self._drop_group(rec["group"])

    def _apply_drop_txn(self, rec: dict[str, Any]) -> None:
        self._drop_txn(rec["tid"], rec["floor"])

    def _apply_epoch_floor(self, rec: dict[str, Any]) -> None:
        """An ``epoch_floor`` record, which only a compaction writes (:meth:`_state_records`)."""
        self.epoch_floor = max(self.epoch_floor, rec["floor"])

    # The meaning of a record, written once: each of these applies one kind, in replay (above) and
    # on the live path once the record is durable (commit_offsets, commit_members, reset_sink).

    def _apply_offsets_record(self, rec: dict[str, Any]) -> None:
        """An ``offsets`` record (:meth:`commit_offsets`): a group's offsets, moved forward only
        unless ``reset``, and its member epoch, which only grows."""
        group = rec["group"]
        if rec.get("reset"):
            self.groups.setdefault(group, {}).update(rec["offsets"])
        else:
            self._apply_offsets({group: rec["offsets"]})
        if rec.get("member_epoch") is not None:
            self.member_epochs[group] = max(self.member_epochs.get(group, -1), rec["member_epoch"])

    def _apply_sink(self, rec: dict[str, Any]) -> None:
        """A ``sink`` record: a reset forgets the sink (:meth:`reset_sink`); any other (written by
        a compaction) is the sink's whole state."""
        if rec.get("reset"):
            self.sinks.pop(rec["sink"], None)
            return
        decision = rec.get("decision")
        self.sinks[rec["sink"]] = SinkState(
            rec.get("batch"),
            rec.get("owner"),
            tuple((t, e, n) for t, e, n in decision) if decision is not None else None,
            rec.get("fingerprint"),
            rec.get("rows"),
        )

    def _replay_decision(self, rec: dict[str, Any]) -> None:
        """The sink's part of a ``members`` record (a commit of :meth:`commit_members`): its batch,
        the query it belongs to now, the decision and what it wrote."""
        sink, batch, decision = rec["sink"], rec.get("batch"), rec.get("decision")
        if batch is None and decision is None:
            return  # written before sinks recorded their decisions: nothing to learn
        prev = self.sinks.get(sink) or SinkState()
        query = rec.get("query")
        self.sinks[sink] = SinkState(
            batch=prev.batch if batch is None else (batch if prev.batch is None else max(prev.batch, batch)),
            owner=query if query is not None else prev.owner,
            decision=tuple((t, e, n) for t, e, n in decision) if decision is not None else None,
            fingerprint=rec.get("fingerprint") if batch is not None else prev.fingerprint,
            rows=rec.get("rows"),
        )

    def _stage(self, rec: dict[str, Any]) -> asyncio.Future[None]:
        assert self._log is not None
        done = self._log.stage(
            count=1, payload=json.dumps(rec, separators=(",", ":")).encode() + b",", flags=FLAG_JSON
        ).done
        streams = _offset_streams(rec)
        if streams:  # seen by holds_offsets_of until durable (its caller applies it right after)
            _count(self._in_flight, streams, 1)
            done.add_done_callback(lambda _: _count(self._in_flight, streams, -1))
        groups = _txn_groups(rec)
        if groups:  # seen by drop_group until durable (its caller applies it right after)
            _count(self._in_flight_groups, groups, 1)
            done.add_done_callback(lambda _: _count(self._in_flight_groups, groups, -1))
        return done

    async def _write(self, rec: dict[str, Any], *, durable: bool = True) -> None:
        """Append a record; wait for its fsync unless ``durable`` is False (then it is only ordered
        before every later record, which is enough for a record recovery can redo)."""
        done = self._stage(rec)
        if durable:
            await self._wait(done)
        else:
            done.add_done_callback(_log_failure)

    async def _wait(self, done: asyncio.Future[None]) -> None:
        """Wait for a staged record's fsync. Some callers change memory only once the record is
        durable (group offsets, a sink's batch): until they have, compaction must not take the
        state in memory for all of it."""
        self._awaiting += 1
        try:
            await done
        finally:
            self._awaiting -= 1  # the caller's change follows at once, before anything else runs

    def _record_of(self, meta: TxnMeta, status: TxnStatus | None, changes: dict[str, Any]) -> dict[str, Any]:
        """The ``txn`` record of ``meta`` after ``changes`` and a move to ``status`` (checked
        against the transitions table); ``meta`` itself is not changed."""
        if status is not None:
            meta.check_move(status)
            changes = {**changes, "status": status}
        return dataclasses.replace(meta, **changes).record()

    async def _store(self, meta: TxnMeta, *, status: TxnStatus | None = None, **changes: Any) -> None:
        """Write the state ``meta`` has after ``changes`` (and a move to ``status``) as one durable
        record, and only then apply it (:meth:`_apply_txn`): a record that does not reach the disk
        leaves memory as the disk has it, so neither a retry nor the sweep acts on a state that
        was never stored, and no answer names one that a restart would take back. The caller
        holds the id's lock."""
        started = changes.pop("started", None)  # when a transaction began: memory's, not the record's
        rec = self._record_of(meta, status, changes)
        forgets = len(self._forgotten)
        await self._write(rec)
        gone = set(self._forgotten[forgets:])
        if gone:
            # streams forgotten while the record was written: their forget record stands after it
            # in the log, so memory drops them from it as replay will (a dict built before the
            # forget ran still holds them)
            rec = {
                **rec,
                "offsets": {
                    g: {st: o for st, o in offs.items() if st not in gone} for g, offs in rec["offsets"].items()
                },
            }
        self._apply_txn(rec, meta)  # at once: nothing runs between the fsync and this
        if started is not None:
            meta.started = started

    async def _transition(self, meta: TxnMeta, status: TxnStatus, *, durable: bool = True, **changes: Any) -> None:
        """Move ``meta`` to ``status`` (with ``changes``) as soon as its record is staged: every
        later record, and every request after this one, sees the move, as the log will have it
        (:meth:`_apply_txn`). A record that does not reach the log (the log rolls a failed write
        back) takes the move back with it, or a retry or the sweep would act on a decision that
        was never stored; a record not waited for (``durable`` False) is one recovery can redo."""
        rec = self._record_of(meta, status, changes)
        before = {name: getattr(meta, name) for name in ("status", *changes)}
        done = self._stage(rec)
        self._apply_txn(rec, meta)
        if not durable:
            done.add_done_callback(_log_failure)
            return
        try:
            await self._wait(done)
        except OSError:
            _take_back(meta, before)
            raise

    async def close(self) -> None:
        if self._log is not None:
            await self._log.close()

    @contextlib.asynccontextmanager
    async def _locked(self, tids: list[str]) -> AsyncIterator[None]:
        """Hold the locks of ``tids`` (sorted, so two callers never wait on each other)."""
        async with contextlib.AsyncExitStack() as stack:
            for tid in sorted(tids):
                await stack.enter_async_context(self._lock(tid))
            yield

    def _lock(self, tid: str) -> AbstractAsyncContextManager[None]:
        return self._locks.hold(tid)

    # ------------------------------------------------------------------ transactions

    def current(self, tid: str, epoch: int) -> TxnMeta:
        """The state of ``tid`` if ``epoch`` is its current epoch (read only; refused otherwise)."""
        return self._current(tid, epoch)

    def refuse_while_completing(self, meta: TxnMeta) -> None:
        """Refuse, as retriable, a request that meets ``meta`` while its decision is being
        finished: it must not change the decided streams and offsets (or begin the next
        transaction before the markers of this one are written)."""
        if meta.completing:
            outcome = "commit" if meta.status is TxnStatus.PREPARE_COMMIT else "abort"
            raise TxnError(
                Refusal.CONCURRENT_TRANSACTIONS,
                f"transaction {meta.txn} of {meta.tid!r} is still being completed (its {outcome} is decided, not all "
                "of its markers are written yet); retry shortly",
                txn=meta.txn,
            )

    @staticmethod
    def unknown(tid: str) -> TxnError:
        """The refusal of a request naming an id that was never initialised, or was deleted."""
        return TxnError(
            Refusal.UNKNOWN_TRANSACTIONAL_ID, f"transactional id {tid!r} was never initialised, or was deleted"
        )

    def _current(self, tid: str, epoch: int) -> TxnMeta:
        meta = self.txns.get(tid)
        if meta is None or meta.epoch < 0:
            raise self.unknown(tid)
        if epoch < meta.epoch:
            raise TxnError(
                Refusal.FENCED, f"epoch {epoch} of {tid!r} was fenced by epoch {meta.epoch}", epoch=meta.epoch
            )
        if epoch > meta.epoch:
            raise TxnError(Refusal.BAD_EPOCH, f"epoch {epoch} of {tid!r} was never issued (current: {meta.epoch})")
        return meta

    async def init(
        self,
        tid: str,
        txn_timeout: float | None = None,
        *,
        request_id: str | None = None,
        expected_epoch: int | None = None,
    ) -> TxnMeta:
        """Register (or re-register) ``tid``: a new epoch fences the old one, whose open
        transaction is aborted first.

        ``request_id`` makes a retried init harmless: the init that began the current epoch, sent
        again (its answer was lost, or the original arrives late, after its retry), gets the same
        epoch instead of a new one that would fence the producer that asked for it. A late copy of
        one of the last inits (``INIT_HISTORY``) that a later init replaced is refused (``fenced``):
        whoever sent it gave up on it and inited again, and a new epoch now would fence that one.

        ``expected_epoch`` (Kafka's KIP-360): the producer moves past its own epoch, and only if
        that is still the current one; otherwise another holder took the id over (or the server
        fenced the epoch after a timeout), and the init is refused (``fenced``) rather than fencing
        that holder in turn.

        A decision of the old epoch still being completed is finished first (its markers written);
        if that fails, nothing changes and the init may be retried. The new epoch exists only once
        its record is durable: an init whose record failed leaves the old epoch in force, and its
        retry writes the new one again."""
        async with self._lock(tid):
            meta = self.txns.get(tid)
            digest = init_digest(request_id) if request_id is not None else None
            if meta is not None and request_id is not None and meta.init_id == request_id and meta.epoch >= 0:
                return meta
            if meta is not None and digest is not None and digest in meta.inits[:-1]:
                raise TxnError(
                    Refusal.FENCED,
                    f"this init of {tid!r} (request id {request_id!r}) was carried out already, and a later init "
                    f"has taken the id over since (epoch {meta.epoch}); a late copy of it begins nothing",
                    epoch=meta.epoch,
                )
            if expected_epoch is not None and (meta.epoch if meta is not None else -1) != expected_epoch:
                current = meta.epoch if meta is not None else -1
                raise TxnError(
                    Refusal.FENCED,
                    f"epoch {expected_epoch} of {tid!r} is no longer current ({current}): another "
                    "holder took the id over, or the server fenced it",
                    epoch=current,
                )
            if meta is None:
                with self._creating("transactional_ids", tid, len(self.txns)):
                    meta = TxnMeta(tid, epoch=self.epoch_floor - 1)
                    await self._new_epoch(meta, txn_timeout, request_id, digest)  # known once stored
                return meta
            if meta.status is TxnStatus.ONGOING:
                await self._finish_decided(meta, self._finish(meta, commit=False))
            elif meta.completing:
                await self._finish_decided(meta, self._complete(meta))
            await self._new_epoch(meta, txn_timeout, request_id, digest)
            return meta

    async def _new_epoch(
        self, meta: TxnMeta, txn_timeout: float | None, request_id: str | None, digest: str | None
    ) -> None:
        await self._store(
            meta,
            epoch=meta.epoch + 1,
            txn=0,
            timeout=txn_timeout if txn_timeout is not None else self.default_timeout,
            streams=set(),
            offsets={},
            status=TxnStatus.EMPTY,
            init_id=request_id,
            inits=meta.inits
            if digest is None or meta.inits[-1:] == (digest,)
            else (*meta.inits, digest)[-INIT_HISTORY:],
            fence=None,
        )

    async def begin_write(self, tid: str, epoch: int, stream: str, *, commit: int | None = None) -> TxnMeta | None:
        """Called before a transactional append to ``stream``: starts the transaction if idle and
        records the stream the first time it is touched.

        The record is not waited for (see the module docstring): the caller stages its batch right
        after this returns, without awaiting in between, so a transaction's data in a stream is
        always staged while the coordinator holds it ONGOING, before its decision.

        ``commit``: the append is the last of transaction number ``commit`` and commits it. That
        must be the open transaction or, when none is open, the next one; returns None when it
        already committed (the append can then only be a retry, see ``Broker.append``).

        Refused as retriable while the id's last decision is being completed (``PREPARE_*``)."""
        async with self._lock(tid):
            meta = self._current(tid, epoch)
            self.refuse_while_completing(meta)
            if commit is not None:
                if commit == meta.txn and meta.status is TxnStatus.COMPLETE_COMMIT:
                    return None
                expected = meta.txn if meta.status is TxnStatus.ONGOING else meta.txn + 1
                if commit != expected:
                    raise TxnError(
                        Refusal.STALE_TRANSACTION,
                        f"Transaction-Commit names transaction {commit} of {tid!r}, but this append "
                        f"would belong to transaction {expected}",
                        txn=meta.txn,
                    )
            if meta.status is not TxnStatus.ONGOING:
                await self._transition(
                    meta, TxnStatus.ONGOING, durable=False, txn=meta.txn + 1, streams={stream}, offsets={}
                )
                meta.started = self.clock.monotonic()
            elif stream not in meta.streams:
                await self._transition(meta, TxnStatus.ONGOING, durable=False, streams=meta.streams | {stream})
            return meta

    def holding(self, tid: str) -> AbstractAsyncContextManager[None]:
        """The lock of ``tid`` (``async with``): no other request changes its state meanwhile."""
        return self._lock(tid)

    def one_stream(self, meta: TxnMeta, txn: int, stream: str) -> bool:
        """Whether transaction ``txn`` is open, wrote to ``stream`` only and carries no group
        offsets: then a commit marker in that stream is atomic by itself and commits it, with no
        decision record (:meth:`commit_by_marker`)."""
        return meta.status is TxnStatus.ONGOING and meta.txn == txn and meta.streams == {stream} and not meta.offsets

    def commit_by_marker(self, meta: TxnMeta) -> None:
        """Record that ``meta``'s one-stream transaction committed: its commit marker is durable
        (the caller holds the id's lock and checked :meth:`one_stream` when it staged the marker).
        The record is not waited for: if it is lost, recovery learns the outcome from the marker."""
        rec = self._record_of(meta, TxnStatus.COMPLETE_COMMIT, {})
        self._stage(rec).add_done_callback(_log_failure)
        self._apply_txn(rec, meta)

    def still_open(self, tid: str, epoch: int, txn: int, stream: str) -> bool:
        """Whether transaction ``txn`` of ``tid`` at ``epoch`` is still open and holds ``stream``
        (an append that waited between :meth:`begin_write` and staging checks this again)."""
        meta = self.txns.get(tid)
        return (
            meta is not None
            and meta.epoch == epoch
            and meta.txn == txn
            and meta.status is TxnStatus.ONGOING
            and stream in meta.streams
        )

    async def add_offsets(
        self, tid: str, epoch: int, group: str, offsets: dict[str, str], *, txn: int | None = None
    ) -> TxnMeta:
        """Make ``group``'s offsets part of the open transaction (they count only if it commits);
        with none open, they begin the next one. Synced before the answer, and only then part of
        the transaction: offsets whose record failed are in no transaction. Refused as retriable
        while the id's last decision is being completed.

        ``txn`` names the transaction the offsets are for: the open one or, with none open, the
        next. Any other is refused (``stale_transaction``) and changes nothing, so a late copy of an
        earlier transaction's request cannot replace the open one's offsets (found by ``onceflow
        sim``). Without ``txn`` (clients before it) the offsets go to whichever is open."""
        async with self._lock(tid):
            meta = self._current(tid, epoch)
            self.refuse_while_completing(meta)
            if txn is not None:
                expected = meta.txn if meta.status is TxnStatus.ONGOING else meta.txn + 1
                if txn != expected:
                    raise TxnError(
                        Refusal.STALE_TRANSACTION,
                        f"these offsets are for transaction {txn} of {tid!r}, but the one they can join is {expected}",
                        txn=meta.txn,
                    )
            with contextlib.ExitStack() as new:
                if not self.group_exists(group):
                    new.enter_context(self._creating("groups", group, len(self.groups)))
                if meta.status is not TxnStatus.ONGOING:
                    await self._store(
                        meta,
                        txn=meta.txn + 1,
                        streams=set(),
                        offsets={group: dict(offsets)},
                        status=TxnStatus.ONGOING,
                        started=self.clock.monotonic(),
                    )
                else:
                    await self._store(meta, offsets={**meta.offsets, group: {**meta.offsets.get(group, {}), **offsets}})
                # the group exists from now on (with no offsets until the commit), as in replay
                # (_replay): so it counts against the limit while the transaction is open
                self.groups.setdefault(group, {})
            return meta

    async def end(self, tid: str, epoch: int, txn: int, *, commit: bool) -> TxnMeta:
        """Commit or abort transaction number ``txn``. Repeating the same request after it completed
        is a no-op success; a request for any other transaction is refused.

        While the id's last decision is being completed (its markers could not all be written),
        the same request (``txn`` with the decided outcome: a retry) finishes it and is answered
        as usual; any other is refused as retriable and changes nothing. A decision logged whose
        markers fail is ``unavailable`` (retriable): the outcome is fixed, and a retry, the
        sweep or recovery finishes it."""
        async with self._lock(tid):
            meta = self._current(tid, epoch)
            if meta.completing:
                decided = TxnStatus.PREPARE_COMMIT if commit else TxnStatus.PREPARE_ABORT
                if txn != meta.txn or meta.status is not decided:
                    self.refuse_while_completing(meta)
                fenced = meta.fence is not None
                await self._finish_decided(meta, self._complete(meta))
                if fenced:  # the server's abort (a timeout, a sink, recovery) fenced this epoch
                    raise TxnError(
                        Refusal.FENCED,
                        f"transaction {txn} of {tid!r} was aborted by the server (it was open longer than its "
                        f"timeout, or its sink or a restart ended it), which fenced epoch {epoch}; the id's epoch "
                        f"is now {meta.epoch}: init again",
                        epoch=meta.epoch,
                    )
                return meta
            done = TxnStatus.COMPLETE_COMMIT if commit else TxnStatus.COMPLETE_ABORT
            if txn != meta.txn:
                raise TxnError(
                    Refusal.STALE_TRANSACTION,
                    f"transaction {txn} of {tid!r} is not the current one ({meta.txn})",
                    txn=meta.txn,
                )
            if meta.status is done:
                return meta  # a retry of a request that already completed
            if meta.status is TxnStatus.EMPTY and txn == 0:
                return meta  # nothing was ever written: committing or aborting it is a no-op
            if meta.status is not TxnStatus.ONGOING:
                raise TxnError(
                    Refusal.INVALID_STATE, f"transaction {txn} of {tid!r} already ended as {meta.status.value}"
                )
            await self._finish_decided(meta, self._finish(meta, commit=commit))
            return meta

    @staticmethod
    async def _finish_decided(meta: TxnMeta, finishing: Awaitable[None]) -> None:
        """Await ``finishing``; an I/O error after the decision was logged becomes a retriable
        ``unavailable`` that says the outcome is fixed (before it, the OSError goes up as is)."""
        try:
            await finishing
        except OSError as exc:
            if not meta.completing:
                raise
            outcome = "commit" if meta.status is TxnStatus.PREPARE_COMMIT else "abort"
            raise TxnError(
                Refusal.UNAVAILABLE,
                f"transaction {meta.txn} of {meta.tid!r} is decided ({outcome}) but not all of its markers "
                f"could be written ({exc.strerror or exc}); retry: the retry, the server's sweep or its recovery finishes it",
                txn=meta.txn,
            ) from exc

    async def _finish(self, meta: TxnMeta, *, commit: bool, fence: int | None = None) -> None:
        # Step 2: the decision, one durable record (an abort's may carry a fence: TxnMeta.fence).
        if fence is None:
            await self._transition(meta, TxnStatus.PREPARE_COMMIT if commit else TxnStatus.PREPARE_ABORT)
        else:
            await self._transition(meta, TxnStatus.PREPARE_ABORT, fence=fence)
        await self._complete(meta)

    async def _complete(self, meta: TxnMeta, *, done: frozenset[str] = frozenset()) -> None:
        """Steps 3 and 4 of a logged decision; ``done``: streams known to hold its marker already.
        An abort that fences (``meta.fence``) ends in the new epoch instead of COMPLETE_ABORT,
        synced like an init's. If a marker or that record fails, the decision stays to be
        finished (by the sweep, a retry, an init or recovery) and nothing else changes."""
        commit = meta.status is TxnStatus.PREPARE_COMMIT
        assert not (commit and meta.fence is not None)
        # Step 3: a marker in every stream the transaction touched (all at once; each is durable).
        assert self.write_marker is not None
        writer = self.write_marker
        await asyncio.gather(
            *(writer(stream, meta.producer_id, meta.epoch, meta.txn, commit) for stream in sorted(meta.streams - done))
        )
        if meta.fence is not None:
            await self._store(meta, **self._fenced(meta, meta.fence))
            return
        # Step 4: offsets take effect with the completion record. It need not be synced before the
        # answer: if it is lost, recovery sees the decision again and rewrites the markers, which a
        # stream ignores when no transaction of that producer is open there. If it fails (rolled
        # back) and a later record of the id reaches the disk, replay applies the offsets when it
        # meets that record (``_replay``).
        await self._transition(meta, TxnStatus.COMPLETE_COMMIT if commit else TxnStatus.COMPLETE_ABORT, durable=False)
        if commit:
            self._apply_offsets(meta.offsets)

    def _within(self, kind: str, count: int) -> None:
        """Refuse (``limit``) a new one of ``kind`` when ``count`` of them exist already."""
        limit: int = getattr(self.limits, kind)
        if count >= limit:
            name = kind.replace("_", " ")
            raise TxnError(
                Refusal.LIMIT,
                f"this server holds its limit of {limit} {name} (onceflow serve --max-{kind.replace('_', '-')}); "
                f"delete {name} no longer used or raise the limit",
            )

    @contextlib.contextmanager
    def _creating(self, kind: str, name: str, count: int) -> Iterator[None]:
        """Around the writing of a new ``name`` of ``kind`` (one that does not exist yet; ``count``
        of the kind do): refused (``limit``) when the limit is reached, counting those being
        created at this moment, whose place each holds until its write is over (or failed), so
        that requests creating several at once cannot pass the limit together."""
        pending = self._pending.setdefault(kind, set())
        if name in pending:  # the same name, created twice at once: one place
            yield
            return
        self._within(kind, count + len(pending))
        pending.add(name)
        try:
            yield
        finally:
            pending.discard(name)

    def group_exists(self, group: str) -> bool:
        """Whether ``group`` has offsets or a member epoch (what the groups limit counts)."""
        return group in self.groups or group in self.member_epochs

    async def recover(
        self, pending: list[TxnMeta], found: Sequence[OpenTxn] = (), committed: Sequence[CommitSeen] = ()
    ) -> None:
        """After a restart, before serving: reconcile the transactions the stream logs hold open
        (``found``) with the coordinator log, and finish every decision logged before the crash.

        The ONGOING records are not synced, so a stream may hold data of a transaction the
        coordinator log does not (fully) know. For each ``(stream, tid)`` held open, with the
        replayed state of ``tid``:

        - ONGOING or PREPARE_*, same epoch, but the stream's last marker of that producer already
          names this transaction (or a later one): the transaction ended there (by its decision,
          whose unsynced COMPLETE record was lost, or by a one-stream commit marker, below), so
          the open data belongs to the next transaction, whose records were lost too. Aborted.
        - ONGOING, same epoch, otherwise: the data is that transaction's (everything of an earlier
          transaction of the epoch was marked before its COMPLETE record, which precedes this
          ONGOING one). The stream joins its streams: a commit, an abort or the timeout covers it.
        - PREPARE_*, same epoch, the stream among its streams: the decision's own data; its
          marker is written.
        - anything else (no record, EMPTY, COMPLETE_*, another epoch, a stream outside the
          decision): a transaction that was never decided. It is aborted there.

        ``committed`` holds each producer's last commit marker in each stream. One that names a
        transaction of the current epoch later than the log's last record of it, or the one the
        log holds ONGOING, is a one-stream transaction committed by its marker alone
        (``Transaction-Commit``, :meth:`commit_by_marker`) whose unsynced COMPLETE record was lost:
        no decision record precedes such a marker, so nothing else can have written it. It is
        recorded as committed, so a retried commit is answered success and its number is never
        used again.

        Order: first the commits by marker are recorded (for an id with a logged decision still to
        finish: right after it is finished), so that open data is judged against what each id
        really did last; then the logged decisions are finished (never over a stream whose open
        data is not theirs); then every id that loses undecided data of its *current* epoch is
        fenced with a synced record (a new epoch, as after a timeout: its
        producer believes the transaction is still open and must not continue it half aborted);
        only then are the abort markers written. A crash anywhere in between leaves the same or an
        already fenced situation, which the next recovery handles the same way.
        """
        # Commits by marker first (except over a logged decision still to finish): an id the log
        # holds ONGOING whose transaction in fact committed by its marker must not have the next
        # transaction's open data in another stream taken for that one's (a chaos run found this).
        await self._adopt_commits(committed)
        orphans: dict[str, list[OpenTxn]] = {}
        done: dict[str, set[str]] = {}  # tid -> streams where its logged decision is carried out
        for o in found:
            meta = self.txns.get(o.tid)
            if meta is not None and o.epoch == meta.epoch:
                ended_here = o.ended is not None and o.ended[0] == meta.epoch and o.ended[1] >= meta.txn
                if meta.status is TxnStatus.ONGOING and not ended_here:
                    meta.streams.add(o.stream)
                    continue
                if meta.status in (TxnStatus.PREPARE_COMMIT, TxnStatus.PREPARE_ABORT) and o.stream in meta.streams:
                    if not ended_here:
                        continue  # the decision's own data: its marker is written below
                    done.setdefault(o.tid, set()).add(o.stream)
            orphans.setdefault(o.tid, []).append(o)
        for meta in pending:
            log.info("completing %s of transaction %d of %r after restart", meta.status.value, meta.txn, meta.tid)
            async with self._lock(meta.tid):
                await self._complete(meta, done=frozenset(done.get(meta.tid, ())))
        await self._adopt_commits(committed)  # those of ids whose decision was finished just now
        for tid, opens in sorted(orphans.items()):
            top = max(o.epoch for o in opens)
            async with self._lock(tid):
                meta = self.txns.get(tid)
                if meta is None:
                    meta = self.txns[tid] = TxnMeta(tid, epoch=top, timeout=self.default_timeout)
                if top >= meta.epoch:
                    log.warning(
                        "fencing epoch %d of %r: it left undecided data in %s",
                        top,
                        tid,
                        sorted(o.stream for o in opens),
                    )
                    await self._fence(meta, top)
        assert self.write_marker is not None
        for tid, opens in sorted(orphans.items()):
            for o in opens:
                log.warning("aborting undecided data of %r (epoch %d) in %r after restart", tid, o.epoch, o.stream)
                await self.write_marker(o.stream, TXN_PRODUCER_PREFIX + tid, o.epoch, UNKNOWN_TXN, False)

    async def _adopt_commits(self, committed: Sequence[CommitSeen]) -> None:
        """Record the one-stream transactions that ``committed`` (commit markers) shows committed
        by their marker alone while the log does not know it. An id whose logged decision is not
        finished yet (PREPARE_*) is left for a second call, once it is."""
        for c in sorted(committed, key=lambda c: c.txn):
            meta = self.txns.get(c.tid)
            if meta is None or c.epoch != meta.epoch or c.txn < 1:
                continue
            if meta.status in (TxnStatus.PREPARE_COMMIT, TxnStatus.PREPARE_ABORT):
                continue
            if c.txn > meta.txn or (c.txn == meta.txn and meta.status is TxnStatus.ONGOING):
                log.info("transaction %d of %r was committed by its marker in %r; recording it", c.txn, c.tid, c.stream)
                # The log lost both records of that transaction (ONGOING and COMPLETE_COMMIT are not
                # synced): both moves, the lost begin first unless the log has it, in one record.
                if meta.status is not TxnStatus.ONGOING:
                    meta.check_move(TxnStatus.ONGOING)
                assert TxnStatus.ONGOING.can_become(TxnStatus.COMPLETE_COMMIT)
                rec = dataclasses.replace(
                    meta, status=TxnStatus.COMPLETE_COMMIT, txn=c.txn, streams={c.stream}, offsets={}
                ).record()
                await self._write(rec)
                self._apply_txn(rec, meta)

    async def _fence(self, meta: TxnMeta, epoch: int) -> None:
        """Abort ``meta``'s open transaction and move past ``epoch`` with a synced record, so a
        producer of that epoch is refused from now on. The caller holds the id's lock.

        The abort decision carries the fence (``meta.fence``): if its markers fail, whoever
        finishes the abort later (the sweep, an init, recovery) also fences, and until then
        the id's requests are refused as retriable. Without the decision logged, nothing
        changes (the OSError goes up; the sweep tries again).

        A decision already logged but unfinished (``PREPARE_*``: a marker failed) is finished
        first: moving the id to a new epoch over it would leave its data open in the streams
        without a marker, holding their last stable offset until the id's next commit marker
        there published it (found by ``onceflow sim``)."""
        if meta.status in (TxnStatus.PREPARE_COMMIT, TxnStatus.PREPARE_ABORT):
            await self._complete(meta)  # raises if a marker still fails: nothing else changes
            if meta.epoch > epoch:
                return  # the decision carried the fence itself
        if meta.status is TxnStatus.ONGOING:
            await self._finish(meta, commit=False, fence=epoch)  # its completion moves the epoch on
            return
        await self._store(meta, **self._fenced(meta, epoch))

    @staticmethod
    def _fenced(meta: TxnMeta, epoch: int) -> dict[str, Any]:
        """The changes that move ``meta`` past ``epoch``: a new epoch, nothing open. Its init id is
        cleared: this epoch was not asked for, so a late init must begin a new one."""
        return {
            "epoch": max(meta.epoch, epoch) + 1,
            "txn": 0,
            "streams": set(),
            "offsets": {},
            "status": TxnStatus.EMPTY,
            "init_id": None,
            "fence": None,
        }

    async def expire(self) -> list[str]:
        """Abort transactions open longer than their timeout; returns their ids."""
        now = self.clock.monotonic()
        expired = [m for m in self.txns.values() if m.status is TxnStatus.ONGOING and now - m.started > m.timeout]
        for meta in expired:
            async with self._lock(meta.tid):
                if meta.status is TxnStatus.ONGOING and now - meta.started > meta.timeout:
                    log.warning(
                        "aborting transaction %d of %r: open longer than %.3g s", meta.txn, meta.tid, meta.timeout
                    )
                    # Fence the producer too: its next append must not quietly begin a new
                    # transaction that a later commit would publish without the aborted part.
                    try:
                        await self._fence(meta, meta.epoch)
                    except OSError as exc:  # the next sweep (or whoever finishes the abort) goes on
                        log.error("could not abort transaction %d of %r yet: %s", meta.txn, meta.tid, exc)
        # A decision whose markers could not all be written (an I/O error) is finished here rather
        # than only at the next restart, so the last stable offset does not stay stuck.
        for meta in [m for m in self.txns.values() if m.completing]:
            if self._locks.locked(meta.tid):
                continue  # being completed right now
            async with self._lock(meta.tid):
                if meta.completing:
                    log.warning(
                        "finishing the logged %s of transaction %d of %r", meta.status.value, meta.txn, meta.tid
                    )
                    try:
                        await self._complete(meta)
                    except OSError as exc:
                        log.error("could not finish transaction %d of %r yet: %s", meta.txn, meta.tid, exc)
        return [m.tid for m in expired]

    async def abort_open(self, tid: str, *, epoch: int | None = None, txn: int | None = None) -> tuple[int, int]:
        """An operator's abort of ``tid``'s open transaction (``onceflow txn abort``, what Kafka's
        ``kafka-transactions.sh abort`` is for): a hanging transaction holds the last stable offset
        of every stream it wrote to until its timeout, which may be long.

        The transaction is aborted and the epoch fenced exactly as the timeout sweep does it
        (:meth:`expire`, through :meth:`_fence`, under the id's lock): the abort decision carries
        the fence, its markers end the data in every stream (read_committed readers skip it), and
        the id moves to a new epoch, so the producer that held it is refused (``fenced``) from its
        next request on and must ``init`` again; it cannot quietly go on without the aborted part.

        ``epoch`` and ``txn``, when given, must name the open transaction (what the operator saw
        listed), else ``stale_transaction`` and nothing changes. Refused and nothing changes for an
        id never initialised (``unknown_transactional_id``), an id with nothing open
        (``invalid_state``), and a transaction whose decision is logged and being finished
        (``invalid_state``: a decided commit cannot be aborted; the sweep finishes it).

        Returns ``(epoch, txn)`` of the aborted transaction; the id's state is the new epoch. A
        decision logged whose markers fail is ``unavailable`` (retriable): the abort is fixed and
        the sweep finishes it, with its fence."""
        async with self._lock(tid):
            meta = self.txns.get(tid)
            if meta is None or meta.epoch < 0:
                raise TxnError(Refusal.UNKNOWN_TRANSACTIONAL_ID, f"transactional id {tid!r} was never initialised")
            if meta.completing:
                outcome = "commit" if meta.status is TxnStatus.PREPARE_COMMIT else "abort"
                raise TxnError(
                    Refusal.INVALID_STATE,
                    f"transaction {meta.txn} of {tid!r} (epoch {meta.epoch}) is already decided ({outcome}) and "
                    "being finished by the server; nothing was aborted",
                    txn=meta.txn,
                )
            if meta.status is not TxnStatus.ONGOING:
                raise TxnError(
                    Refusal.INVALID_STATE,
                    f"transactional id {tid!r} has no open transaction (epoch {meta.epoch}, transaction "
                    f"{meta.txn}: {meta.status.value}); nothing was aborted",
                    txn=meta.txn,
                )
            if (epoch is not None and epoch != meta.epoch) or (txn is not None and txn != meta.txn):
                raise TxnError(
                    Refusal.STALE_TRANSACTION,
                    f"the open transaction of {tid!r} is transaction {meta.txn} of epoch {meta.epoch}, not "
                    f"{txn if txn is not None else meta.txn} of epoch {epoch if epoch is not None else meta.epoch}; "
                    "nothing was aborted",
                    txn=meta.txn,
                )
            aborted = (meta.epoch, meta.txn)
            log.warning(
                "aborting transaction %d of %r on an operator's request; fencing epoch %d", meta.txn, tid, meta.epoch
            )
            await self._finish_decided(meta, self._fence(meta, meta.epoch))
            return aborted

    # ------------------------------------------------------------------ groups and ids in memory
    #
    # What the records of groups and ids do to memory, in replay and live (the requests that write
    # them: core/groups.py).

    def _forget(self, stream: str) -> None:
        for offsets in self.groups.values():
            offsets.pop(stream, None)
        for meta in self.txns.values():
            for offsets in meta.offsets.values():
                offsets.pop(stream, None)

    def _apply_offsets(self, offsets: dict[str, dict[str, str]]) -> None:
        for group, streams in offsets.items():
            g = self.groups.setdefault(group, {})
            for stream, off in streams.items():
                if stream not in g or off > g[stream]:
                    g[stream] = off

    def _drop_group(self, group: str) -> None:
        self.groups.pop(group, None)
        self.member_epochs.pop(group, None)
        for meta in self.txns.values():
            meta.offsets.pop(group, None)

    def _drop_txn(self, tid: str, floor: int) -> None:
        prev = self.txns.pop(tid, None)
        if prev is not None and prev.status is TxnStatus.PREPARE_COMMIT:
            # Replay only (live, the id was complete): its commit's completion record was lost,
            # and the id is dropped after it, as a later record of the id would come after it
            # (_replay): the commit completed, its offsets take effect.
            self._apply_offsets(prev.offsets)
        self.epoch_floor = max(self.epoch_floor, floor)


def _complete(meta: TxnMeta) -> bool:
    """Nothing of the id is open or being decided: its offsets, if any, are applied."""
    return meta.status in (TxnStatus.EMPTY, TxnStatus.COMPLETE_COMMIT, TxnStatus.COMPLETE_ABORT)


_DONE = frozenset(s.value for s in (TxnStatus.EMPTY, TxnStatus.COMPLETE_COMMIT, TxnStatus.COMPLETE_ABORT))


# Every kind of coordinator record and the one method that gives it its meaning, in replay and,
# where the live path applies a record after writing it, there too (docs/transactions.md,
# "Coordinator records").
RECORDS: dict[str, str] = {
    "txn": "_apply_txn",
    "members": "_apply_members",
    "offsets": "_apply_offsets_record",
    "sink": "_apply_sink",
    "forget": "_apply_forget",
    "drop_group": "_apply_drop_group",
    "drop_txn": "_apply_drop_txn",
    "epoch_floor": "_apply_epoch_floor",
}


def _take_back(meta: TxnMeta, before: dict[str, Any]) -> None:
    """Give ``meta`` back the fields ``before`` names: its record, applied when staged, did not
    reach the log (the log rolled the failed write back). An undo of a move never stored, not a
    transition."""
    for name, value in before.items():
        setattr(meta, name, value)


def _count(counts: dict[str, int], names: list[str], by: int) -> None:
    """Add ``by`` to each name's count; a count that reaches 0 goes."""
    for name in names:
        left = counts.get(name, 0) + by
        if left:
            counts[name] = left
        else:
            del counts[name]


def _txn_groups(rec: dict[str, Any]) -> list[str]:
    """The groups a record of a transaction not complete carries offsets for (a ``members`` record
    holds such records). A completion's offsets are applied when it is staged: none is pending."""
    kind = rec.get("kind")
    if kind == "txn":
        return [] if rec["status"] in _DONE else list(rec["offsets"])
    if kind == "members":
        return [g for m in rec["members"] for g in _txn_groups(m)]
    return []


def _offset_streams(rec: dict[str, Any]) -> list[str]:
    """The streams a coordinator record names offsets of (a ``members`` record holds txn records)."""
    kind = rec.get("kind")
    if kind == "offsets":
        return list(rec["offsets"])
    if kind == "txn":
        return [st for offsets in rec["offsets"].values() for st in offsets]
    if kind == "members":
        return [st for m in rec["members"] for st in _offset_streams(m)]
    return []
