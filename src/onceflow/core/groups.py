"""Consumer groups' offsets in the coordinator, outside transactions and inside them: commits and
rewinds (``/v1/groups/<group>/offsets``), offsets dropped when a stream's name is taken by a new
stream, and an operator's removal of a group or of a transactional id. What their records do to
memory is the base's (core/txn.py), which replay applies too."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import Any

from .refusal import Refusal
from .txn import Transactions, TxnError, _complete

__all__ = ["GroupOffsets"]


class GroupOffsets(Transactions):
    """The coordinator's requests on groups, and on removing groups and ids."""

    # ------------------------------------------------------------------ deleting groups and ids
    #
    # An operator's act (DELETE /v1/groups/<group>, DELETE /v1/txn/<id>), so that what a client
    # creates can be removed (issue 28). Each is one durable record, applied to memory once it is
    # durable by the same function replay applies it with. That memory then equals replayed memory:
    # the callers of records staged before it apply them before it is applied (their waits end in
    # staging order), those of records staged after it after; the one record applied when staged,
    # a transaction's completion, cannot carry a group being dropped (no transaction that is not
    # complete may hold its offsets, none may be writing a record naming it); an id is dropped
    # only under its own lock, with no transaction of it open or being decided.

    def holds_offsets_of(self, stream: str) -> bool:
        """Whether any offset into ``stream`` is held: a group's committed one, one a transaction
        carries, one in a record not yet durable, or one a forget not known to be durable dropped."""
        return (
            stream in self._in_flight
            or stream in self._unsure
            or stream in self._forgetting
            or any(stream in offsets for offsets in self.groups.values())
            or any(stream in offsets for meta in self.txns.values() for offsets in meta.offsets.values())
        )

    async def forget_stream(self, stream: str) -> None:
        """Drop every offset into ``stream``: each group's committed one and those a transaction
        carries (open, decided or done). The broker calls this before a stream is created under a
        name whose earlier stream was deleted: those offsets are positions of that stream, and a
        consumer resuming at one would skip the new stream's first messages.

        One durable record; memory agrees with the log however the requests of other ids
        interleave. It is changed when the record is staged (a record staged after it, a
        commit's completion included, is written and applied without the stream) and again when
        it is durable (an offsets record staged before it is applied, when durable itself, just
        before); a transaction's offsets built before it and stored after it are stripped of the
        stream (:meth:`_store`). Replay drops the stream where the record stands in the log.
        A transaction's offsets are dropped even when it is done: a compaction writes its record
        again, and replaying that record applies its offsets.

        Callers for one stream share one write: a second create waits for the first's record. A
        record that fails leaves the stream dropped in memory but not on disk: it stays "unsure",
        so the next create writes the record again (a restart meanwhile takes the disk's word)."""
        task = self._forgetting.get(stream)
        if task is None or task.done():  # done: failed, its callback not yet run; write it again
            task = self._forgetting[stream] = asyncio.ensure_future(self._write_forget(stream))
            task.add_done_callback(functools.partial(self._forgot, stream))
        await asyncio.shield(task)

    async def _write_forget(self, stream: str) -> None:
        done = self._stage({"kind": "forget", "stream": stream})
        self._forgotten.append(stream)
        self._unsure.add(stream)
        self._forget(stream)
        self._awaiting += 1
        try:
            await done
        finally:
            self._awaiting -= 1
        self._forget(stream)
        self._unsure.discard(stream)
        if not self._awaiting:  # no record of _store is between its staging and its apply
            self._forgotten.clear()

    def _forgot(self, stream: str, task: asyncio.Task[None]) -> None:
        if self._forgetting.get(stream) is task:
            del self._forgetting[stream]
        if not task.cancelled():
            task.exception()  # retrieved: its callers, if any still wait, get it too

    async def drop_group(self, group: str) -> bool:
        """Forget ``group``: its committed offsets and member epoch, and the offsets completed
        transactions carried for it (a compaction writes those transactions again; replaying them
        must not bring the group back). False when there is no such group. Refused (``in_use``)
        while a transaction holds offsets for it that are not applied yet: one not complete, or
        one whose record naming the group is being written (its offsets would be dropped under
        it, and a copier would copy again what it had committed)."""
        if not self.group_exists(group):
            return False
        held = sum(1 for m in self.txns.values() if group in m.offsets and not _complete(m))
        held += self._in_flight_groups.get(group, 0)
        if held:
            raise TxnError(
                Refusal.IN_USE,
                f"group {group!r} has offsets in {held} transaction(s) not complete; it can be deleted once they end",
            )
        await self._write({"kind": "drop_group", "group": group})
        self._drop_group(group)
        return True

    async def drop_txn(self, tid: str) -> bool:
        """Forget the transactional id ``tid`` when it has no transaction open or being decided,
        nor a sink's batch that enlisted it; False when there is no such id. Its epochs are not
        forgotten: ``epoch_floor`` moves past them, so the id, initialised again, begins above
        them, and the streams, which keep the producer state of ``txn:<id>``, take its appends."""
        async with self._lock(tid):
            meta = self.txns.get(tid)
            if meta is None:
                return False
            if not _complete(meta) or any(tid in tasks for tasks in self._enlisted.values()):
                raise TxnError(
                    Refusal.IN_USE,
                    f"transactional id {tid!r} has a transaction that is not complete "
                    f"(transaction {meta.txn}: {meta.status.value}), or a sink's batch holds it; "
                    "end or abort it first (onceflow txn abort)",
                )
            floor = max(self.epoch_floor, meta.epoch + 1)
            await self._write({"kind": "drop_txn", "tid": tid, "floor": floor})
            self._drop_txn(tid, floor)
            return True

    async def commit_offsets(
        self, group: str, offsets: dict[str, str], *, member_epoch: int | None = None, reset: bool = False
    ) -> None:
        """Commit offsets outside a transaction. Monotonic unless ``reset``; a ``member_epoch``
        lower than one already seen for the group is a zombie's and is refused."""
        if member_epoch is not None and member_epoch < self.member_epochs.get(group, -1):
            raise TxnError(
                Refusal.FENCED,
                f"member epoch {member_epoch} of group {group!r} was fenced by {self.member_epochs[group]}",
                epoch=self.member_epochs[group],
            )
        with contextlib.ExitStack() as new:
            if not self.group_exists(group):
                new.enter_context(self._creating("groups", group, len(self.groups)))
            await self._commit_offsets(group, offsets, member_epoch, reset)

    async def _commit_offsets(self, group: str, offsets: dict[str, str], member_epoch: int | None, reset: bool) -> None:
        current = self.groups.get(group, {})
        if not reset:
            back = [s for s, off in offsets.items() if s in current and off < current[s]]
            if back:
                raise TxnError(
                    Refusal.OFFSET_REGRESSION, f"offsets of {back} would move backwards; pass reset to rewind"
                )
        rec: dict[str, Any] = {
            "kind": "offsets",
            "group": group,
            "offsets": offsets,
            "member_epoch": member_epoch,
            "reset": reset,
        }
        await self._write(rec)
        self._apply_offsets_record(rec)
