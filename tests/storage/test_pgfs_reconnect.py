"""The store's connection pool comes back soon after the database does (issue 30, item 10).

psycopg_pool retries a failed connection 1, 2, 4, 8 s apart: after a database outage of a few
seconds (a failover), the leader kept its lease (the renewals have connections of their own) but its
writes waited up to 4 s more for the pool's next attempt. The store's pool retries at most
:data:`onceflow.storage.pgfs.RECONNECT_MAX` apart, so a write waits at most that long after the
database answers again.

No PostgreSQL here: the "database" is a loopback listener that counts connection attempts and
closes each at once, as a database that is down or restarting does."""

from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("psycopg_pool")

from onceflow.storage import pgfs  # noqa: E402


class _Refuser:
    """Accepts and closes connections at once, counting them."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.attempts: list[float] = []
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.attempts.append(time.monotonic())
            conn.close()

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def test_the_store_pool_tries_again_often_while_the_database_is_down() -> None:
    db = _Refuser()
    pool = pgfs.Connector().pool(
        f"host=127.0.0.1 port={db.port} dbname=x user=x connect_timeout=2",
        min_size=1,
        max_size=1,
        open=False,
        timeout=1,
        name="reconnect-test",
    )
    try:
        pool.open(wait=False)
        time.sleep(4.5)
        attempts = list(db.attempts)
    finally:
        pool.close(timeout=1)
        db.close()
    gaps = [b - a for a, b in zip(attempts, attempts[1:], strict=False)]
    # psycopg_pool's own back-off: attempts at about 0, 1, 3 s (then 7 s): 3 in this window, the
    # last gap 2 s. The store's: at least every RECONNECT_MAX (0.5 s) after the first few.
    assert len(attempts) >= 6, (len(attempts), gaps)
    assert max(gaps[2:]) < 1.5, gaps
