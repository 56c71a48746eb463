"""Many transactions, one decision: a batch that many writers (the Spark sink's tasks) each write in
a transaction of their own, committed or aborted by one request (``/v1/sinks/<sink>``,
docs/transactions.md and docs/spark.md), and the tasks' transactional ids the coordinator hands
out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from .groups import GroupOffsets
from .refusal import Refusal
from .txn import SINK_TASK_PREFIX, Enlisted, SinkState, TxnError, TxnMeta, TxnStatus, _complete, _take_back

__all__ = ["Batches"]

log = logging.getLogger("onceflow.txn")


class Batches(GroupOffsets):
    """The coordinator's requests on sinks' batches."""

    # ------------------------------------------------------------------ many transactions, one decision
    #
    # Sinks (the Spark connector's, see docs/spark.md): many writers (a batch's tasks) each write in
    # a transaction of their own and one request commits all of them. Lock order, for everything
    # here: first the sink's lock ("sink\0<id>"), then every transactional id's lock the operation
    # needs, all at once in sorted order (``_locked``), and no further lock after that. Every other
    # operation of the coordinator holds one id's lock at a time and never a sink's, so no two
    # operations can wait on each other in a cycle.

    def task_id(self, sink: str, partition: int, task: str, query: str | None) -> str:
        """The transactional id :meth:`begin_task` gives ``task``: the one it holds already (a
        retry), else ``spark/<sink>/p<partition>/s<slot>`` with the lowest slot no other task of
        the sink holds. The guard asks it too: a new id counts against its limit."""
        tasks = self._enlisted.get(sink, {})
        tid = next((t for t, e in tasks.items() if e.query == query and e.task == task), None)
        if tid is not None:
            return tid
        slot = 0
        while f"spark/{sink}/p{partition}/s{slot}" in tasks:
            slot += 1
        return f"spark/{sink}/p{partition}/s{slot}"

    def knows_sink(self, sink: str) -> bool:
        """Whether ``sink`` has a record or a task begun (what the sinks limit counts)."""
        return sink in self.sinks or bool(self._enlisted.get(sink))

    def sink_count(self) -> int:
        return len(set(self.sinks) | {s for s, tasks in self._enlisted.items() if tasks})

    def _sink_lock(self, sink: str) -> AbstractAsyncContextManager[None]:
        return self._lock("sink\0" + sink)

    def _check_owner(self, sink: str, state: SinkState | None, query: str | None) -> None:
        """Refuse a writer of a query that is not the one the sink belongs to."""
        if state is None or state.owner is None or state.owner == query:
            return
        who = f"query {query}" if query is not None else "a writer that names no query"
        raise TxnError(
            Refusal.SINK_OWNED,
            f"sink {sink!r} belongs to query {state.owner} (its last committed batch: {state.batch}); this write comes "
            f"from {who}. A sink records the batches of one query: give a new checkpoint location or another query "
            f"a sinkId of its own, or reset this sink on purpose (stop its query, then POST /v1/sinks/{sink}/reset "
            f'with {{"owner": "{state.owner}"}}; its batch ids then start afresh)',
            owner=state.owner,
            batch=state.batch,
        )

    def _tasks_of(self, sink: str, query: str | None, batch: int | None) -> dict[str, Enlisted]:
        """The task transactions that ``query`` began for ``sink`` in batches up to ``batch``
        (every batch when ``batch`` is None)."""
        return {
            tid: e
            for tid, e in self._enlisted.get(sink, {}).items()
            if e.query == query and (batch is None or e.batch is None or e.batch <= batch)
        }

    def _tasks_of_others(self, sink: str, query: str | None) -> set[str]:
        return {tid for tid, e in self._enlisted.get(sink, {}).items() if e.query != query}

    async def begin_task(
        self,
        sink: str,
        *,
        partition: int,
        task: str,
        batch: int | None,
        query: str | None,
        txn_timeout: float | None,
    ) -> tuple[TxnMeta | None, SinkState | None]:
        """Begin one task's part of batch ``batch`` of ``sink`` (the first request of a task).

        1. The sink must belong to ``query`` (or to no query yet): else ``sink_owned``.
        2. A batch at or below the sink's last committed one is a replay: returns ``(None, state)``
           and the task writes nothing.
        3. Otherwise the task gets a transactional id of the sink, ``spark/<sink>/p<partition>/s<slot>``
           with the lowest slot no other task of the sink holds, is registered as a task of the
           batch, and the id is initialised (a new epoch fences whatever its previous holder left).
           Returns ``(meta, state)``: the task writes with that id and epoch, never with an init of
           its own (which would escape step 4).
        4. Every task of ``query`` that began here and is not among the members of the batch's
           commit or abort is then fenced by it: a late or speculative attempt cannot open a
           transaction after its batch was decided. One that begins after the commit is told so
           by step 2.

        ``task`` names the task attempt uniquely (the Spark sink: a random id of the write job and
        Spark's task attempt id). The same ``task`` again (a retry after a lost answer) gets the same
        id and epoch back, and fences nothing. Slots are bounded by the tasks of the sink running at
        once; they are kept in memory only (after a restart, ids are handed out afresh, and a task
        that began before it is no member of anything a commit accepts).
        """
        async with self._sink_lock(sink):
            with contextlib.ExitStack() as new:
                if not self.knows_sink(sink):
                    new.enter_context(self._creating("sinks", sink, self.sink_count()))
                return await self._begin_task(sink, partition, task, batch, query, txn_timeout)

    async def _begin_task(
        self, sink: str, partition: int, task: str, batch: int | None, query: str | None, txn_timeout: float | None
    ) -> tuple[TxnMeta | None, SinkState | None]:
        state = self.sinks.get(sink)
        self._check_owner(sink, state, query)
        if batch is not None and state is not None and state.batch is not None and batch <= state.batch:
            return None, state
        tasks = self._enlisted.setdefault(sink, {})
        tid = self.task_id(sink, partition, task, query)
        meta = await self.init(tid, txn_timeout, request_id=f"sink-task\0{query}\0{task}")
        tasks[tid] = Enlisted(query, task, batch, meta.epoch)
        self.keep_alive(sink, query, batch)  # a task of the batch is at work from now on
        return meta, state

    def keep_alive(self, sink: str, query: str | None, batch: int | None) -> int:
        """A task of ``batch`` of ``sink`` is still at work: the open transactions of that batch's
        tasks are as young as now, so the timeout does not abort the part of a batch that finished
        early while its slowest task still runs (the timeout is for writers that are gone: when no
        task of the batch is alive, none keeps them). Returns how many were kept."""
        kept = 0
        now = self.clock.monotonic()
        for tid, e in self._enlisted.get(sink, {}).items():
            meta = self.txns.get(tid)
            if (
                e.query == query
                and e.batch == batch
                and meta is not None
                and meta.epoch == e.epoch
                and meta.status is TxnStatus.ONGOING
            ):
                meta.started = now
                kept += 1
        return kept

    async def commit_members(
        self,
        sink: str,
        batch: int | None,
        members: list[tuple[str, int, int]],
        abort_prefix: str | None = None,
        *,
        query: str | None = None,
        fingerprint: str | None = None,
        rows: int | None = None,
    ) -> tuple[bool, int | None]:
        """Commit several open transactions ``(tid, epoch, txn)`` as one decision: a single durable
        record is the commit point for all of them, so readers see all of their data or none.

        This is how many writers (the tasks of a Spark micro-batch) publish one batch atomically.
        With ``batch`` the decision also records that ``sink`` committed that batch, and a batch at
        or below the sink's last committed one is not committed again (a replay after a crash):
        its members are aborted instead. Open transactions whose id starts with ``abort_prefix`` and
        that are not members (the leftovers of failed or speculative attempts) are aborted.
        Returns (committed now, the sink's last committed batch).

        0. The same decision again (same batch, same members at the same epochs and transactions,
           same query) is a retry after a lost answer: answered committed, nothing changes.
        1. ``query`` must be the query the sink belongs to (bound by its first commit that names
           one), else ``sink_owned`` and only the caller's own tasks are aborted.
        ``rows``: how many rows the members wrote (the writers' count), shown with the sink.
        2. A replay of the last batch whose ``fingerprint`` (of the rows its tasks were given)
           differs from the one recorded with it is refused (``replay_mismatch``): the batch was
           planned over other input, and skipping it on its id alone would lose or double rows.
        3. The decision record (members, batch, query, fingerprint) is synced: the commit point.
        4. Markers; then the batch's other tasks are fenced (``begin_task``) and the leftovers
           under ``abort_prefix`` aborted.
        """
        decision = tuple(sorted(members))
        tids = sorted({tid for tid, _, _ in members})
        if len(tids) != len(members):
            raise TxnError(Refusal.BAD_REQUEST, "a transactional id appears twice among the members")
        async with self._sink_lock(sink):
            state = self.sinks.get(sink)
            if not self.knows_sink(sink):  # a commit of a sink that never began: it creates one
                self._within("sinks", self.sink_count() + len(self._pending.get("sinks", ())))
            others = self._tasks_of_others(sink, query)
            strangers = sorted(set(tids) & others)
            if strangers:
                raise TxnError(Refusal.SINK_OWNED, f"members {strangers} of sink {sink!r} were begun by another query")
            mine = self._tasks_of(sink, query, batch)
            sweep = self._leftovers(abort_prefix, others)
            async with self._locked(sorted(set(tids) | set(mine) | set(sweep))):
                # Step 0: a retry of the decision that committed.
                if state is not None and state.decision == decision and state.batch == batch and state.owner == query:
                    return True, state.batch
                # Step 1: the sink's query.
                try:
                    self._check_owner(sink, state, query)
                except TxnError:
                    await self._abort_tasks(sink, members, mine, [])
                    raise
                # Step 2: a replay.
                done = state.batch if state is not None else None
                if batch is not None and done is not None and batch <= done:
                    assert state is not None
                    await self._abort_tasks(sink, members, mine, sweep)
                    if (
                        batch == done
                        and fingerprint is not None
                        and state.fingerprint is not None
                        and fingerprint != state.fingerprint
                    ):
                        raise TxnError(
                            Refusal.REPLAY_MISMATCH,
                            f"batch {batch} of sink {sink!r} was committed with rows {state.fingerprint} (count-checksum), "
                            f"and is being replayed with rows {fingerprint}: the batch was planned over other input (a lost "
                            "or edited offset log?) or the query's output is not deterministic. Nothing was written. Skipping "
                            "it would lose or double rows; if the new output is right, reset the sink on purpose "
                            f"(POST /v1/sinks/{sink}/reset), or turn the check off (option verifyReplay false)",
                        )
                    return False, done
                prepared: list[TxnMeta] = []
                for tid, epoch, txn in members:
                    try:
                        meta = self._current(tid, epoch)
                        if txn != meta.txn:
                            raise TxnError(
                                Refusal.STALE_TRANSACTION,
                                f"transaction {txn} of {tid!r} is not the current one ({meta.txn})",
                                txn=meta.txn,
                            )
                        if meta.status is TxnStatus.EMPTY and txn == 0:
                            continue  # the member wrote nothing
                        if meta.status is not TxnStatus.ONGOING:
                            raise TxnError(
                                Refusal.INVALID_STATE,
                                f"transaction {txn} of {tid!r} already ended as {meta.status.value}",
                            )
                    except TxnError:
                        await self._abort_tasks(sink, members, mine, sweep)
                        raise
                    prepared.append(meta)
                # Step 3: the commit point of every member.
                # A write that fails leaves them undecided after all (each move is taken back):
                # still open, a retry may commit them.
                # The members move when the record is staged, as a decision does (_transition).
                rec: dict[str, Any] = {
                    "kind": "members",
                    "sink": sink,
                    "batch": batch,
                    "members": [self._record_of(m, TxnStatus.PREPARE_COMMIT, {}) for m in prepared],
                    "query": query,
                    "fingerprint": fingerprint,
                    "decision": [list(m) for m in decision],
                    "rows": rows,
                }
                staged = self._stage(rec)
                for meta, member in zip(prepared, rec["members"], strict=True):
                    self._apply_txn(member, meta)
                try:
                    await self._wait(staged)
                except OSError:
                    for meta in prepared:
                        _take_back(meta, {"status": TxnStatus.ONGOING})
                    raise
                self._replay_decision(rec)  # as replay applies it (a batch here is above the last)
                # Step 4: markers, then the rest of the batch's tasks and the leftovers.
                await asyncio.gather(*(self._complete(meta) for meta in prepared))
                await self._abort_tasks(sink, [], {t: e for t, e in mine.items() if t not in tids}, sweep, release=tids)
                return True, self.sinks[sink].batch

    async def abort_members(
        self,
        sink: str,
        members: list[tuple[str, int, int]],
        abort_prefix: str | None = None,
        *,
        query: str | None = None,
        batch: int | None = None,
    ) -> None:
        """Abort the members that are still open, fence the other tasks ``query`` began for batches
        up to ``batch`` of ``sink``, and abort every open transaction under ``abort_prefix``. A
        query the sink does not belong to aborts its own tasks only: never the prefix, never
        another query's tasks."""
        async with self._sink_lock(sink):
            state = self.sinks.get(sink)
            others = self._tasks_of_others(sink, query)
            members = [m for m in members if m[0] not in others]
            owner = state is None or state.owner is None or state.owner == query
            mine = self._tasks_of(sink, query, batch)
            sweep = self._leftovers(abort_prefix, others) if owner else []
            async with self._locked(sorted({tid for tid, _, _ in members} | set(mine) | set(sweep))):
                await self._abort_tasks(sink, members, mine, sweep)

    async def reset_sink(self, sink: str, owner: str | None) -> None:
        """Forget ``sink``'s record (its last batch, its query) on purpose, so that another query,
        or this one from a new checkpoint, can write under its id; batch ids start afresh.

        ``owner`` must name the query the sink belongs to now (None for a sink bound to none), so a
        reset is a deliberate act about a known state: a stale or repeated reset after another
        query took the sink is refused (``sink_owned``); one of a sink already forgotten is a no-op.
        Every open transaction of the sink's tasks (``spark/<sink>/``) is aborted and every task
        begun is fenced first; then a synced record forgets the sink, and one more each of its
        tasks' transactional ids (:meth:`drop_txn`)."""
        async with self._sink_lock(sink):
            state = self.sinks.get(sink)
            if state is not None and state.owner != owner:
                raise TxnError(
                    Refusal.SINK_OWNED,
                    f"sink {sink!r} belongs to query {state.owner}, not {owner}: nothing was reset",
                    owner=state.owner,
                    batch=state.batch,
                )
            tasks = dict(self._enlisted.get(sink, {}))
            ids = [t for t in self.txns if _task_of(t, sink)]
            sweep = [t for t in ids if self.txns[t].status is TxnStatus.ONGOING]  # not another sink's
            async with self._locked(sorted(set(tasks) | set(sweep) | set(ids))):
                await self._abort_tasks(sink, [], tasks, sweep)
                if state is not None:
                    forget = {"kind": "sink", "sink": sink, "reset": True}
                    await self._write(forget)
                    self._apply_sink(forget)
                self._enlisted.pop(sink, None)
                # and its tasks' ids, now that nothing of them is open: each at most once per
                # partition and slot, but they would outlive the sink (drop_txn)
                for tid in ids:
                    meta = self.txns.get(tid)
                    if meta is not None and _complete(meta):
                        floor = max(self.epoch_floor, meta.epoch + 1)
                        await self._write({"kind": "drop_txn", "tid": tid, "floor": floor})
                        self._drop_txn(tid, floor)

    def _leftovers(self, prefix: str | None, others: set[str]) -> list[str]:
        """The open transactions under ``prefix`` (not begun by another query): the leftovers of
        failed or speculative attempts. Taken as one snapshot before the locks."""
        if not prefix:
            return []
        return [
            tid
            for tid, m in self.txns.items()
            if tid.startswith(prefix) and m.status is TxnStatus.ONGOING and tid not in others
        ]

    async def _abort_tasks(
        self,
        sink: str,
        members: list[tuple[str, int, int]],
        tasks: dict[str, Enlisted],
        sweep: list[str],
        *,
        release: Sequence[str] = (),
    ) -> None:
        """Abort the members still open at the named epoch and transaction, fence ``tasks`` (tasks
        begun with ``begin_task`` that are not members: their epoch moves on, so a late attempt can
        no longer open a transaction) and abort what is still open in ``sweep``. The caller holds
        the sink's lock and the locks of all of them. ``tasks`` and ``release`` stop being tasks of
        the sink (their slots are free again)."""
        for tid, epoch, txn in members:
            meta = self.txns.get(tid)
            if meta is not None and meta.epoch == epoch and meta.txn == txn and meta.status is TxnStatus.ONGOING:
                await self._finish(meta, commit=False)
        for tid, e in sorted(tasks.items()):
            meta = self.txns.get(tid)
            if meta is not None and meta.epoch == e.epoch:
                log.info("fencing task transaction %r of sink %r: not a member of its batch's decision", tid, sink)
                await self._fence(meta, meta.epoch)
        for tid in sweep:
            meta = self.txns.get(tid)  # the sweep was taken before the locks: deleted meanwhile?
            if meta is not None and meta.status is TxnStatus.ONGOING:
                log.info("aborting transaction %d of %r: a leftover of sink %r", meta.txn, tid, sink)
                await self._finish(meta, commit=False)
        enlisted = self._enlisted.get(sink, {})
        for tid in [*tasks, *release]:
            enlisted.pop(tid, None)


_TASK_SLOT = re.compile(r"p[0-9]+/s[0-9]+")


def _task_of(tid: str, sink: str) -> bool:
    """Whether ``tid`` is an id :meth:`Coordinator.begin_task` hands out for ``sink``'s tasks
    (``spark/<sink>/p<n>/s<m>``; not those of a sink whose id ``sink/`` begins)."""
    prefix = f"{SINK_TASK_PREFIX}{sink}/"
    return tid.startswith(prefix) and _TASK_SLOT.fullmatch(tid, len(prefix)) is not None
