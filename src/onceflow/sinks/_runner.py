"""SinkRunner: a plain consumer feeding a sink, checkpoint after checkpoint, acknowledging late.

The input is read with a :class:`~onceflow.client.Consumer` that never commits by itself; the
runner acknowledges (commits the consumer group's offsets) only after the sink has committed a
checkpoint: *defer ack until checkpoint*. So "acknowledged but not written" never happens, and
every other crash window is closed by the sink's kind (see ``_api.py`` and docs/sinks.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from ..client import ConflictError, Consumer, GroupOffsetStore, Message, OffsetStore
from ..client.lowlevel import ServerURL, server_url
from ._api import Checkpoint, CheckpointAwareSink, CheckpointStore, SinkError, Step, TwoPhaseCommitSink

__all__ = ["RunStats", "SinkRunner"]

log = logging.getLogger("onceflow.sinks")

StepCallback = Callable[[Step, int], None]


@dataclass(frozen=True, slots=True)
class RunStats:
    """What one :meth:`SinkRunner.run` did. ``restored`` is the checkpoint it started from (0: none);
    ``replayed`` is True when that checkpoint was not committed and its input was read again."""

    restored: int
    replayed: bool
    checkpoints: int
    messages: int


class _StartOffsets:
    """The consumer's offset store during a run: the restored checkpoint's offsets, then (when the
    acknowledged group offsets are the only checkpoint there is) the group's, then none (the start
    policy). The consumer never commits through it (it runs with ``delivery="exactly-once"``)."""

    def __init__(self, offsets: Mapping[str, str], fallback: OffsetStore | None) -> None:
        self.offsets = dict(offsets)
        self.fallback = fallback

    def load(self, group: str, stream: str) -> str | None:
        if stream in self.offsets:
            return self.offsets[stream]
        return None if self.fallback is None else self.fallback.load(group, stream)

    def commit(self, group: str, offsets: Mapping[str, str]) -> None:
        raise SinkError("the runner acknowledges offsets itself, after the sink committed")


class SinkRunner:
    """Reads ``streams`` (or every stream under ``prefix``) of the onceflow server at ``base_url``
    and feeds them to ``sink`` in checkpoints of up to ``checkpoint_messages`` messages or
    ``checkpoint_interval`` seconds.

    Offsets (where a restart resumes) live, in this order of precedence:

    - in the sink, when it is atomic (it stores them with its output);
    - in ``checkpoints``, a :class:`CheckpointStore` (required by two-phase commit sinks: the
      checkpoint carries their transaction handles);
    - in the acknowledged consumer-group offsets (``ack``), which is enough for idempotent sinks.

    ``ack`` is where the runner acknowledges each committed checkpoint: the server's consumer
    group ``group`` (default: ``job``) unless another :class:`~onceflow.client.OffsetStore` or
    None is given. It is written last, so it never runs ahead of the sink.

    :meth:`run` restores, then processes until the input is caught up (``live=False``) or forever,
    and raises on any error. Calling it again (on this runner or a new one: a restarted process)
    restores and continues exactly once. ``on_step(step, checkpoint_id)`` is called at each
    :data:`~onceflow.sinks.Step` (metrics, logs, fault injection in tests).
    """

    def __init__(
        self,
        base_url: ServerURL,
        sink: CheckpointAwareSink,
        *,
        job: str,
        streams: Sequence[str] | None = None,
        prefix: str | None = None,
        checkpoints: CheckpointStore | None = None,
        ack: OffsetStore | Literal["group"] | None = "group",
        group: str | None = None,
        checkpoint_messages: int = 1000,
        checkpoint_interval: float = 1.0,
        live: bool = False,
        start: Literal["earliest", "latest"] = "earliest",
        max_read_bytes: int | None = None,
        on_step: StepCallback | None = None,
    ) -> None:
        if not isinstance(sink, CheckpointAwareSink):
            raise TypeError(f"sink must be a CheckpointAwareSink, not {type(sink).__name__}")
        if (streams is None) == (prefix is None):
            raise ValueError("give either streams=[...] or prefix=...")
        if not job:
            raise ValueError("job must name the pipeline (it keys its checkpoints)")
        if checkpoint_messages < 1 or checkpoint_interval <= 0:
            raise ValueError("checkpoint_messages must be >= 1 and checkpoint_interval > 0")
        if sink.atomic and checkpoints is not None:
            raise ValueError(f"{type(sink).__name__} stores its checkpoints with its output; do not give checkpoints=")
        if isinstance(sink, TwoPhaseCommitSink) and not sink.atomic and checkpoints is None:
            raise ValueError(
                f"{type(sink).__name__} is a two-phase commit sink: give checkpoints=<a CheckpointStore> "
                "to keep its transaction handles"
            )
        self.base_url = server_url(base_url).rstrip("/")
        self.sink = sink
        self.job = job
        self.group = group or job
        self.streams = None if streams is None else list(streams)
        self.prefix = prefix
        self.checkpoints = checkpoints
        self.ack: OffsetStore | None = GroupOffsetStore(self.base_url) if ack == "group" else ack
        if not sink.atomic and checkpoints is None and self.ack is None:
            raise ValueError("nowhere to keep the offsets: give checkpoints=<a CheckpointStore> or an ack store")
        # offsets live in one place: the sink, the checkpoint store, or else the acknowledged group
        self._offsets_in_ack = not sink.atomic and checkpoints is None
        self.checkpoint_messages = checkpoint_messages
        self.checkpoint_interval = checkpoint_interval
        self.live = live
        self.start = start
        self.max_read_bytes = max_read_bytes
        self.on_step = on_step

    # ------------------------------------------------------------------ steps

    def _step(self, step: Step, checkpoint_id: int) -> None:
        log.debug("job %s checkpoint %d: %s", self.job, checkpoint_id, step)
        if self.on_step is not None:
            self.on_step(step, checkpoint_id)

    def _acknowledge(self, offsets: Mapping[str, str]) -> None:
        if self.ack is None or not offsets:
            return
        try:
            self.ack.commit(self.group, offsets)
        except ConflictError as exc:  # 409: the group's offsets would move backwards
            raise SinkError(
                f"group {self.group!r} was acknowledged beyond job {self.job!r}'s checkpoint; the group "
                f"must belong to this job alone ({exc.message})"
            ) from exc

    def _abort(self, checkpoint_id: int, error: BaseException) -> None:
        """Step 3a: undo an unsaved checkpoint; a failure here is noted on ``error``, not raised."""
        try:
            self.sink.on_checkpoint_abort(checkpoint_id)
        except Exception as exc:  # noqa: BLE001 - reported on the error being raised
            error.add_note(f"on_checkpoint_abort({checkpoint_id}) failed too: {exc!r}")
            log.warning("job %s: abort of checkpoint %d failed: %r", self.job, checkpoint_id, exc)
            return
        self._step("aborted", checkpoint_id)

    def _restore(self) -> tuple[Checkpoint | None, bool, dict[str, str]]:
        """Step 0: the latest checkpoint, finished or replayed. Returns it, whether its input is
        replayed, and the offsets to resume from."""
        cp = (
            self.sink.load_checkpoint()
            if self.sink.atomic
            else (self.checkpoints.load(self.job) if self.checkpoints is not None else None)
        )
        done = self.sink.on_checkpoint_restore(cp)
        if cp is None:
            self._step("restored", 0)
            return None, False, {}
        if not done:
            log.info("job %s: checkpoint %d was not committed by the sink; replaying its input", self.job, cp.id)
            self._step("restored", cp.id)
            return cp, True, dict(cp.start_offsets)
        if not cp.sink_committed and self.checkpoints is not None:
            self.checkpoints.save(self.job, cp.committed())
        self._acknowledge(cp.offsets)  # repairs an acknowledgement lost in a crash
        self._step("restored", cp.id)
        return cp, False, dict(cp.offsets)

    def _checkpoint(self, checkpoint_id: int, start: dict[str, str], positions: Mapping[str, str]) -> dict[str, str]:
        """Steps 3–7 of one checkpoint; returns its offsets."""
        offsets = {**start, **positions}
        # Step 3: the sink makes what it was given durable (idempotent sinks write it, 2PC prepares)
        try:
            handle = self.sink.on_checkpoint_prepare(checkpoint_id)
        except BaseException as exc:
            self._abort(checkpoint_id, exc)
            raise
        self._step("prepared", checkpoint_id)
        cp = Checkpoint(checkpoint_id, offsets, dict(start), handle)
        if self.sink.atomic:
            # Steps 4-6 as one: the sink commits its output together with the checkpoint
            try:
                self.sink.on_checkpoint_complete(cp.committed())
            except BaseException as exc:
                self._abort(checkpoint_id, exc)
                raise
            self._step("committed", checkpoint_id)
        else:
            if self.checkpoints is not None:
                # Step 4: the decision; from here on a restore commits this checkpoint, never aborts it
                self.checkpoints.save(self.job, cp)
                self._step("saved", checkpoint_id)
            # Step 5: the sink commits
            self.sink.on_checkpoint_complete(cp)
            self._step("committed", checkpoint_id)
            if self.checkpoints is not None:
                # Step 6
                self.checkpoints.save(self.job, cp.committed())
                self._step("marked", checkpoint_id)
        # Step 7: the deferred acknowledgement
        if self.ack is not None:
            self._acknowledge(offsets)
            self._step("acked", checkpoint_id)
        return offsets

    # ------------------------------------------------------------------ the loop

    def run(self, *, max_checkpoints: int | None = None) -> RunStats:
        """Restore, then process checkpoint after checkpoint.

        Step 0: restore (commit a saved 2PC checkpoint, abort stray prepared transactions, repair
        the acknowledgement, or replay an uncommitted checkpoint). Then, per checkpoint N:

        1. ``on_checkpoint_start(N)`` with the first messages of N
        2. ``write(messages)`` for each read, until N is full or due
        3. ``on_checkpoint_prepare(N)``; any error in 1–3 calls ``on_checkpoint_abort(N)``
        4. save N (offsets, start offsets, handle) in the checkpoint store
        5. ``on_checkpoint_complete(N)`` (atomic sinks: 4–6 happen here, in one write)
        6. mark N ``sink_committed``
        7. acknowledge N's offsets to the consumer group

        Returns at the end of the input when not live, or after ``max_checkpoints``.
        """
        restored, replayed, offsets = self._restore()
        next_id = 1 if restored is None else restored.id + 1
        consumer = Consumer(
            self.base_url,
            group=self.group,
            streams=self.streams,
            prefix=self.prefix,
            store=_StartOffsets(offsets, self.ack if self._offsets_in_ack else None),
            delivery="exactly-once",
            start=self.start,
            live="long-poll" if self.live else None,
            max_read_bytes=self.max_read_bytes,
        )
        done = messages = 0
        try:
            while max_checkpoints is None or done < max_checkpoints:
                n, offsets = self._one_checkpoint(consumer, next_id, offsets)
                if n:
                    next_id += 1
                    done += 1
                    messages += n
                elif not self.live:
                    break
        finally:
            consumer.close()
        return RunStats(0 if restored is None else restored.id, replayed, done, messages)

    def _one_checkpoint(
        self, consumer: Consumer, checkpoint_id: int, start: dict[str, str]
    ) -> tuple[int, dict[str, str]]:
        """Reads and writes one checkpoint; (0, start) when no input came (caught up, or idle)."""
        count = 0
        opened = 0.0
        while True:
            if count:
                timeout: float | None = max(0.0, opened + self.checkpoint_interval - time.monotonic())
            else:
                timeout = self.checkpoint_interval if self.live else None
            try:
                batch: list[Message] = consumer.poll(timeout)
            except BaseException as exc:
                if count:  # a read failed with the checkpoint open: undo what the sink has of it
                    self._abort(checkpoint_id, exc)
                raise
            if batch:
                try:
                    if not count:
                        opened = time.monotonic()
                        self.sink.on_checkpoint_start(checkpoint_id)
                        self._step("started", checkpoint_id)
                    self.sink.write(batch)
                except BaseException as exc:
                    self._abort(checkpoint_id, exc)
                    raise
                count += len(batch)
            if count and (
                not batch or count >= self.checkpoint_messages or time.monotonic() - opened >= self.checkpoint_interval
            ):
                return count, self._checkpoint(checkpoint_id, start, consumer.positions())
            if not batch and not count:
                return 0, start

    def close(self) -> None:
        """Close the sink."""
        self.sink.close()

    def __enter__(self) -> SinkRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
