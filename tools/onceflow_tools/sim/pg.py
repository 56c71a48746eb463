"""A simulated PostgreSQL for the PostgreSQL store (``storage/pgfs.py``): the real store's code
runs unchanged on it, through :class:`~onceflow.storage.pgfs.Connector`.

What it models, and what it leaves out:

- **The SQL the store sends, and only that.** Every statement of ``pgfs.py`` is known here by its
  text (whitespace aside) and carried out on tables in memory; a statement not known is an error,
  so a change of the store's SQL fails the simulation until it is taught here too.
- **Transactions are atomic in simulated time.** The store runs each transaction inside one call
  (no await in the middle), so no two interleave; a transaction's changes are applied as its
  statements run and undone if it rolls back. Locks never wait (nobody else runs meanwhile).
- **Commits and their answers.** A ``COMMIT`` can fail outright (rolled back), or its answer can
  be lost with the transaction committed or not (the connection breaks either way): the caller
  does not know which, as with a real connection reset at that moment.
- **Failover with a synchronous standby.** :meth:`SimPostgres.fail_over` breaks every connection
  and refuses new ones for a while; everything committed survives (the standby held it).
- **Partitions.** A server cut from the database (:attr:`SimPostgres.cut`) cannot connect, and its
  connections break at their next statement (a ``COMMIT`` sent then may or may not have arrived).
- **The database's clock** (``clock_timestamp()``) is the simulated wall clock plus
  :attr:`SimPostgres.clock_offset`, which steps forward and back.
- **Sessions.** ``pg_stat_activity`` lists the open connections; a process that dies has its
  connections closed (its kernel closes the sockets).
"""

from __future__ import annotations

import contextlib
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg_pool import PoolTimeout

from onceflow.storage import pgfs

__all__ = ["PgFaults", "SimPostgres"]

_MISSING = object()
Rows = list[tuple[Any, ...]]


@dataclass(slots=True)
class PgFaults:
    """Probabilities the simulation changes while it runs."""

    commit_fails: float = 0.0  # COMMIT fails and says so (rolled back)
    commit_lost: float = 0.0  # COMMIT's answer is lost (committed or not, half and half)
    statement_fails: float = 0.0  # a statement breaks the connection (rolled back)


@dataclass(slots=True, eq=False)
class _Conn:
    db: SimPostgres
    node: str
    app: str
    settings: dict[str, str] = field(default_factory=dict)
    undo: list[Callable[[], None]] = field(default_factory=list)
    closed: bool = False
    broken: str | None = None  # why the connection broke

    # ------------------------------------------------------------------ psycopg's Connection

    def cursor(self) -> _Cursor:
        return _Cursor(self)

    def execute(self, sql: str, params: Any = None, *, binary: bool = False) -> _Cursor:
        cur = _Cursor(self)
        cur.execute(sql, params, binary=binary)
        return cur

    @contextlib.contextmanager
    def pipeline(self) -> Iterator[None]:
        yield

    def commit(self) -> None:
        db = self.db
        self._usable("COMMIT")
        roll = db.rng.random()
        if roll < db.faults.commit_fails:
            self._rollback()
            db.stats["commits failed"] += 1
            raise psycopg.errors.SerializationFailure("could not serialize access (simulated)")
        if roll < db.faults.commit_fails + db.faults.commit_lost:
            applied = db.rng.random() < 0.5
            if applied:
                self.undo.clear()
            why = self._break("server closed the connection unexpectedly (the answer to COMMIT was lost)")
            db.stats["commit answers lost, committed" if applied else "commit answers lost, rolled back"] += 1
            db.trace("pg", f"COMMIT answer lost ({self.node}): {'committed' if applied else 'rolled back'}")
            raise psycopg.OperationalError(why)
        self.undo.clear()

    def rollback(self) -> None:
        if self.closed or self.broken:
            raise psycopg.OperationalError("the connection is lost")
        self._rollback()

    def close(self) -> None:
        if not self.closed:
            self._rollback()
            self.closed = True
            self.db.conns.pop(self, None)

    def __enter__(self) -> _Conn:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        try:
            if not self.closed and not self.broken:
                if kind is None:
                    self.commit()
                else:
                    self._rollback()
        finally:
            self.close()

    # ------------------------------------------------------------------ the simulation's

    def _usable(self, what: str) -> None:
        db = self.db
        if self.closed:
            raise psycopg.OperationalError("the connection is closed")
        if self.broken:
            raise psycopg.OperationalError(f"the connection is lost: {self.broken}")
        if db.down or self.node in db.cut:
            if what == "COMMIT" and db.rng.random() < 0.5:  # it arrived; its answer did not
                self.undo.clear()
                db.stats["commits cut off, committed"] += 1
                db.trace("pg", f"COMMIT of {self.node} arrived, its answer did not")
            why = self._break("server closed the connection unexpectedly" if db.down else "connection timed out")
            raise psycopg.OperationalError(why)
        if what != "COMMIT" and db.rng.random() < db.faults.statement_fails:
            why = self._break("server closed the connection unexpectedly (simulated reset)")
            raise psycopg.OperationalError(why)

    def _rollback(self) -> None:
        undo, self.undo = self.undo, []
        for fn in reversed(undo):
            fn()

    def _break(self, why: str) -> str:
        self._rollback()
        self.broken = why
        self.db.conns.pop(self, None)
        return why


