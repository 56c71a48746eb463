"""Fixtures for a real Redis server, started for the test session and stopped after (PostgreSQL's,
``postgres_server`` and ``pg``, are in tests/conftest.py: the PostgreSQL store's tests use them too).

They never touch the servers on the standard ports: each is a throwaway instance in a temporary
directory on a free loopback port (``onceflow.testing``). Every test under ``tests/sinks`` can ask
for them by name.

``redis_url`` is the session's Redis, flushed after each test, and ``onceflow_url`` an
`onceflow serve` subprocess shared by a test module.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helpers.servers import ServerProcess
from onceflow.testing import RedisServer, ServiceUnavailable

__all__ = ["onceflow_url", "redis_server", "redis_url"]


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
