"""PostgreSQL sinks (psycopg 3): at-least-once COPY, idempotent upsert, rows + offsets in one
transaction, and two-phase commit with ``PREPARE TRANSACTION``.

Every sink writes the columns ``columns`` of ``table`` (``"name"`` or ``"schema.name"``; the
table must exist). ``row(message)`` gives a row's values in that order; by default, the fields of
the same names of a JSON-object message (a dict or list value is written as ``jsonb``).

The sinks keep their own state in tables they create when missing:
``onceflow_sink_checkpoints`` (job, checkpoint id, offsets: the transactional sink's checkpoint),
``onceflow_sink_transactions`` (job, checkpoint id: one row committed by each two-phase
transaction, so a restore can tell a committed transaction from a rolled back one) and
``onceflow_sink_epochs`` (job, epoch: the two-phase sink's fencing, one claim per restore).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from ..client import Message
from ._api import Checkpoint, CheckpointAwareSink, IdempotentSink, SinkError, SinkFencedError, TwoPhaseCommitSink

__all__ = [
    "PostgresInsertSink",
    "PostgresTransactionalSink",
    "PostgresTwoPhaseSink",
    "PostgresUpsertSink",
    "RowFunction",
]

RowFunction = Callable[[Message], Sequence[Any]]

CHECKPOINTS_TABLE = "onceflow_sink_checkpoints"
TRANSACTIONS_TABLE = "onceflow_sink_transactions"
EPOCHS_TABLE = "onceflow_sink_epochs"
_GID_PREFIX = "onceflow:"


def table_identifier(table: str) -> sql.Identifier:
    """``"name"`` or ``"schema.name"`` as a quoted identifier."""
    parts = table.split(".")
    if not table or len(parts) > 2 or not all(parts):
        raise ValueError(f"table must be 'name' or 'schema.name', not {table!r}")
    return sql.Identifier(*parts)


def adapt(value: Any) -> Any:
    """A JSON value as psycopg should send it (objects and arrays as jsonb)."""
    return Jsonb(value) if isinstance(value, dict | list) else value


def field_row(columns: Sequence[str]) -> RowFunction:
    """The default row function: the fields named like the columns, from JSON-object messages."""
    cols = tuple(columns)

    def row(msg: Message) -> tuple[Any, ...]:
        value = msg.value
        if not isinstance(value, dict):
            raise SinkError(
                f"message at {msg.stream}@{msg.offset}#{msg.index} is not a JSON object; "
                "pass row=<function of the message> to map it to the columns"
            )
        missing = [c for c in cols if c not in value]
        if missing:
            raise SinkError(
                f"message at {msg.stream}@{msg.offset}#{msg.index} has no field(s) {missing} for "
                "the columns; pass row=<function of the message>"
            )
        return tuple(adapt(value[c]) for c in cols)

    return row


def copy_rows(conn: psycopg.Connection[Any], table: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> int:
    """``COPY table (columns) FROM STDIN`` inside the connection's current transaction."""
    stmt = sql.SQL("COPY {} ({}) FROM STDIN").format(
        table_identifier(table), sql.SQL(", ").join(map(sql.Identifier, columns))
    )
    n = 0
    with conn.cursor() as cur, cur.copy(stmt) as copy:
        for r in rows:
            copy.write_row(r)
            n += 1
    return n


def create_if_missing(conn: psycopg.Connection[Any], ddl: sql.Composed) -> None:
    """Run a ``CREATE … IF NOT EXISTS`` in its own transaction; a concurrent creator is no error."""
    try:
        with conn.transaction():
            conn.execute(ddl)
    except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateTable, psycopg.errors.DuplicateObject):
        pass