class _Cursor:
    def __init__(self, conn: _Conn) -> None:
        self.conn = conn
        self._rows: Rows = []
        self.rowcount = -1

    def __enter__(self) -> _Cursor:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def execute(self, sql: str, params: Any = None, *, binary: bool = False) -> _Cursor:
        conn = self.conn
        conn._usable(sql)
        known = _KNOWN.get(sql)
        if known is None:
            if len(_KNOWN) > 10_000:  # statements with a session's name in them come and go
                _KNOWN.clear()
            known = _KNOWN[sql] = _statement(sql)
        text, handler = known
        rows, count = handler(conn.db, conn, text, params)
        self._rows, self.rowcount = list(rows), count
        return self

    def executemany(self, sql: str, seq: Any) -> None:
        total = 0
        for params in seq:
            self.execute(sql, params)
            total += max(0, self.rowcount)
        self.rowcount = total

    def fetchone(self) -> tuple[Any, ...] | None:
        return self._rows.pop(0) if self._rows else None

    def fetchall(self) -> Rows:
        rows, self._rows = self._rows, []
        return rows


class _Pool:
    """psycopg_pool's ConnectionPool, as the store uses it."""

    def __init__(self, connector: _Connector, conninfo: str, **kwargs: Any) -> None:
        self.connector = connector
        self.configure: Callable[[Any], None] | None = kwargs.get("configure")
        self.max_size = int(kwargs.get("max_size", 4))
        self.idle: list[_Conn] = []
        self.closed = False

    def open(self, wait: bool = True, timeout: float = 30.0) -> None:
        with self.connection():
            pass

    def close(self) -> None:
        self.closed = True
        for c in self.idle:
            c.close()
        self.idle.clear()

    @contextlib.contextmanager
    def connection(self, timeout: float | None = None) -> Iterator[_Conn]:
        if self.closed:
            raise PoolTimeout("the pool is closed")
        conn = None
        while self.idle:
            c = self.idle.pop()
            if not c.closed and not c.broken:
                conn = c
                break
        if conn is None:
            try:
                conn = self.connector.connect(conninfo="sim")
                if self.configure is not None:
                    self.configure(conn)
            except psycopg.Error as exc:
                if conn is not None:
                    conn.close()
                raise PoolTimeout(f"couldn't get a connection: {exc}") from exc
        try:
            yield conn
        finally:
            if conn.undo and not conn.broken and not conn.closed:
                conn._rollback()  # the pool rolls back what a borrower left open
            if not conn.closed and not conn.broken and not self.closed and len(self.idle) < self.max_size:
                self.idle.append(conn)
            else:
                conn.close()


class _Connector(pgfs.Connector):
    def __init__(self, db: SimPostgres, node: str, alive: Callable[[], bool]) -> None:
        self.db, self.node, self.alive = db, node, alive

    def connect(self, conninfo: str, **kwargs: Any) -> Any:
        if not self.alive():  # a call its executor had started (the thread dies with the process)
            raise psycopg.OperationalError(f"the process of {self.node} is dead")
        return self.db.connect(self.node, application_name=str(kwargs.get("application_name", "")))

    def pool(self, conninfo: str, **kwargs: Any) -> Any:
        return _Pool(self, conninfo, **kwargs)

    def bounded(self, call: Callable[[], Any], seconds: float) -> Any:
        """The call, made at once (no threads: the run stays deterministic); one whose waits took
        longer than ``seconds`` of simulated time is reported as overrun, after it ended: its effect
        happened, and its caller does not know (a real call that overran may commit or not)."""
        began = self.db.time()
        result = call()
        if self.db.time() - began > seconds:
            raise pgfs.Overran
        return result


