"""Holes the multi-server tier had, put back on purpose (``onceflow sim --cluster --mutate NAME``):
the simulation must find each of them, or its worlds and checks are too weak to trust when they
find nothing (issue 30's regression seeds; tests/tools/test_sim_cluster.py).

- ``guess-lost-commits``: a write whose answer to ``COMMIT`` was lost is reported as failed,
  without reading back what became of it, as the PostgreSQL store did before it counted its
  commits (``PgFileSystem._settle``). A delete answered "not stored" that did commit loses the
  appends acknowledged after it (hole 1); an append answered "not stored" comes back (hole 2).
- ``lease-by-db-clock``: a follower takes the lease once the database's clock says its term ran
  out, as before the lease was judged by each server's own clock: a step of that clock hands the
  lease over while the holder still serves reads from memory (hole 6).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from onceflow.storage import pgfs
from onceflow.storage.pgfs import PgFileSystem

__all__ = ["MUTATIONS", "mutated"]


def _guess(self: PgFileSystem, mark: tuple[int, int], what: str, exc: Exception) -> None:
    raise pgfs._io_error(exc, what) from exc


_acquire = PgFileSystem.acquire


def _acquire_by_db_clock(self: PgFileSystem, holder: str, address: str | None, ttl: float) -> int | None:
    with self._tx("read the lease", fence=False) as cur:
        cur.execute("SELECT token, expires < clock_timestamp() FROM onceflow_lease WHERE id = 1")
        row = cur.fetchone()
    if row is None:
        return _acquire(self, holder, address, ttl)  # the first taking: as ever
    if not row[1]:
        return None
    named = {"h": f"{holder} term={ttl:g}", "a": address, "t": ttl, "s": self.session}
    with self._tx("take the lease", fence=False) as cur:
        cur.execute("SELECT token, xmin::text FROM onceflow_lease WHERE id = 1 FOR UPDATE")
        locked = cur.fetchone()
        if locked is None or int(locked[0]) != int(row[0]):
            return None
        cur.execute(pgfs._TAKE, named)
        got = cur.fetchone()
    self._forget_dead_sessions()
    return int(got[0])


MUTATIONS: dict[str, tuple[str, Any]] = {
    "guess-lost-commits": ("_settle", _guess),
    "lease-by-db-clock": ("acquire", _acquire_by_db_clock),
}


@contextlib.contextmanager
def mutated(names: tuple[str, ...]) -> Iterator[None]:
    """The store with the holes ``names`` put back while the block runs."""
    saved = [(attr, getattr(PgFileSystem, attr)) for attr, _ in (MUTATIONS[n] for n in names)]
    try:
        for n in names:
            attr, fn = MUTATIONS[n]
            setattr(PgFileSystem, attr, fn)
        yield
    finally:
        for attr, fn in reversed(saved):
            setattr(PgFileSystem, attr, fn)