class _Connection:
    """One lazily opened connection, replaced by a fresh one at every restore."""

    def __init__(self, conninfo: str, *, autocommit: bool) -> None:
        self.conninfo = conninfo
        self.autocommit = autocommit
        self._conn: psycopg.Connection[Any] | None = None

    def get(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = psycopg.connect(self.conninfo, autocommit=self.autocommit)
        return self._conn

    def usable(self) -> psycopg.Connection[Any] | None:
        """The connection if it is open and healthy (no new one is made)."""
        c = self._conn
        return None if c is None or c.closed or c.broken else c

    def reset(self) -> None:
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class _PostgresSink:
    """What every PostgreSQL sink shares: the target, the row function, the connection."""

    def __init__(
        self, conninfo: str, table: str, columns: Sequence[str], row: RowFunction | None, *, autocommit: bool = False
    ) -> None:
        if not columns:
            raise ValueError("columns must name at least one column of the table")
        table_identifier(table)  # validates
        self.table = table
        self.columns = tuple(columns)
        self.row: RowFunction = row or field_row(self.columns)
        self._db = _Connection(conninfo, autocommit=autocommit)

    def rows(self, messages: Iterable[Message]) -> list[Sequence[Any]]:
        row = self.row
        return [row(m) for m in messages]

    def close(self) -> None:
        self._db.close()


class PostgresInsertSink(_PostgresSink, CheckpointAwareSink):
    """At-least-once: each checkpoint's rows are COPY'd and committed at *prepare*; no offsets are
    kept with them, so input replayed after a crash is inserted again. The baseline for
    ``onceflow bench sinks``, and a sink for tables where duplicates do no harm."""

    def __init__(self, conninfo: str, table: str, columns: Sequence[str], *, row: RowFunction | None = None) -> None:
        super().__init__(conninfo, table, columns, row)

    def on_checkpoint_restore(self, checkpoint: Checkpoint | None) -> bool:
        self._db.reset()
        return super().on_checkpoint_restore(checkpoint)

    def write(self, messages: Sequence[Message]) -> None:
        copy_rows(self._db.get(), self.table, self.columns, self.rows(messages))

    def on_checkpoint_prepare(self, checkpoint_id: int) -> None:
        self._db.get().commit()

    def on_checkpoint_abort(self, checkpoint_id: int) -> None:
        conn = self._db.usable()
        if conn is not None:
            conn.rollback()


class PostgresUpsertSink(_PostgresSink, IdempotentSink):
    """Idempotent: ``INSERT … ON CONFLICT (key_columns) DO UPDATE`` (or ``DO NOTHING``).

    ``key_columns`` must carry a unique index or primary key of ``table``; their values are the
    idempotency key. Rows are COPY'd into a temporary staging table and merged in one statement
    per checkpoint, committed at *prepare*. Within one checkpoint the last row of a key wins
    (``on_conflict="update"``) or the first (``"nothing"``), as it would row by row.
    """

    def __init__(
        self,
        conninfo: str,
        table: str,
        columns: Sequence[str],
        *,
        key_columns: Sequence[str],
        row: RowFunction | None = None,
        on_conflict: Literal["update", "nothing"] = "update",
    ) -> None:
        _PostgresSink.__init__(self, conninfo, table, columns, row)
        missing = [c for c in key_columns if c not in self.columns]
        if not key_columns or missing:
            raise ValueError(
                f"key_columns must be some of the columns {list(self.columns)}; not found: {missing or key_columns}"
            )
        if on_conflict not in ("update", "nothing"):
            raise ValueError(f"on_conflict must be 'update' or 'nothing', not {on_conflict!r}")
        self.key_columns = tuple(key_columns)
        self.on_conflict = on_conflict
        self._key_idx = [self.columns.index(c) for c in self.key_columns]
        IdempotentSink.__init__(self, self._message_key)
        digest = hashlib.sha1(f"{table}|{','.join(self.columns)}".encode(), usedforsecurity=False).hexdigest()[:12]
        self._stage = f"onceflow_stage_{digest}"
        self._staged_on: psycopg.Connection[Any] | None = None
        self._rows: dict[Any, Sequence[Any]] = {}

    def _row_key(self, r: Sequence[Any]) -> Any:
        if len(self._key_idx) == 1:
            k = r[self._key_idx[0]]
            return json.dumps(k.obj, sort_keys=True) if isinstance(k, Jsonb) else k
        return tuple(json.dumps(r[i].obj, sort_keys=True) if isinstance(r[i], Jsonb) else r[i] for i in self._key_idx)

    def _message_key(self, msg: Message) -> str:
        return json.dumps(self._row_key(self.row(msg)), default=str)

    def write(self, messages: Sequence[Message]) -> None:
        # rows keyed by their key columns as they arrive: the same deduplication as write_idempotent,
        # without building each row twice
        rows, key, row = self._rows, self._row_key, self.row
        if self.on_conflict == "update":
            for m in messages:
                r = row(m)
                rows[key(r)] = r
        else:
            for m in messages:
                r = row(m)
                rows.setdefault(key(r), r)

    def on_checkpoint_prepare(self, checkpoint_id: int) -> None:
        rows, self._rows = self._rows, {}
        if rows:
            self._merge(rows.values())

    def on_checkpoint_abort(self, checkpoint_id: int) -> None:
        self._rows = {}

    def on_checkpoint_restore(self, checkpoint: Checkpoint | None) -> bool:
        self._db.reset()
        self._rows = {}
        return IdempotentSink.on_checkpoint_restore(self, checkpoint)

    def _merge_sql(self) -> sql.Composed:
        cols = sql.SQL(", ").join(map(sql.Identifier, self.columns))
        keys = sql.SQL(", ").join(map(sql.Identifier, self.key_columns))
        others = [c for c in self.columns if c not in self.key_columns]
        action: sql.Composable
        if self.on_conflict == "nothing" or not others:
            action = sql.SQL("DO NOTHING")
        else:
            action = sql.SQL("DO UPDATE SET ") + sql.SQL(", ").join(
                sql.SQL("{} = EXCLUDED.{}").format(sql.Identifier(c), sql.Identifier(c)) for c in others
            )
        return (
            sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {} ON CONFLICT ({}) ").format(
                table_identifier(self.table), cols, cols, sql.Identifier(self._stage), keys
            )
            + action
        )

    def write_idempotent(self, records: Sequence[tuple[str, Message]]) -> None:
        chosen: dict[str, Message] = {}
        for key, msg in records:
            if self.on_conflict == "update" or key not in chosen:
                chosen[key] = msg
        self._merge(self.rows(chosen.values()))

    def _merge(self, rows: Iterable[Sequence[Any]]) -> None:
        """Stage the rows and merge them into the table, in one transaction."""
        conn = self._db.get()
        if self._staged_on is not conn:
            cols = sql.SQL(", ").join(map(sql.Identifier, self.columns))
            create_if_missing(
                conn,
                sql.SQL(
                    "CREATE TEMP TABLE IF NOT EXISTS {} ON COMMIT DELETE ROWS AS SELECT {} FROM {} WITH NO DATA"
                ).format(sql.Identifier(self._stage), cols, table_identifier(self.table)),
            )
            self._staged_on = conn
        with conn.transaction():
            copy_rows(conn, self._stage, self.columns, rows)
            conn.execute(self._merge_sql())


