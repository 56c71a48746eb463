"""``onceflow.testing.HaCluster``: two onceflow servers over a PostgreSQL primary and its synchronous
standby. What a failover does to a client that names both servers: nothing it was told is lost,
nothing doubles, whichever part dies (the leading server, then the database's primary)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from onceflow.client import IdempotentProducer, Stream
from onceflow.testing import HaCluster, ServiceUnavailable


@pytest.fixture
def ha() -> Iterator[HaCluster]:
    pytest.importorskip("psycopg_pool", reason="the PostgreSQL store needs psycopg_pool (onceflow[postgresql])")
    try:
        cluster = HaCluster(lease_seconds=2.0)
    except ServiceUnavailable as exc:
        pytest.skip(f"no PostgreSQL to start: {exc}")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_appends_survive_the_leader_and_the_primary_dying(ha: HaCluster) -> None:
    with Stream.connect(ha.url, "orders") as s:
        s.create("application/json")
    with IdempotentProducer(
        ha.url, "orders", producer_id="p", epoch=0, content_type="application/json", delivery_timeout=60.0
    ) as producer:
        for n in range(100):
            producer.append({"n": n})
        producer.flush()
        first = ha.leader()
        ha.kill(first)  # kill -9 of the leading server
        for n in range(100, 200):
            producer.append({"n": n})
        producer.flush()
        assert ha.leader() is not first
        ha.restart(first)  # back, as a follower
        promoted = ha.fail_over_database()  # kill -9 of the primary, the standby promoted
        began = time.monotonic()
        producer.append({"n": 200})
        producer.flush()
        after_promotion = time.monotonic() - began
        for n in range(201, 300):
            producer.append({"n": n})
    assert promoted < 60 and after_promotion < 60  # bounds, not goals: the figures go to docs/reliability.md
    with Stream.connect(ha.url, "orders") as s:
        got = [m["n"] for chunk in s.chunks("-1") for m in chunk.messages()]
    assert got == list(range(300))
