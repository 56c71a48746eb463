"""The sink API: checkpoints, checkpoint stores, and the three kinds of exactly-once sinks.

A *checkpoint* is a consistent recovery point of one job: the input offsets up to which the sink
holds the output. :class:`~onceflow.sinks.SinkRunner` drives a sink through its hooks, checkpoint
after checkpoint::

    restore ─▶ start(N) ─▶ write … write ─▶ prepare(N) ─▶ [checkpoint N saved] ─▶ complete(N) ─▶ ack
                   └──────────── abort(N) on an error before the save ────────────┘

The kinds, and the fault window each one closes (see docs/sinks.md):

- :class:`IdempotentSink`: every effect has a stable idempotency key; the effects are written at
  *prepare*, before the checkpoint and the acknowledgement. A crash anywhere replays input whose
  effects the target already holds, and the keys absorb them.
- :class:`TwoPhaseCommitSink`: effects go into a sink transaction that *prepare* makes durable but
  invisible; the checkpoint stores its handle; *complete* commits it. A restore commits the
  transaction of a checkpoint that was saved but not completed (``recover_and_commit``) and aborts
  transactions prepared for a checkpoint that was never saved (``recover_and_abort``).
- atomic sinks (``atomic = True``: PostgreSQL rows + offsets in one transaction, the Redis Lua
  script, the onceflow outbox): the sink stores the checkpoint itself, in the same atomic write as
  the output, so "output written" and "input consumed" are one decision.
"""

from __future__ import annotations

import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Generic, Literal, Protocol, TypeVar

from .._files import replace_file
from ..client import Message
from ..errors import OnceflowError

__all__ = [
    "Checkpoint",
    "CheckpointAwareSink",
    "CheckpointStore",
    "FileCheckpointStore",
    "IdempotentSink",
    "KeyFunction",
    "MemoryCheckpointStore",
    "SinkError",
    "SinkFencedError",
    "Step",
    "TwoPhaseCommitSink",
    "key_function",
]

Step = Literal["restored", "started", "prepared", "saved", "committed", "marked", "acked", "aborted"]
"""The points of :class:`~onceflow.sinks.SinkRunner`'s checkpoint cycle reported to ``on_step``:

``restored``  the restore finished (checkpoint id: the one restored, 0 for none)
``started``   ``on_checkpoint_start`` returned
``prepared``  ``on_checkpoint_prepare`` returned (idempotent sinks: the effects are written)
``saved``     the checkpoint (offsets + transaction handle) is in the checkpoint store
``committed`` ``on_checkpoint_complete`` returned: the sink committed (atomic sinks: output and
              checkpoint together)
``marked``    the checkpoint is marked ``sink_committed`` in the store
``acked``     the offsets are committed to the consumer group (the deferred acknowledgement)
``aborted``   ``on_checkpoint_abort`` returned after an error before ``saved``
"""


class SinkError(OnceflowError):
    """A sink cannot continue: misuse, a broken invariant, or an effect the target refused."""


class SinkFencedError(SinkError):
    """Another runner of the same job committed in between (a zombie, or two runners at once).

    This runner must stop: its checkpoint would overwrite the other runner's progress."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A recovery point of one job.

    ``offsets`` is the next offset to read per input stream once this checkpoint's effects are in
    the sink; ``start_offsets`` where its input began (the previous checkpoint's offsets), so a
    restore can replay it. ``handle`` is the sink's transaction handle (JSON-serialisable; only
    two-phase commit sinks set it). ``sink_committed`` is set once the sink has committed it.
    """

    id: int
    offsets: dict[str, str]
    start_offsets: dict[str, str] = field(default_factory=dict)
    handle: Any = None
    sink_committed: bool = False

    def committed(self) -> Checkpoint:
        return replace(self, sink_committed=True)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "offsets": self.offsets,
            "start_offsets": self.start_offsets,
            "handle": self.handle,
            "sink_committed": self.sink_committed,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Checkpoint:
        return cls(
            int(data["id"]),
            dict(data["offsets"]),
            dict(data.get("start_offsets") or {}),
            data.get("handle"),
            bool(data.get("sink_committed", False)),
        )


class CheckpointStore(Protocol):
    """Where a job's latest checkpoint is kept. ``save`` must be durable when it returns."""

    def load(self, job: str) -> Checkpoint | None: ...

    def save(self, job: str, checkpoint: Checkpoint) -> None: ...


class MemoryCheckpointStore:
    """Checkpoints in memory (tests; a process that restarts loses them)."""

    def __init__(self) -> None:
        self._data: dict[str, Checkpoint] = {}
        self._lock = threading.Lock()

    def load(self, job: str) -> Checkpoint | None:
        with self._lock:
            return self._data.get(job)

    def save(self, job: str, checkpoint: Checkpoint) -> None:
        with self._lock:
            self._data[job] = checkpoint