class SimPostgres:
    """The database (module docstring)."""

    def __init__(
        self, time: Callable[[], float], rng: random.Random, trace: Callable[[str, str], None], wall: float
    ) -> None:
        self.time, self.rng, self.trace = time, rng, trace  # time: the simulation's (a SimLoop's)
        self.wall = wall  # the wall clock at simulated time 0
        self.faults = PgFaults()
        self.stats: Counter[str] = Counter()
        self.clock_offset = 0.0
        self.down = False
        self.cut: set[str] = set()
        self.conns: dict[_Conn, None] = {}  # open connections, in the order they opened
        self.schema = False
        self.files: dict[str, tuple[str, int | None, int]] = {}  # path: (parent, id, size)
        self.chunks: dict[int, dict[int, bytes]] = {}  # file: {at: bytes}
        self.lease: dict[
            int, tuple[int, str, str | None, float, str, int]
        ] = {}  # 1: (token, holder, address, expires, session, xmin)
        self.commits: dict[int, tuple[str, int]] = {}  # conn: (session, seq)
        self._ids = 0  # onceflow_file_ids: not transactional, as a sequence
        self._xid = 1000

    def connector(self, node: str, alive: Callable[[], bool] = lambda: True) -> pgfs.Connector:
        """How ``node``'s process connects; ``alive`` says whether the process still runs."""
        return _Connector(self, node, alive)

    def now(self) -> float:
        """``clock_timestamp()``."""
        return self.wall + self.time() + self.clock_offset

    def connect(self, node: str, *, application_name: str) -> _Conn:
        if self.down:
            raise psycopg.OperationalError("connection refused (the database is failing over)")
        if node in self.cut:
            raise psycopg.OperationalError("connection timeout expired")
        conn = _Conn(self, node, application_name)
        self.conns[conn] = None
        return conn

    def fail_over(self) -> None:
        """The primary is lost; the synchronous standby takes over with everything committed. Every
        connection breaks; until :meth:`promoted`, none can be made."""
        self.down = True
        for conn in list(self.conns):
            conn._break("server closed the connection unexpectedly (the primary failed)")
        self.trace("pg", "the primary is lost: failing over")

    def promoted(self) -> None:
        self.down = False
        self.trace("pg", "the standby is promoted")

    def process_died(self, node: str) -> None:
        """A server process died: its sockets close, its sessions end."""
        for conn in list(self.conns):
            if conn.node == node:
                conn._break("the client went away")

    # ------------------------------------------------------------------ changes, undone by a rollback

    def put(self, table: dict[Any, Any], key: Any, value: Any, conn: _Conn) -> None:
        old = table.get(key, _MISSING)
        table[key] = value
        conn.undo.append(lambda: table.pop(key, None) if old is _MISSING else table.__setitem__(key, old))

    def delete(self, table: dict[Any, Any], key: Any, conn: _Conn) -> bool:
        if key not in table:
            return False
        old = table.pop(key)
        conn.undo.append(lambda: table.__setitem__(key, old))
        return True

    def xid(self) -> int:
        self._xid += 1
        return self._xid

    def nextval(self) -> int:
        self._ids += 1
        return self._ids

    def file_chunks(self, ident: int) -> dict[int, bytes]:
        return self.chunks.setdefault(ident, {})


# ---------------------------------------------------------------------- the statements

Handler = Callable[[SimPostgres, _Conn, str, Any], tuple[Rows, int]]
_STATEMENTS: dict[str, Handler] = {}
_PATTERNS: list[tuple[re.Pattern[str], Handler]] = []


_KNOWN: dict[str, tuple[str, Handler]] = {}  # a statement as the store sends it: its text, its handler