def _plain(value: Any) -> Any:
    return value.obj if isinstance(value, Jsonb) else value


class PostgresTransactionalSink(_PostgresSink, CheckpointAwareSink):
    """Exactly-once by storing the offsets with the output: each checkpoint's rows and its offsets
    (a row of ``onceflow_sink_checkpoints`` for ``job``) are committed in one transaction.

    The rows are COPY'd into an open transaction as they arrive; *complete* updates the job's
    checkpoint row, only if it still holds the checkpoint this runner restored or last committed
    (another runner of the job committing in between raises :class:`SinkFencedError`), and
    commits. A crash before the commit loses the rows and the offsets together; a restore reads
    the offsets back, so a committed checkpoint is never replayed.
    """

    atomic = True

    def __init__(
        self, conninfo: str, table: str, columns: Sequence[str], *, job: str, row: RowFunction | None = None
    ) -> None:
        super().__init__(conninfo, table, columns, row)
        if not job:
            raise ValueError("job must name the pipeline (it keys the stored offsets)")
        self.job = job
        self._last = 0

    def _ensure(self) -> psycopg.Connection[Any]:
        conn = self._db.get()
        create_if_missing(
            conn,
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (job text PRIMARY KEY, checkpoint bigint NOT NULL, offsets jsonb NOT NULL, "
                "start_offsets jsonb NOT NULL, committed_at timestamptz NOT NULL DEFAULT now())"
            ).format(sql.Identifier(CHECKPOINTS_TABLE)),
        )
        with conn.transaction():
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (job, checkpoint, offsets, start_offsets) VALUES (%s, 0, '{{}}', '{{}}') "
                    "ON CONFLICT (job) DO NOTHING"
                ).format(sql.Identifier(CHECKPOINTS_TABLE)),
                (self.job,),
            )
        return conn

    def load_checkpoint(self) -> Checkpoint | None:
        self._db.reset()
        conn = self._ensure()
        with conn.transaction():
            found = conn.execute(
                sql.SQL("SELECT checkpoint, offsets, start_offsets FROM {} WHERE job = %s").format(
                    sql.Identifier(CHECKPOINTS_TABLE)
                ),
                (self.job,),
            ).fetchone()
        if found is None or found[0] == 0:
            return None
        return Checkpoint(int(found[0]), dict(found[1]), dict(found[2]), None, True)

    def on_checkpoint_restore(self, checkpoint: Checkpoint | None) -> bool:
        self._last = 0 if checkpoint is None else checkpoint.id
        return True

    def write(self, messages: Sequence[Message]) -> None:
        copy_rows(self._db.get(), self.table, self.columns, self.rows(messages))

    def on_checkpoint_complete(self, checkpoint: Checkpoint) -> None:
        conn = self._db.get()
        cur = conn.execute(
            sql.SQL(
                "UPDATE {} SET checkpoint = %s, offsets = %s, start_offsets = %s, committed_at = now() "
                "WHERE job = %s AND checkpoint = %s"
            ).format(sql.Identifier(CHECKPOINTS_TABLE)),
            (checkpoint.id, Jsonb(checkpoint.offsets), Jsonb(checkpoint.start_offsets), self.job, self._last),
        )
        if cur.rowcount != 1:
            conn.rollback()
            raise SinkFencedError(
                f"job {self.job!r}: another runner committed after checkpoint {self._last}; "
                f"checkpoint {checkpoint.id} of this runner was rolled back"
            )
        conn.commit()
        self._last = checkpoint.id

    def on_checkpoint_abort(self, checkpoint_id: int) -> None:
        conn = self._db.usable()
        if conn is not None:
            conn.rollback()