class FileCheckpointStore:
    """Checkpoints in one JSON file (``{job: checkpoint}``), replaced atomically and synced (the
    file and its directory) on every save."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        if not isinstance(data, dict):
            raise SinkError(f"{self.path} is not a checkpoint file")
        return data

    def load(self, job: str) -> Checkpoint | None:
        with self._lock:
            entry = self._read().get(job)
        return None if entry is None else Checkpoint.from_json(entry)

    def save(self, job: str, checkpoint: Checkpoint) -> None:
        with self._lock:
            data = self._read()
            data[job] = checkpoint.to_json()
            replace_file(self.path, json.dumps(data).encode())


KeyFunction = Callable[[Message], str]


def key_function(key: str | KeyFunction) -> KeyFunction:
    """``key`` as a function of a message: a callable as is, or the name of a field of JSON-object
    messages (``"id"`` → ``str(msg.value["id"])``)."""
    if callable(key):
        return key
    if not isinstance(key, str) or not key:
        raise TypeError(f"key must be a field name or a function of the message, not {key!r}")
    name = key

    def field_key(msg: Message) -> str:
        value = msg.value
        if not isinstance(value, dict) or name not in value:
            raise SinkError(
                f"message at {msg.stream}@{msg.offset}#{msg.index} has no field {name!r} for the "
                f"idempotency key; pass key=<function of the message>"
            )
        return str(value[name])

    return field_key


class CheckpointAwareSink(ABC):
    """A sink driven by checkpoints. Subclasses implement :meth:`write` and override the hooks
    they need; every hook runs in the runner's thread, one at a time, in the order shown in the
    module docstring.

    A sink that only emits its effects in :meth:`on_checkpoint_complete` (commit-on-checkpoint)
    must emit them idempotently: a crash after the checkpoint is saved but before it completes is
    restored by replaying the checkpoint's input (``on_checkpoint_restore`` returns False).
    """

    atomic: ClassVar[bool] = False
    """True when :meth:`on_checkpoint_complete` stores the checkpoint together with the output,
    atomically; such a sink is its own checkpoint store (:meth:`load_checkpoint`)."""

    def on_checkpoint_restore(self, checkpoint: Checkpoint | None) -> bool:
        """Called once per run, before anything else, with the latest saved checkpoint (None on a
        first start). Return True when the checkpoint's effects are in the sink (it was committed,
        or this hook finished it); False makes the runner replay its input from ``start_offsets``.
        """
        return checkpoint is not None and checkpoint.sink_committed

    def on_checkpoint_start(self, checkpoint_id: int) -> None:  # noqa: B027 - an optional hook
        """Checkpoint ``checkpoint_id`` begins; :meth:`write` calls follow."""

    @abstractmethod
    def write(self, messages: Sequence[Message]) -> None:
        """Messages of the current checkpoint, in order per stream. May buffer."""

    def on_checkpoint_prepare(self, checkpoint_id: int) -> Any:
        """Everything written must now be durable (possibly invisible). Returns the handle to keep
        in the checkpoint (JSON-serialisable), or None."""
        return None

    def on_checkpoint_complete(self, checkpoint: Checkpoint) -> None:  # noqa: B027 - an optional hook
        """The checkpoint is saved: make its effects visible (atomic sinks: store the checkpoint
        with the output, in one transaction)."""

    def on_checkpoint_abort(self, checkpoint_id: int) -> None:  # noqa: B027 - an optional hook
        """An error before the checkpoint was saved: drop what was written since its start. Also
        called when :meth:`on_checkpoint_start` itself failed."""

    def load_checkpoint(self) -> Checkpoint | None:
        """Atomic sinks: the checkpoint stored with the output (None before the first one)."""
        raise SinkError(f"{type(self).__name__} is not atomic: give the runner a checkpoint store")

    def close(self) -> None:  # noqa: B027 - an optional hook
        """Release connections. Never called while a checkpoint is open."""


class IdempotentSink(CheckpointAwareSink):
    """Effects keyed by a stable idempotency key, so that writing one twice has the effect of
    writing it once (``INSERT … ON CONFLICT``, ``SET … NX``, an ``Idempotency-Key`` header).

    ``key`` is a field name of JSON-object messages or a function of the message: a business key
    or an event id carried in the message. The effects of a checkpoint are written at *prepare*,
    i.e. before the checkpoint is saved and before the input is acknowledged, so the window
    "acknowledged but not written" cannot occur; replays after a crash are absorbed by the keys.
    """

    def __init__(self, key: str | KeyFunction) -> None:
        self.key = key_function(key)
        self._pending: list[tuple[str, Message]] = []

    @abstractmethod
    def write_idempotent(self, records: Sequence[tuple[str, Message]]) -> None:
        """Write ``(key, message)`` records so that a record whose key the target already holds
        changes nothing. Durable when it returns."""

    def write(self, messages: Sequence[Message]) -> None:
        key = self.key
        self._pending.extend((key(m), m) for m in messages)

    def on_checkpoint_prepare(self, checkpoint_id: int) -> None:
        records, self._pending = self._pending, []
        if records:
            self.write_idempotent(records)

    def on_checkpoint_abort(self, checkpoint_id: int) -> None:
        self._pending = []

    def on_checkpoint_restore(self, checkpoint: Checkpoint | None) -> bool:
        self._pending = []
        return super().on_checkpoint_restore(checkpoint)


Txn = TypeVar("Txn")


class TwoPhaseCommitSink(CheckpointAwareSink, Generic[Txn]):
    """A sink with transactions that can be prepared (durable, invisible) and committed later, by
    this process or by a restarted one (Flink's ``TwoPhaseCommitSinkFunction``).

    The runner's steps for checkpoint N, and the methods they call:

    1. ``begin_transaction(N)``: a new transaction whose handle is derived from N, so a restore
       can find it again
    2. ``invoke(txn, messages)``: write into it
    3. ``pre_commit(txn)``: make it durable and invisible (``PREPARE TRANSACTION``)
    4. the runner saves checkpoint N with ``handle(txn)``: from here on the transaction commits
    5. ``commit(txn)``; the runner marks the checkpoint ``sink_committed`` and acknowledges

    ``abort(txn)`` runs after an error in steps 1–3. After a crash, ``on_checkpoint_restore``
    calls ``recover_and_commit(handle)`` for a checkpoint saved but not marked, and
    ``recover_and_abort(handle)`` for every transaction :meth:`prepared_handles` reports that no
    saved checkpoint names. ``recover_and_commit`` must be idempotent: the commit may have happened
    already (its answer was lost).
    """

    def __init__(self) -> None:
        self._txn: Txn | None = None

    @abstractmethod
    def begin_transaction(self, checkpoint_id: int) -> Txn: ...

    @abstractmethod
    def invoke(self, txn: Txn, messages: Sequence[Message]) -> None: ...

    @abstractmethod
    def pre_commit(self, txn: Txn) -> None: ...

    @abstractmethod
    def commit(self, txn: Txn) -> None: ...

    @abstractmethod
    def abort(self, txn: Txn) -> None: ...

    @abstractmethod
    def handle(self, txn: Txn) -> Any:
        """The transaction's handle for the checkpoint (JSON-serialisable)."""

    @abstractmethod
    def recover_and_commit(self, handle: Any) -> None:
        """Commit the prepared transaction ``handle`` names; a no-op if it already committed.
        Raises :class:`SinkError` if it can no longer be committed (it was rolled back)."""

    @abstractmethod
    def recover_and_abort(self, handle: Any) -> None:
        """Roll back the prepared transaction ``handle`` names; a no-op if it is gone."""

    def prepared_handles(self) -> list[Any]:
        """Handles of this sink's transactions that are prepared and not yet decided."""
        return []

    # the checkpoint hooks, in terms of the transaction methods

    def on_checkpoint_restore(self, checkpoint: Checkpoint | None) -> bool:
        self._txn = None
        done = checkpoint is not None and checkpoint.sink_committed
        if checkpoint is not None and not checkpoint.sink_committed and checkpoint.handle is not None:
            self.recover_and_commit(checkpoint.handle)
            done = True
        keep = None if checkpoint is None else checkpoint.handle
        for handle in self.prepared_handles():
            if handle != keep:
                self.recover_and_abort(handle)
        return done

    def on_checkpoint_start(self, checkpoint_id: int) -> None:
        if self._txn is not None:
            raise SinkError(f"{type(self).__name__}: checkpoint {checkpoint_id} started while a transaction is open")
        self._txn = self.begin_transaction(checkpoint_id)

    def write(self, messages: Sequence[Message]) -> None:
        if self._txn is None:
            raise SinkError(f"{type(self).__name__}.write() outside a checkpoint (no transaction begun)")
        self.invoke(self._txn, messages)

    def on_checkpoint_prepare(self, checkpoint_id: int) -> Any:
        if self._txn is None:
            raise SinkError(f"{type(self).__name__}: checkpoint {checkpoint_id} prepared without a transaction")
        self.pre_commit(self._txn)
        return self.handle(self._txn)

    def on_checkpoint_complete(self, checkpoint: Checkpoint) -> None:
        txn, self._txn = self._txn, None
        if txn is None:
            raise SinkError(f"{type(self).__name__}: checkpoint {checkpoint.id} completed without a transaction")
        self.commit(txn)

    def on_checkpoint_abort(self, checkpoint_id: int) -> None:
        txn, self._txn = self._txn, None
        if txn is not None:
            self.abort(txn)
