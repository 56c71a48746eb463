"""Fixtures for real PostgreSQL and Redis servers, started for the test session and stopped after.

They never touch the servers on the standard ports: each is a throwaway instance in a temporary
directory on a free loopback port (``onceflow.testing``). Every test under ``tests/sinks`` can ask
for them by name.

``pg`` is a fresh database per test (its conninfo), ``redis_url`` the session's Redis, flushed after
each test, and ``onceflow_url`` an `onceflow serve` subprocess shared by a test module.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from helpers.servers import ServerProcess
from onceflow.testing import PostgresServer, RedisServer, ServiceUnavailable

__all__ = ["drop_prepared", "onceflow_url", "pg", "postgres_server", "redis_server", "redis_url"]

_databases = itertools.count()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    try:
        server = PostgresServer(fsync=False, max_prepared_transactions=32)
    except ServiceUnavailable as exc:
        pytest.skip(f"no PostgreSQL to start: {exc}")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def drop_prepared(conninfo: str) -> list[str]:
    """Roll back every prepared transaction of the database; returns their ids."""
    import psycopg

    with psycopg.connect(conninfo, autocommit=True) as conn:
        gids = [
            r[0]
            for r in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()").fetchall()
        ]
        for gid in gids:
            conn.execute(f"ROLLBACK PREPARED '{gid}'")
    return gids


@pytest.fixture
def pg(postgres_server: PostgresServer) -> Iterator[str]:
    """A new, empty database; its conninfo."""
    import psycopg

    name = f"t{next(_databases)}"
    with psycopg.connect(postgres_server.conninfo(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    conninfo = postgres_server.conninfo(name)
    try:
        yield conninfo
    finally:
        drop_prepared(conninfo)
        with psycopg.connect(postgres_server.conninfo(), autocommit=True) as admin:
            admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    try:
        server = RedisServer()
    except ServiceUnavailable as exc:
        pytest.skip(f"no Redis to start: {exc}")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    import redis

    yield redis_server.url
    with redis.Redis.from_url(redis_server.url) as r:
        r.flushall()


@pytest.fixture(scope="module")
def onceflow_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`onceflow serve` (conftest's ServerProcess) for a whole test module; tests use their own streams."""
    srv = ServerProcess(tmp_path_factory.mktemp("onceflow") / "data")
    srv.start()
    try:
        yield srv.url
    finally:
        srv.kill()