@dataclass(slots=True)
class PostgresTxn:
    """An open two-phase transaction of :class:`PostgresTwoPhaseSink`."""

    checkpoint_id: int
    gid: str
    prepared: bool = False


class PostgresTwoPhaseSink(_PostgresSink, TwoPhaseCommitSink[PostgresTxn]):
    """Two-phase commit with PostgreSQL's ``PREPARE TRANSACTION`` (the server needs
    ``max_prepared_transactions`` > 0).

    Checkpoint N's rows go into a transaction with the global id ``onceflow:<job>:<N>``, which also
    inserts ``(job, N)`` into ``onceflow_sink_transactions``. *pre-commit* prepares it (durable,
    invisible, surviving the process and a server restart); the runner saves the checkpoint with the
    handle; *commit* is ``COMMIT PREPARED``. A restore commits the transaction of a saved checkpoint
    (if it is no longer prepared, the marker row tells whether it committed; if not, that is an
    error, never a silent loss) and rolls back every other prepared ``onceflow:<job>:`` transaction.
    Prepared transactions hold their locks until decided; a runner that never comes back leaves them
    to an operator (``SELECT gid FROM pg_prepared_xacts``).

    Fencing: only the runner that restored last may commit. The global id alone does not stop a
    second runner (PostgreSQL frees an id once its transaction commits), so:

    1. A restore, after the recovery above, claims the job: it increments the job's row of
       ``onceflow_sink_epochs`` and keeps the new epoch. The claim waits (up to ``lock_timeout``
       seconds, then :class:`SinkError`) for a checkpoint transaction of another runner that holds
       the row (step 3).
    2. It then checks that no checkpoint after the restored one was committed (the newest marker
       row): otherwise another runner committed since this one's checkpoint was loaded, and
       replaying would write that input twice: :class:`SinkFencedError`; run again to reload.
    3. Each checkpoint transaction, before it prepares, locks the job's epoch row
       (``SELECT … FOR UPDATE``, held until ``COMMIT PREPARED``) and requires it to hold this
       runner's epoch, and its marker insert must insert. Else it is rolled back and
       :class:`SinkFencedError` raised: a fenced runner commits nothing.
    """

    def __init__(
        self,
        conninfo: str,
        table: str,
        columns: Sequence[str],
        *,
        job: str,
        row: RowFunction | None = None,
        lock_timeout: float = 30.0,
    ) -> None:
        _PostgresSink.__init__(self, conninfo, table, columns, row, autocommit=True)
        TwoPhaseCommitSink.__init__(self)
        if not job:
            raise ValueError("job must name the pipeline (it names the prepared transactions)")
        if lock_timeout <= 0:
            raise ValueError("lock_timeout must be a positive number of seconds")
        self.job = job
        self.lock_timeout = lock_timeout
        self.epoch = 0  # this runner's claim on the job (0: not restored yet)
        self._prefix = f"{_GID_PREFIX}{job}:"
        if len(self._prefix) > 180:
            raise ValueError("job is too long for a PostgreSQL transaction id (200 bytes)")

    def _gid(self, checkpoint_id: int) -> str:
        return f"{self._prefix}{checkpoint_id}"

    def on_checkpoint_restore(self, checkpoint: Checkpoint | None) -> bool:
        self._db.reset()
        conn = self._db.get()
        row = conn.execute("SHOW max_prepared_transactions").fetchone()
        if row is None or int(row[0]) < 1:
            raise SinkError(
                "PostgresTwoPhaseSink needs prepared transactions: set max_prepared_transactions > 0 "
                "in postgresql.conf (and restart the server)"
            )
        create_if_missing(
            conn,
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (job text NOT NULL, checkpoint bigint NOT NULL, "
                "PRIMARY KEY (job, checkpoint))"
            ).format(sql.Identifier(TRANSACTIONS_TABLE)),
        )
        create_if_missing(
            conn,
            sql.SQL("CREATE TABLE IF NOT EXISTS {} (job text PRIMARY KEY, epoch bigint NOT NULL)").format(
                sql.Identifier(EPOCHS_TABLE)
            ),
        )
        self.epoch = 0
        done = TwoPhaseCommitSink.on_checkpoint_restore(self, checkpoint)
        # Step 1: claim the job
        try:
            with conn.transaction():
                conn.execute(
                    sql.SQL("SET LOCAL lock_timeout = {}").format(sql.Literal(f"{int(self.lock_timeout * 1000)}ms"))
                )
                row = conn.execute(
                    sql.SQL(
                        "INSERT INTO {t} (job, epoch) VALUES (%s, 1) ON CONFLICT (job) DO UPDATE SET epoch = {t}.epoch + 1 "
                        "RETURNING epoch"
                    ).format(t=sql.Identifier(EPOCHS_TABLE)),
                    (self.job,),
                ).fetchone()
        except psycopg.errors.LockNotAvailable as exc:
            raise SinkError(
                f"job {self.job!r}: a checkpoint transaction of another runner held the job for "
                f"{self.lock_timeout:g} s (prepared and not decided?); run again: the restore decides "
                "prepared transactions first"
            ) from exc
        assert row is not None
        epoch = int(row[0])
        # Step 2: nothing committed after the restored checkpoint
        restored = 0 if checkpoint is None else checkpoint.id
        latest = conn.execute(
            sql.SQL("SELECT max(checkpoint) FROM {} WHERE job = %s").format(sql.Identifier(TRANSACTIONS_TABLE)),
            (self.job,),
        ).fetchone()
        if latest is not None and latest[0] is not None and int(latest[0]) > restored:
            raise SinkFencedError(
                f"job {self.job!r}: checkpoint {latest[0]} was committed by another runner after this "
                f"one loaded checkpoint {restored}; replaying from there would write its input twice. "
                "Run again (to load the newest checkpoint), and run one runner per job"
            )
        self.epoch = epoch
        return done

    def begin_transaction(self, checkpoint_id: int) -> PostgresTxn:
        conn = self._db.get()
        conn.execute("BEGIN")
        return PostgresTxn(checkpoint_id, self._gid(checkpoint_id))

    def invoke(self, txn: PostgresTxn, messages: Sequence[Message]) -> None:
        copy_rows(self._db.get(), self.table, self.columns, self.rows(messages))

    def pre_commit(self, txn: PostgresTxn) -> None:
        """Step 3 of the fencing (class docstring), then ``PREPARE TRANSACTION``."""
        conn = self._db.get()
        marks = sql.Identifier(TRANSACTIONS_TABLE)
        row = conn.execute(
            sql.SQL("SELECT epoch FROM {} WHERE job = %s FOR UPDATE").format(sql.Identifier(EPOCHS_TABLE)), (self.job,)
        ).fetchone()
        if self.epoch == 0 or row is None or int(row[0]) != self.epoch:
            conn.execute("ROLLBACK")
            raise SinkFencedError(
                f"job {self.job!r}: another runner restored the job after this one (epoch "
                f"{None if row is None else row[0]}, this runner's {self.epoch}); checkpoint "
                f"{txn.checkpoint_id} of this runner was rolled back"
            )
        inserted = conn.execute(
            sql.SQL("INSERT INTO {} (job, checkpoint) VALUES (%s, %s) ON CONFLICT DO NOTHING").format(marks),
            (self.job, txn.checkpoint_id),
        ).rowcount
        if inserted != 1:
            conn.execute("ROLLBACK")
            raise SinkFencedError(
                f"job {self.job!r}: checkpoint {txn.checkpoint_id} is already committed (by another "
                "runner); this runner's was rolled back"
            )
        conn.execute(
            sql.SQL("DELETE FROM {} WHERE job = %s AND checkpoint < %s").format(marks), (self.job, txn.checkpoint_id)
        )
        conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(txn.gid)))
        txn.prepared = True

    def commit(self, txn: PostgresTxn) -> None:
        try:
            self._db.get().execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(txn.gid)))
        except psycopg.errors.UndefinedObject as exc:
            # the restore of another runner decided it (rolled it back, as no checkpoint it loaded named it)
            raise SinkFencedError(
                f"job {self.job!r}: the prepared transaction of checkpoint {txn.checkpoint_id} is gone, "
                f"decided by another runner's restore; this runner must stop ({exc})"
            ) from exc

    def abort(self, txn: PostgresTxn) -> None:
        if txn.prepared:
            self.recover_and_abort(self.handle(txn))
            return
        conn = self._db.usable()
        if conn is not None:
            conn.execute("ROLLBACK")

    def handle(self, txn: PostgresTxn) -> dict[str, Any]:
        return {"gid": txn.gid, "checkpoint": txn.checkpoint_id}

    def _is_prepared(self, gid: str) -> bool:
        row = (
            self._db.get()
            .execute("SELECT 1 FROM pg_prepared_xacts WHERE gid = %s AND database = current_database()", (gid,))
            .fetchone()
        )
        return row is not None

    def _handle_fields(self, handle: Any) -> tuple[str, int]:
        if (
            not isinstance(handle, dict)
            or not isinstance(handle.get("gid"), str)
            or not isinstance(handle.get("checkpoint"), int)
        ):
            raise SinkError(f"not a PostgresTwoPhaseSink transaction handle: {handle!r}")
        if not handle["gid"].startswith(self._prefix):
            raise SinkError(f"transaction {handle['gid']!r} belongs to another job than {self.job!r}")
        return handle["gid"], handle["checkpoint"]

    def recover_and_commit(self, handle: Any) -> None:
        gid, checkpoint_id = self._handle_fields(handle)
        if self._is_prepared(gid):
            self._db.get().execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)))
            return
        found = (
            self._db.get()
            .execute(
                sql.SQL("SELECT 1 FROM {} WHERE job = %s AND checkpoint = %s").format(
                    sql.Identifier(TRANSACTIONS_TABLE)
                ),
                (self.job, checkpoint_id),
            )
            .fetchone()
        )
        if found is None:
            raise SinkError(
                f"transaction {gid!r} of the saved checkpoint {checkpoint_id} is neither prepared nor committed: "
                "it was rolled back outside onceflow, and that checkpoint's rows are lost"
            )

    def recover_and_abort(self, handle: Any) -> None:
        gid, _ = self._handle_fields(handle)
        if self._is_prepared(gid):
            self._db.get().execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))

    def prepared_handles(self) -> list[Any]:
        rows = (
            self._db.get()
            .execute(
                "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() AND left(gid, %s) = %s ORDER BY gid",
                (len(self._prefix), self._prefix),
            )
            .fetchall()
        )
        handles: list[Any] = []
        for (gid,) in rows:
            tail = gid[len(self._prefix) :]
            if tail.isdigit():
                handles.append({"gid": gid, "checkpoint": int(tail)})
        return handles