def _statement(sql: str) -> tuple[str, Handler]:
    """The text (whitespace aside) and handler of a statement (:data:`_KNOWN` keeps them: the
    store sends the same few dozen statements, each thousands of times a seed)."""
    text = " ".join(sql.split())
    handler = _STATEMENTS.get(text)
    if handler is None:
        for pattern, fn in _PATTERNS:
            if pattern.match(text):
                handler = fn
                break
    if handler is None:
        raise AssertionError(f"the simulated database does not know this statement (teach sim/pg.py): {text}")
    return text, handler


def _sql(*texts: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        for t in texts:
            _STATEMENTS[" ".join(t.split())] = fn
        return fn

    return register


def _like(pattern: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        _PATTERNS.append((re.compile(pattern), fn))
        return fn

    return register


# -- the session and the schema


@_like(r"^SET (LOCAL )?application_name = '(.*)'$")
def _set_app(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    m = re.match(r"^SET (LOCAL )?application_name = '(.*)'$", text)
    assert m is not None
    c.app = m.group(2)
    return [], 0


@_like(r"^SET (LOCAL )?[a-z_]+ = ")
def _set(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    return [], 0  # timeouts: nothing here waits


@_like(r"^SELECT to_regclass\(")
def _schema_there(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    return [(db.schema,)], 1


@_sql("SELECT pg_advisory_xact_lock(4437001)")
def _advisory(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    return [(None,)], 1


@_sql(pgfs.SCHEMA)
def _create(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    db.put(db.__dict__, "schema", True, c)
    return [], 0


@_sql(pgfs._UPGRADE)
def _upgrade(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    return [], 0  # lz4 and the servers' secret: nothing the simulation looks at


@_sql("INSERT INTO onceflow_commits (conn, session, seq) VALUES (%s, %s, 0)")
def _register(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    db.put(db.commits, int(p[0]), (str(p[1]), 0), c)
    return [], 1


@_sql("SELECT set_config('onceflow.conn', %s, false)")
def _set_conn(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    c.settings["onceflow.conn"] = str(p[0])
    return [(str(p[0]),)], 1


@_sql(pgfs._MARK)
def _mark(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    ident = int(c.settings["onceflow.conn"])
    row = db.commits.get(ident)
    if row is None:
        return [], 0
    db.put(db.commits, ident, (row[0], row[1] + 1), c)
    return [(ident, row[1] + 1)], 1


@_sql("SELECT seq FROM onceflow_commits WHERE conn = %s FOR UPDATE")
def _read_mark(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    row = db.commits.get(int(p[0]))
    return ([(row[1],)], 1) if row is not None else ([], 0)


@_sql(
    "DELETE FROM onceflow_commits c WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity a "
    "WHERE a.application_name = 'onceflow/' || c.session)"
)
def _forget_sessions(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    live = {conn.app for conn in db.conns}
    gone = [k for k, (session, _) in db.commits.items() if f"onceflow/{session}" not in live]
    for k in gone:
        db.delete(db.commits, k, c)
    return [], len(gone)


# -- the lease


@_sql("SELECT token, xmin::text, expires = '-infinity', holder FROM onceflow_lease WHERE id = 1")
def _lease_read(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    row = db.lease.get(1)
    if row is None:
        return [], 0
    return [(row[0], str(row[5]), row[3] == float("-inf"), row[1])], 1


@_sql(
    "INSERT INTO onceflow_lease (id, token, holder, address, expires, session) "
    "VALUES (1, 1, %(h)s, %(a)s, clock_timestamp() + make_interval(secs => %(t)s), %(s)s) "
    "ON CONFLICT (id) DO NOTHING RETURNING token"
)
def _lease_first(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    if 1 in db.lease:
        return [], 0
    db.put(db.lease, 1, (1, p["h"], p["a"], db.now() + float(p["t"]), p["s"], db.xid()), c)
    return [(1,)], 1


@_sql("SELECT token, expires < clock_timestamp() FROM onceflow_lease WHERE id = 1")
def _lease_expired(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    """Only the ``lease-by-db-clock`` mutation asks this (sim/mutations.py)."""
    row = db.lease.get(1)
    return ([(row[0], row[3] < db.now())], 1) if row is not None else ([], 0)


@_sql("SELECT token, xmin::text FROM onceflow_lease WHERE id = 1 FOR UPDATE")
def _lease_lock(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    row = db.lease.get(1)
    return ([(row[0], str(row[5]))], 1) if row is not None else ([], 0)


@_sql(pgfs._TAKE)
def _lease_take(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    row = db.lease[1]
    db.put(db.lease, 1, (row[0] + 1, p["h"], p["a"], db.now() + float(p["t"]), p["s"], db.xid()), c)
    db.trace("pg", f"lease taken: token {row[0] + 1} by {p['a']}")
    return [(row[0] + 1,)], 1


@_sql(
    "UPDATE onceflow_lease SET expires = clock_timestamp() + make_interval(secs => %s) "
    "WHERE id = 1 AND token = %s AND expires > '-infinity'"
)
def _lease_renew(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    row = db.lease.get(1)
    if row is None or row[0] != int(p[1]) or row[3] == float("-inf"):
        return [], 0
    db.put(db.lease, 1, (row[0], row[1], row[2], db.now() + float(p[0]), row[4], db.xid()), c)
    return [], 1


@_sql("UPDATE onceflow_lease SET expires = '-infinity' WHERE id = 1 AND token = %s")
def _lease_release(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    row = db.lease.get(1)
    if row is None or row[0] != int(p[0]):
        return [], 0
    db.put(db.lease, 1, (row[0], row[1], row[2], float("-inf"), row[4], db.xid()), c)
    return [], 1


@_sql("SELECT holder, address, token FROM onceflow_lease WHERE id = 1 AND expires >= clock_timestamp()")
def _lease_holder(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    row = db.lease.get(1)
    if row is None or row[3] < db.now():
        return [], 0
    return [(row[1], row[2], row[0])], 1


@_sql("SELECT token FROM onceflow_lease WHERE id = 1 FOR KEY SHARE")
def _lease_token(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    row = db.lease.get(1)
    return ([(row[0],)], 1) if row is not None else ([], 0)


@_sql(
    "SELECT count(*) FILTER (WHERE pg_terminate_backend(a.pid)) FROM pg_stat_activity a "
    "JOIN onceflow_lease l ON l.id = 1 AND l.token = %s "
    "AND a.application_name = 'onceflow/' || l.session WHERE a.pid <> pg_backend_pid()"
)
def _end_holder(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    row = db.lease.get(1)
    if row is None or row[0] != int(p[0]):
        return [(0,)], 1
    ended = [conn for conn in db.conns if conn is not c and conn.app == f"onceflow/{row[4]}"]
    for conn in ended:
        conn._break("terminating connection due to administrator command")
    return [(len(ended),)], 1


# -- files and their bytes


def _parent(path: str) -> str:
    return pgfs._parent(path)


def _drop_file(db: SimPostgres, c: _Conn, path: str) -> tuple[str, int | None, int] | None:
    row = db.files.get(path)
    if row is not None:
        db.delete(db.files, path, c)
    return row


def _drop_chunks(db: SimPostgres, c: _Conn, ident: int, *, at_least: int = 0) -> None:
    chunks = db.chunks.get(ident)
    if not chunks:
        return
    for at in [a for a in chunks if a >= at_least]:
        db.delete(chunks, at, c)


@_sql("DELETE FROM onceflow_chunks WHERE file = %s AND at >= %s")
def _chunks_from(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    _drop_chunks(db, c, int(p[0]), at_least=int(p[1]))
    return [], 0


@_sql(
    "UPDATE onceflow_chunks SET data = substring(data FROM 1 FOR (%s - at)::int) "
    "WHERE file = %s AND at = "
    "(SELECT max(at) FROM onceflow_chunks WHERE file = %s AND at < %s) "
    "AND at + length(data) > %s"
)
def _chunk_cut(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    start, ident = int(p[0]), int(p[1])
    chunks = db.file_chunks(ident)
    below = [a for a in chunks if a < start]
    if not below:
        return [], 0
    at = max(below)
    if at + len(chunks[at]) <= start:
        return [], 0
    db.put(chunks, at, chunks[at][: start - at], c)
    return [], 1


@_sql(
    "INSERT INTO onceflow_chunks (file, at, data) VALUES (%s, %s, %s)",
    "INSERT INTO onceflow_chunks (file, at, data) VALUES (%s, 0, %s)",
)
def _chunk_add(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    ident, at, data = (int(p[0]), int(p[1]), bytes(p[2])) if len(p) == 3 else (int(p[0]), 0, bytes(p[1]))
    chunks = db.file_chunks(ident)
    if at in chunks:
        raise psycopg.errors.UniqueViolation("duplicate key value violates unique constraint onceflow_chunks_pkey")
    db.put(chunks, at, data, c)
    return [], 1


@_sql("UPDATE onceflow_files SET size = %s WHERE id = %s")
def _file_size(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    for path, (parent, ident, _) in db.files.items():
        if ident == int(p[1]):
            db.put(db.files, path, (parent, ident, int(p[0])), c)
            return [], 1
    return [], 0


@_sql(
    "SELECT greatest(at, %(lo)s) AS pos, substring(data FROM (greatest(at, %(lo)s) - at + 1)::int "
    "FOR (least(at + length(data), %(hi)s) - greatest(at, %(lo)s))::int) "
    "FROM onceflow_chunks WHERE file = %(f)s AND at < %(hi)s AND at + length(data) > %(lo)s AND at >= "
    "coalesce((SELECT max(at) FROM onceflow_chunks WHERE file = %(f)s AND at <= %(lo)s), 0) ORDER BY at"
)
def _range(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    lo, hi = int(p["lo"]), int(p["hi"])
    chunks = db.chunks.get(int(p["f"]), {})
    floor = max((a for a in chunks if a <= lo), default=0)
    rows: Rows = []
    for at in sorted(chunks):
        data = chunks[at]
        if at < hi and at + len(data) > lo and at >= floor:
            pos = max(at, lo)
            rows.append((pos, data[pos - at : min(at + len(data), hi) - at]))
    return rows, len(rows)


@_sql("SELECT path, parent, id, size FROM onceflow_files WHERE path = %s OR starts_with(path, %s)")
def _tree(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    rows: Rows = [(k, v[0], v[1], v[2]) for k, v in db.files.items() if k == p[0] or k.startswith(p[1])]
    return rows, len(rows)


@_sql(
    "SELECT c.file, c.at, c.data FROM onceflow_chunks c JOIN onceflow_files f ON f.id = c.file "
    "WHERE starts_with(f.path, %s) AND f.size <= %s ORDER BY c.file, c.at"
)
def _tree_bytes(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    rows: Rows = []
    for path, (_, ident, size) in db.files.items():
        if ident is not None and path.startswith(p[0]) and size <= int(p[1]):
            rows += [(ident, at, data) for at, data in db.chunks.get(ident, {}).items()]
    rows.sort(key=lambda r: (r[0], r[1]))
    return rows, len(rows)


@_sql("DELETE FROM onceflow_chunks WHERE file IN (SELECT id FROM onceflow_files WHERE path = ANY(%s))")
def _chunks_of_paths(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    for path in p[0]:
        row = db.files.get(path)
        if row is not None and row[1] is not None:
            _drop_chunks(db, c, row[1])
    return [], 0


@_sql("DELETE FROM onceflow_files WHERE path = ANY(%s)")
def _files_drop(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    return [], sum(1 for path in p[0] if _drop_file(db, c, path) is not None)


@_sql(
    "INSERT INTO onceflow_files (path, parent, id, size) "
    "SELECT p, q, nextval('onceflow_file_ids'), n FROM unnest(%s::text[], %s::text[], %s::bigint[]) "
    "AS t(p, q, n) RETURNING path, id"
)
def _files_add(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    rows: Rows = []
    for path, parent, size in zip(p[0], p[1], p[2], strict=True):
        ident = db.nextval()
        _insert_file(db, c, path, parent, ident, int(size))
        rows.append((path, ident))
    return rows, len(rows)


def _insert_file(db: SimPostgres, c: _Conn, path: str, parent: str, ident: int | None, size: int) -> None:
    if path in db.files:
        raise psycopg.errors.UniqueViolation(f"duplicate key value violates unique constraint: {path}")
    db.put(db.files, path, (parent, ident, size), c)


@_sql("SELECT id, size FROM onceflow_files WHERE path = %s")
def _file(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    row = db.files.get(p[0])
    return ([(row[1], row[2])], 1) if row is not None else ([], 0)


@_sql(
    "INSERT INTO onceflow_files (path, parent, id, size) "
    "VALUES (%s, %s, nextval('onceflow_file_ids'), 0) RETURNING id, size"
)
def _file_new(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    ident = db.nextval()
    _insert_file(db, c, p[0], p[1], ident, 0)
    return [(ident, 0)], 1


@_sql(
    "INSERT INTO onceflow_files (path, parent, id, size) VALUES (%s, %s, nextval('onceflow_file_ids'), %s) RETURNING id"
)
def _file_whole(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    ident = db.nextval()
    _insert_file(db, c, p[0], p[1], ident, int(p[2]))
    return [(ident,)], 1


@_sql("SELECT path, id FROM onceflow_files WHERE path = %s")
def _entry(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    row = db.files.get(p[0])
    return ([(p[0], row[1])], 1) if row is not None else ([], 0)


@_sql("SELECT path FROM onceflow_files WHERE parent = %s AND path <> parent")
def _children(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    rows: Rows = [(k,) for k, v in db.files.items() if v[0] == p[0] and k != v[0]]
    return rows, len(rows)


@_sql("SELECT 1 FROM onceflow_files WHERE parent = %s AND path <> parent LIMIT 1")
def _any_child(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    rows, _ = _children(db, c, text, p)
    return ([(1,)], 1) if rows else ([], 0)


@_sql("SELECT path, id FROM onceflow_files WHERE path = ANY(%s)")
def _entries(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    rows: Rows = [(k, db.files[k][1]) for k in p[0] if k in db.files]
    return rows, len(rows)


@_sql("INSERT INTO onceflow_files (path, parent, id) VALUES (%s, %s, NULL) ON CONFLICT (path) DO NOTHING")
def _dir_new(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    if p[0] in db.files:
        return [], 0
    _insert_file(db, c, p[0], p[1], None, 0)
    return [], 1


@_sql("SELECT 1 FROM onceflow_files WHERE path = %s")
def _there(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    return ([(1,)], 1) if p[0] in db.files else ([], 0)


@_sql("DELETE FROM onceflow_files WHERE path = %s AND id IS NOT NULL RETURNING id")
def _unlink(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    row = db.files.get(p[0])
    if row is None or row[1] is None:
        return [], 0
    db.delete(db.files, p[0], c)
    return [(row[1],)], 1


@_sql("DELETE FROM onceflow_chunks WHERE file = %s")
def _chunks_drop(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    _drop_chunks(db, c, int(p[0]))
    return [], 0


@_sql("SELECT id FROM onceflow_files WHERE path = %s")
def _ident(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    row = db.files.get(p[0])
    return ([(row[1],)], 1) if row is not None else ([], 0)


@_sql("DELETE FROM onceflow_files WHERE path = %s")
def _entry_drop(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    return [], int(_drop_file(db, c, p[0]) is not None)


@_sql("UPDATE onceflow_files SET path = %s, parent = %s WHERE path = %s")
def _move(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    row = db.files.get(p[2])
    if row is None:
        return [], 0
    db.delete(db.files, p[2], c)
    _insert_file(db, c, p[0], p[1], row[1], row[2])
    return [], 1


@_sql(
    "UPDATE onceflow_files SET path = %s || substr(path, %s), "
    "parent = %s || substr(parent, %s) WHERE starts_with(path, %s)"
)
def _move_below(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    dst, n, below = p[0], int(p[1]), p[4]
    moving = [(k, v) for k, v in db.files.items() if k.startswith(below)]
    for k, _ in moving:
        db.delete(db.files, k, c)
    for k, (parent, ident, size) in moving:
        _insert_file(db, c, dst + k[n - 1 :], dst + parent[n - 1 :], ident, size)
    return [], len(moving)


@_sql("DELETE FROM onceflow_files WHERE path = %s OR starts_with(path, %s) RETURNING id")
def _rmtree(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    gone = [k for k in db.files if k == p[0] or k.startswith(p[1])]
    rows: Rows = []
    for k in gone:
        row = _drop_file(db, c, k)
        assert row is not None
        rows.append((row[1],))
    return rows, len(rows)


@_sql("DELETE FROM onceflow_chunks WHERE file = ANY(%s)")
def _chunks_of(db: SimPostgres, c: _Conn, text: str, p: Any) -> tuple[Rows, int]:
    for ident in p[0]:
        _drop_chunks(db, c, int(ident))
    return [], 0
