"""``GET /metrics`` (issue 18): every metric of docs/operations.md driven by real requests and read
back from the scrape, the allow-list of names, and the guard's ``metrics`` scope.

The servers are in-process (an ``App`` behind the ``Instrumented`` layer ``onceflow serve`` puts in
front of it, over httpx's ASGI transport), except one real ``onceflow serve`` that checks the
command wires it all up.
"""

from __future__ import annotations

import asyncio
import errno
import json
import shutil
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import onceflow.storage.log as storage_log
from helpers.servers import ServerProcess
from onceflow.core.broker import Broker
from onceflow.server import routes
from onceflow.server.app import App, AppConfig
from onceflow.server.guard import ENDPOINTS, Guard, GuardConfig, GuardConfigError, route
from onceflow.server.instrument import Instrumented, classify

pytestmark = pytest.mark.anyio
S = "/v1/stream/"
JSON = {"content-type": "application/json"}
REQUESTS = "onceflow_http_request_duration_seconds_count"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class Clock:
    """A clock the test moves: the broker's and the coordinator's time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        return 1_700_000_000.0 + self.now

    def monotonic(self) -> float:
        return self.now


@dataclass
class Server:
    broker: Broker
    app: App
    client: httpx.AsyncClient
    clock: Clock

    async def scrape(self, **headers: str) -> Samples:
        r = await self.client.get("/metrics", headers=headers)
        assert r.status_code == 200, r.text
        return parse(r.text)


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def requests(samples: Samples, route: str, status: int, code: str = "") -> float:
    return value(samples, REQUESTS, route=route, status=str(status), code=code) or 0.0


Serve = Callable[..., AsyncIterator[Server]]


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """Starts in-process servers: ``await make(allow=..., guard=..., **broker options)``."""
    opened: list[tuple[Broker, httpx.AsyncClient]] = []

    async def start(
        *, allow: tuple[str, ...] = (), guard: dict[str, Any] | None = None, long_poll: float = 0.3, **kw: Any
    ) -> Server:
        clock = Clock()
        broker = Broker(tmp_path / f"data{len(opened)}", clock=clock, **kw)
        broker.open()
        app = App(broker, AppConfig(long_poll_timeout=long_poll, max_body_bytes=64 * 1024, metrics_allow=allow))
        inner: Any = app if guard is None else Guard(app, broker, GuardConfig.from_json(guard))
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=Instrumented(inner, app.metrics)), base_url="http://t"
        )
        opened.append((broker, client))
        return Server(broker, app, client, clock)

    yield start
    for broker, client in opened:
        await client.aclose()
        await broker.close()


def producer(pid: str, epoch: int, seq: int) -> dict[str, str]:
    return {**JSON, "producer-id": pid, "producer-epoch": str(epoch), "producer-seq": str(seq)}


async def txn_append(c: httpx.AsyncClient, tid: str, stream: str, body: bytes) -> tuple[int, int]:
    """Begins transaction ``tid`` (a fresh init) with one append to ``stream``: (epoch, txn)."""
    epoch = (await c.post(f"/v1/txn/{tid}/init", json={})).json()["epoch"]
    h = {**producer(f"txn:{tid}", epoch, 0), "transaction-id": tid}
    r = await c.post(S + stream, content=body, headers=h)
    assert r.status_code == 200, r.text
    return epoch, int(r.headers["transaction-number"])


# ---------------------------------------------------------------------- the endpoint


async def test_metrics_are_served_as_prometheus_text_or_openmetrics(make: Callable[..., Any]) -> None:
    srv: Server = await make()
    r = await srv.client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    names = {f.name for f in text_string_to_metric_families(r.text)}
    assert {"onceflow_http_request_duration_seconds", "onceflow_appends", "onceflow_streams"} <= names
    om = await srv.client.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.endswith("# EOF\n")
    head = await srv.client.head("/metrics")
    assert head.status_code == 200 and head.content == b""
    post = await srv.client.post("/metrics")
    assert post.status_code == 405 and post.json()["error"]["code"] == "method_not_allowed"


async def test_each_app_has_its_own_registry(make: Callable[..., Any]) -> None:
    one: Server = await make()
    two: Server = await make()
    await one.client.put(S + "a", headers=JSON)
    assert value(await one.scrape(), "onceflow_streams") == 1
    assert value(await two.scrape(), "onceflow_streams") == 0


# ---------------------------------------------------------------------- per request


async def test_request_latency_is_counted_by_route_status_and_error_code(make: Callable[..., Any]) -> None:
    srv: Server = await make()
    c = srv.client
    assert (await c.put(S + "s", headers=JSON)).status_code == 201
    assert (await c.post(S + "s", content=b"[1]", headers=JSON)).status_code == 204
    assert (await c.post(S + "s", content=b"[2]", headers=producer("p", 0, 0))).status_code == 200
    assert (await c.post(S + "s", content=b"[2]", headers=producer("p", 0, 0))).status_code == 204  # duplicate
    assert (await c.post(S + "s", content=b"[3]", headers=producer("p", 0, 5))).status_code == 409  # gap
    assert (await c.post(S + "s", content=b"[3]", headers=producer("p", 1, 0))).status_code == 200
    assert (await c.post(S + "s", content=b"[4]", headers=producer("p", 0, 1))).status_code == 403  # fenced
    stale = {**JSON, "if-match": "0000000000000000_0000000000000000"}
    assert (await c.post(S + "s", content=b"[5]", headers=stale)).status_code == 412
    assert (await c.get(S + "s", params={"offset": "-1"})).status_code == 200
    assert (await c.get(S + "missing", params={"offset": "-1"})).status_code == 404
    assert (await c.head(S + "s")).status_code == 200
    assert (await c.post("/v1/txn/t/init", json={})).status_code == 200
    assert (await c.get("/nowhere")).status_code == 404
    assert (await c.get("/v1/groups")).status_code == 200  # an operator's listing
    assert (await c.options(S + "s")).status_code == 204
    m = await srv.scrape()
    assert requests(m, "stream.create", 201) == 1
    assert requests(m, "stream.append", 204) == 1
    assert requests(m, "stream.append", 200) == 2
    assert requests(m, "stream.append", 204, "duplicate") == 1
    assert requests(m, "stream.append", 409, "sequence_gap") == 1
    assert requests(m, "stream.append", 403, "stale_epoch") == 1
    assert requests(m, "stream.append", 412, "tail_mismatch") == 1
    assert requests(m, "stream.read", 200) == 1
    assert requests(m, "stream.read", 404, "not_found") == 1
    assert requests(m, "stream.head", 200) == 1
    assert requests(m, "txn.init", 200) == 1
    assert requests(m, "other", 404, "not_found") == 1
    assert requests(m, "groups.list", 200) == 1
    assert requests(m, "options", 204) == 1
    # a histogram: every request falls in the +Inf bucket, and the sum is a duration
    le = value(
        m, "onceflow_http_request_duration_seconds_bucket", route="stream.create", status="201", code="", le="+Inf"
    )
    assert le == 1
    total = value(m, "onceflow_http_request_duration_seconds_sum", route="stream.create", status="201", code="")
    assert total is not None and total > 0


def test_the_route_label_is_the_guards_endpoint_key() -> None:
    """One router for the app, the guard and the metrics (server/routes.py): every key it gives is
    an endpoint of the guard's table, and the label is that key (the name too)."""
    assert routes.KEYS == {e.key for e in ENDPOINTS}
    paths = [
        "/v1/stream/a",
        "/v1/stream/a/b",
        "/v1/stream/__dsx",
        "/v1/stream/__ds",
        "/v1/stream/__ds/jwks.json",
        "/v1/stream/__ds/subscriptions/x",
        "/v1/stream/__ds/subscriptions/x/claim",
        "/v1/stream/__ds/subscriptions/x/ack",
        "/v1/stream/__ds/subscriptions/x/streams",
        "/v1/stream/__ds/subscriptions/x/streams/a/b",
        "/v1/stream/__ds/subscriptions/x/other",
        "/v1/streams",
        "/v1/txn/t/init",
        "/v1/txn/a/b/commit",
        "/v1/txn/t/nope",
        "/v1/txn/t/offsets",
        "/v1/groups/g/offsets",
        "/v1/sinks/s/commit",
        "/v1/sinks/a/b",
        "/v1/txn",
        "/v1/groups",
        "/v1/sinks",
        "/v1/txn/t/force-abort",
        "/v1/groups/g/reset",
        "/v1/sinks/s/reset",
        "/metrics",
        "/ui",
        "/elsewhere",
    ]
    seen = set()
    for method in ("GET", "HEAD", "PUT", "POST", "DELETE", "PATCH"):
        for path in paths:
            scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b""}
            r = routes.route(method, path, scope)
            assert r.key in routes.KEYS, (method, path)
            endpoint, name, _ = route(method, path, dict(scope))
            assert (endpoint.key, name) == (r.key, r.name)
            assert classify(method, dict(scope)) == (r.key, r.name), (method, path)
            assert (r.refused is not None) == (r.key.endswith(".other") or r.key == "other") or r.key in (
                "subs.jwks",
                "subs.wake",
            ), (method, path, r)
            seen.add(r.key)
    assert seen == routes.KEYS  # the sample reaches every endpoint
    live = {"type": "http", "method": "GET", "path": "/v1/stream/a", "query_string": b"offset=now&live=sse"}
    assert classify("GET", live) == ("stream.live", "a")
    assert classify("OPTIONS", live) == ("options", "")


async def test_the_broker_refusing_a_stream_past_its_cap_is_a_429(make: Callable[..., Any]) -> None:
    srv: Server = await make(max_streams=1)
    assert (await srv.client.put(S + "a", headers=JSON)).status_code == 201
    assert (await srv.client.put(S + "b", headers=JSON)).status_code == 429
    assert requests(await srv.scrape(), "stream.create", 429, "limit") == 1


async def test_error_codes_are_a_bounded_set_of_label_values(make: Callable[..., Any]) -> None:
    srv: Server = await make()
    metrics = srv.app.metrics
    for i in range(100):
        metrics.request("other", 400, "code_" + "x" * (i % 30) + chr(ord("a") + i % 26), 0.001)
    metrics.request("other", 400, "not a code: {}", 0.001)
    m = await srv.scrape()
    codes = {dict(labels)["code"] for name, labels in m if name == REQUESTS}
    assert len(codes) <= 65 and "other" in codes
    assert "not a code: {}" not in codes
    assert value(m, REQUESTS, route="other", status="400", code="other") == 100 - 64 + 1
    assert len([labels for labels in metrics.requests if labels[1] == "400"]) == 65
    assert len(metrics._request_keys) <= 66  # the 64 codes, and the scrape's own request


async def test_appends_and_bytes_in_and_out_are_counted(make: Callable[..., Any]) -> None:
    srv: Server = await make()
    c = srv.client
    await c.put(S + "s", headers=JSON)
    bodies = [b'[{"n":1}]', b'[{"n":2},{"n":3}]', b"[4]"]
    for body in bodies:
        assert (await c.post(S + "s", content=body, headers=JSON)).status_code == 204
    assert (await c.post(S + "s", content=b"[5]", headers=producer("p", 0, 0))).status_code == 200
    assert (await c.post(S + "s", content=b"[5]", headers=producer("p", 0, 0))).status_code == 204  # not counted
    assert (await c.post(S + "s", content=b"[6]", headers=producer("p", 0, 9))).status_code == 409  # not counted
    read = await c.get(S + "s", params={"offset": "-1"})
    assert (await c.head(S + "s")).status_code == 200  # no body: nothing read
    m = await srv.scrape()
    assert value(m, "onceflow_appends_total") == 4
    assert value(m, "onceflow_append_bytes_total") == sum(map(len, bodies)) + len(b"[5]")
    assert value(m, "onceflow_read_bytes_total") == len(read.content)


async def test_live_readers_are_counted_while_they_wait(make: Callable[..., Any]) -> None:
    srv: Server = await make(long_poll=30)
    c = srv.client
    await c.put(S + "s", headers=JSON)
    assert value(await srv.scrape(), "onceflow_live_readers") == 0
    reader = asyncio.ensure_future(c.get(S + "s", params={"offset": "now", "live": "long-poll"}))
    for _ in range(1000):  # until the read is waiting (no time is asserted)
        if value(await srv.scrape(), "onceflow_live_readers") == 1:
            break
        await asyncio.sleep(0.005)
    assert value(await srv.scrape(), "onceflow_live_readers") == 1
    await c.post(S + "s", content=b"[1]", headers=JSON)
    r = await reader
    assert r.status_code == 200 and r.json() == [1]
    m = await srv.scrape()
    assert value(m, "onceflow_live_readers") == 0
    assert requests(m, "stream.live", 200) == 1
    assert value(m, "onceflow_read_bytes_total") == len(r.content)


# ---------------------------------------------------------------------- storage


async def test_fsync_latency_and_group_commit_size_are_observed(make: Callable[..., Any]) -> None:
    srv: Server = await make()  # --fsync always: every written group is synced
    c = srv.client
    await c.put(S + "s", headers=JSON)
    n = 12
    results = await asyncio.gather(*(c.post(S + "s", content=b"[%d]" % i, headers=JSON) for i in range(n)))
    assert all(r.status_code == 204 for r in results)
    m = await srv.scrape()
    groups = value(m, "onceflow_group_commit_batches_count")
    assert groups is not None and 1 <= groups <= n
    assert value(m, "onceflow_group_commit_batches_sum") == n  # every batch in exactly one group
    log = srv.broker.streams["s"].log
    assert value(m, "onceflow_group_commit_bytes_sum") == log.durable.end.pos - log.base.pos
    assert value(m, "onceflow_fsync_duration_seconds_count") == groups  # one fsync per group
    assert (value(m, "onceflow_fsync_duration_seconds_sum") or 0) > 0


async def test_without_sync_per_group_no_fsync_is_observed_for_it(make: Callable[..., Any]) -> None:
    srv: Server = await make(fsync="never")
    await srv.client.put(S + "s", headers=JSON)
    await srv.client.post(S + "s", content=b"[1]", headers=JSON)
    m = await srv.scrape()
    assert value(m, "onceflow_group_commit_batches_count") == 1
    assert value(m, "onceflow_fsync_duration_seconds_count") == 0


async def test_store_errors_are_counted_by_operation(make: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    srv: Server = await make()
    c = srv.client
    await c.put(S + "s", headers=JSON)
    assert value(await srv.scrape(), "onceflow_store_errors_total", op="write") == 0

    def no_space(*_args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(storage_log, "_write_all", no_space)
    r = await c.post(S + "s", content=b"[1]", headers=JSON)
    assert r.status_code == 503
    r = await c.post("/v1/txn/t/init", json={})  # the coordinator's log fails too
    assert r.status_code == 503
    monkeypatch.undo()
    m = await srv.scrape()
    assert value(m, "onceflow_store_errors_total", op="write") == 2
    assert requests(m, "stream.append", 503, "unavailable") == 1
    assert value(m, "onceflow_appends_total") == 0
    for op in ("sync", "roll", "snapshot", "create"):
        assert value(m, "onceflow_store_errors_total", op=op) == 0


async def test_a_failed_segment_roll_and_interval_sync_are_store_errors(
    make: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    srv: Server = await make(fsync="interval", segment_bytes=1)
    c = srv.client
    await c.put(S + "s", headers=JSON)
    assert (await c.post(S + "s", content=b"[1]", headers=JSON)).status_code == 204  # the segment is full
    log = srv.broker.streams["s"].log

    def no_space(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(log.fs, "open_file", no_space)  # the next group needs a new segment
    assert (await c.post(S + "s", content=b"[2]", headers=JSON)).status_code == 503
    monkeypatch.undo()
    monkeypatch.setattr(storage_log, "_timed_sync", no_space)
    await c.post(S + "s", content=b"[3]", headers=JSON)
    with pytest.raises(OSError):
        await log.sync()  # what the interval policy's timer does each second
    monkeypatch.undo()
    m = await srv.scrape()
    assert value(m, "onceflow_store_errors_total", op="roll") == 1
    assert value(m, "onceflow_store_errors_total", op="sync") == 1
    assert value(m, "onceflow_store_errors_total", op="write") == 0


# ---------------------------------------------------------------------- state, at scrape time


async def test_streams_are_counted(make: Callable[..., Any]) -> None:
    srv: Server = await make()
    for name in ("a", "b", "c"):
        await srv.client.put(S + name, headers=JSON)
    await srv.client.delete(S + "b")
    assert value(await srv.scrape(), "onceflow_streams") == 2


async def test_open_transactions_their_oldest_age_and_the_lso_lag(make: Callable[..., Any]) -> None:
    srv: Server = await make()
    c = srv.client
    await c.put(S + "s", headers=JSON)
    m = await srv.scrape()
    assert value(m, "onceflow_open_transactions") == 0
    assert value(m, "onceflow_oldest_open_transaction_age_seconds") == 0
    assert value(m, "onceflow_lso_lag_records") == 0
    epoch, txn = await txn_append(c, "t1", "s", b"[1,2]")
    srv.clock.now += 7
    await txn_append(c, "t2", "s", b"[3]")
    srv.clock.now += 2
    await c.post(S + "s", content=b"[4]", headers=JSON)  # after the open transactions: held back too
    m = await srv.scrape()
    assert value(m, "onceflow_open_transactions") == 2
    assert value(m, "onceflow_oldest_open_transaction_age_seconds") == 9
    assert value(m, "onceflow_lso_lag_records") == 4
    r = await c.post("/v1/txn/t1/commit", json={"epoch": epoch, "txn": txn})
    assert r.status_code == 200, r.text
    m = await srv.scrape()
    assert value(m, "onceflow_open_transactions") == 1
    assert value(m, "onceflow_oldest_open_transaction_age_seconds") == 2
    assert value(m, "onceflow_lso_lag_records") == 2  # t2's record and the one after it


async def test_a_fork_lags_behind_a_transaction_open_in_its_source(make: Callable[..., Any]) -> None:
    srv: Server = await make(allow=("fork",))
    c = srv.client
    await c.put(S + "src", headers=JSON)
    await c.post(S + "src", content=b"[1]", headers=JSON)
    await txn_append(c, "t", "src", b"[2,3]")  # open: src's LSO stays before it
    r = await c.put(S + "fork", headers={**JSON, "stream-forked-from": "src"})
    assert r.status_code == 201, r.text
    await c.post(S + "fork", content=b"[4]", headers=JSON)
    m = await srv.scrape()
    assert value(m, "onceflow_lso_lag_records", stream="fork") == 3  # the transaction's two records and [4]
    assert value(m, "onceflow_lso_lag_records", stream="") == 2  # src


async def test_consumer_group_lag_counts_records_up_to_the_stable_offset(make: Callable[..., Any]) -> None:
    srv: Server = await make()
    c = srv.client
    await c.put(S + "s", headers=JSON)
    after = []
    for i in range(3):
        r = await c.post(S + "s", content=b"[%d]" % i, headers=JSON)
        after.append(r.headers["stream-next-offset"])
    assert value(await srv.scrape(), "onceflow_consumer_group_lag_records") == 0  # no group yet
    r = await c.post("/v1/groups/g/offsets", json={"offsets": {"s": after[0]}})
    assert r.status_code == 200, r.text
    assert value(await srv.scrape(), "onceflow_consumer_group_lag_records") == 2
    await txn_append(c, "t", "s", b"[9]")  # not yet readable by a read_committed consumer
    assert value(await srv.scrape(), "onceflow_consumer_group_lag_records") == 2
    await c.post("/v1/groups/g/offsets", json={"offsets": {"s": after[2]}})
    assert value(await srv.scrape(), "onceflow_consumer_group_lag_records") == 0


async def test_consumer_group_lag_counts_only_what_retention_kept(make: Callable[..., Any]) -> None:
    """A group whose committed offset retention deleted lags by what can still be read, as
    ``onceflow groups list`` says."""
    srv: Server = await make(segment_bytes=600)
    c = srv.client
    assert (await c.put(S + "r", headers={**JSON, "stream-retention-bytes": "1200"})).status_code == 201
    offsets = []
    for i in range(40):
        r = await c.post(S + "r", content=b'{"i":%d,"pad":"%s"}' % (i, b"x" * 60), headers=JSON)
        offsets.append(r.headers["stream-next-offset"])
    assert (await c.post("/v1/groups/g/offsets", json={"offsets": {"r": offsets[0]}})).status_code == 200
    assert (await srv.broker.enforce_retention()).get("r", 0) > 0
    earliest = (await c.head(S + "r")).headers["stream-earliest-offset"]
    kept = 40 - int(earliest.split("_")[0])
    assert 0 < kept < 39
    assert value(await srv.scrape(), "onceflow_consumer_group_lag_records") == kept
    (row,) = (await c.get("/v1/groups")).json()["groups"]
    assert row["lag"] == kept


async def test_disk_free_and_size_of_the_data_directory(make: Callable[..., Any]) -> None:
    srv: Server = await make()
    m = await srv.scrape()
    size = value(m, "onceflow_disk_size_bytes")
    free = value(m, "onceflow_disk_free_bytes")
    assert size == shutil.disk_usage(srv.broker.data_dir).total
    assert free is not None and size is not None and 0 < free <= size


async def test_the_process_metrics_of_the_client_library_are_there(make: Callable[..., Any]) -> None:
    srv: Server = await make()
    m = await srv.scrape()
    assert (value(m, "process_open_fds") or 0) > 0
    assert (value(m, "process_resident_memory_bytes") or 0) > 0


# ---------------------------------------------------------------------- the allow-list


async def test_names_get_a_label_only_when_allow_listed(make: Callable[..., Any]) -> None:
    srv: Server = await make(allow=("pub/",))
    c = srv.client
    for name in ("pub/a", "pub/b", "orders/x", "orders/y"):
        await c.put(S + name, headers=JSON)
    await c.post(S + "pub/a", content=b"[1]", headers=JSON)
    await c.post(S + "orders/x", content=b"[1]", headers=JSON)
    await c.post(S + "orders/y", content=b"[22]", headers=JSON)
    read = await c.get(S + "pub/a", params={"offset": "-1"})
    await txn_append(c, "pub/t", "pub/b", b"[1,2,3]")
    await txn_append(c, "orders/t", "orders/x", b"[1]")
    await txn_append(c, "orders/u", "orders/y", b"[1,2]")
    await c.post("/v1/groups/pub/g/offsets", json={"offsets": {"pub/a": "0000000000000000_0000000000000000"}})
    await c.post("/v1/groups/orders/g/offsets", json={"offsets": {"orders/x": "0000000000000000_0000000000000000"}})
    assert (await c.post("/v1/sinks/pub/k/commit", json={"batch": 4, "members": []})).status_code == 200
    assert (await c.post("/v1/sinks/orders/k/commit", json={"batch": 9, "members": []})).status_code == 200
    m = await srv.scrape()
    assert value(m, "onceflow_appends_total", stream="pub/a") == 1
    assert value(m, "onceflow_appends_total", stream="pub/b") == 1  # a transactional append is an append
    assert value(m, "onceflow_appends_total", stream="") == 4  # orders/x and orders/y together
    assert value(m, "onceflow_append_bytes_total", stream="") == len(b"[1][22][1][1,2]")
    assert value(m, "onceflow_read_bytes_total", stream="pub/a") == len(read.content)
    assert value(m, "onceflow_lso_lag_records", stream="pub/b") == 3
    assert value(m, "onceflow_lso_lag_records", stream="pub/a") == 0
    assert value(m, "onceflow_lso_lag_records", stream="") == 2  # the largest of orders/x (1), orders/y (2)
    assert value(m, "onceflow_consumer_group_lag_records", group="pub/g") == 1
    assert value(m, "onceflow_consumer_group_lag_records", group="") == 1
    assert value(m, "onceflow_sink_last_batch", sink="pub/k") == 4
    assert not [labels for name, labels in m if name == "onceflow_sink_last_batch" and ("sink", "orders/k") in labels]
    assert not [labels for name, labels in m if ("stream", "orders/x") in labels]


async def test_stream_labels_follow_the_streams_that_exist(make: Callable[..., Any]) -> None:
    """Issue 28, item 5: with --metrics-allow, 100 create/append/delete cycles left 101 ``stream``
    label values for no stream at all, in memory and in every scrape. A deleted stream's counters
    go with it (a stream created again under the name starts again at 0, as a restarted counter)."""
    srv: Server = await make(allow=("pub/",))
    c = srv.client
    await c.put(S + "pub/kept", headers=JSON)
    await c.post(S + "pub/kept", content=b"[1]", headers=JSON)
    for i in range(100):
        await c.put(S + f"pub/s{i}", headers=JSON)
        await c.post(S + f"pub/s{i}", content=b"[1]", headers=JSON)
        assert (await c.delete(S + f"pub/s{i}")).status_code == 204
    m = await srv.scrape()
    labelled = {dict(labels).get("stream") for name, labels in m if name == "onceflow_appends_total"}
    assert labelled == {"", "pub/kept"}, sorted(x or "" for x in labelled)
    assert len(srv.app.metrics.traffic) < 30  # bounded by the streams there are, not by the cycles
    assert value(m, "onceflow_appends_total", stream="pub/kept") == 1


async def test_a_group_name_that_is_not_utf8_is_refused_and_metrics_stay_up(make: Callable[..., Any]) -> None:
    """A group named in a JSON body can hold a lone surrogate (``"\\ud800"``), which no path can
    name: allow-listed, it became a label the scrape could not encode, and /metrics answered 500
    from then on (the group is in the coordinator log), whoever's group it was."""
    srv: Server = await make(allow=("",))
    c = srv.client
    await c.put(S + "s", headers=JSON)
    end = (await c.post(S + "s", content=b"[1]", headers=JSON)).headers["stream-next-offset"]
    epoch = (await c.post("/v1/txn/t/init", json={})).json()["epoch"]
    body = json.dumps({"epoch": epoch, "group": "g\ud800", "offsets": {"s": end}})  # "g\\ud800" in the JSON
    r = await c.post("/v1/txn/t/offsets", content=body, headers=JSON)
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", r.text
    assert "group" in r.json()["error"]["message"]
    await c.post("/v1/txn/t/commit", json={"epoch": epoch, "txn": (await c.get("/v1/txn/t")).json()["txn"]})
    m = await srv.scrape()
    assert value(m, "onceflow_streams") == 1


async def test_a_group_name_stored_before_the_utf8_check_does_not_break_the_scrape(make: Callable[..., Any]) -> None:
    """A coordinator log written before names in bodies were checked can still hold a group named
    with a lone surrogate. Allow-listed, it must not make every later scrape a 500: the label is
    written with the surrogate escaped, and the other series are still there."""
    srv: Server = await make(allow=("",))
    c = srv.client
    await c.put(S + "s", headers=JSON)
    end = (await c.post(S + "s", content=b"[1,2]", headers=JSON)).headers["stream-next-offset"]
    srv.broker.coordinator.groups["g\ud800"] = {"s": end}  # as replayed from such a log
    srv.broker.coordinator.groups["ok"] = {"s": end}
    r = await c.get("/metrics")
    assert r.status_code == 200, r.text
    m = await srv.scrape()
    assert value(m, "onceflow_streams") == 1
    assert value(m, "onceflow_consumer_group_lag_records", group="ok") == 0
    assert value(m, "onceflow_consumer_group_lag_records", group="g\\ud800") == 0
    listed = await c.get("/v1/groups")  # what `onceflow groups --json` reads
    assert listed.status_code == 200 and {"g\ud800", "ok"} <= {g["group"] for g in listed.json()["groups"]}


async def test_without_an_allow_list_there_is_no_name_label(make: Callable[..., Any]) -> None:
    srv: Server = await make()
    c = srv.client
    await c.put(S + "pub/a", headers=JSON)
    await c.post(S + "pub/a", content=b"[1]", headers=JSON)
    await c.post("/v1/sinks/pub/k/commit", json={"batch": 4, "members": []})
    m = await srv.scrape()
    assert value(m, "onceflow_appends_total") == 1
    assert not [name for name, labels in m if {"stream", "group", "sink"} & {k for k, _ in labels}]


# ---------------------------------------------------------------------- the guard


TOKENS = {
    "scraper": [{"prefix": "", "scopes": ["metrics"]}],
    "admin": [{"prefix": "", "scopes": ["read", "write"]}],
}


async def test_with_the_guard_metrics_needs_the_metrics_scope(make: Callable[..., Any]) -> None:
    srv: Server = await make(guard={"tokens": TOKENS, "limits": {"streams": 1}})
    c = srv.client
    r = await c.get("/metrics")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    r = await c.get("/metrics", headers={"authorization": "Bearer nobody"})
    assert r.status_code == 401
    r = await c.get("/metrics", headers={"authorization": "Bearer admin"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    assert "metrics" in r.json()["error"]["message"]
    admin = {**JSON, "authorization": "Bearer admin"}
    assert (await c.put(S + "a", headers=admin)).status_code == 201
    assert (await c.put(S + "b", headers=admin)).status_code == 429  # the guard's stream limit
    assert (await c.get(S + "a", params={"offset": "-1"})).status_code == 401
    m = await srv.scrape(authorization="Bearer scraper")
    assert requests(m, "metrics", 401, "unauthorized") == 2
    assert requests(m, "metrics", 403, "forbidden") == 1
    assert requests(m, "stream.create", 429, "limit_exceeded") == 1
    assert requests(m, "stream.read", 401, "unauthorized") == 1
    # the scraper's token reads no stream
    r = await c.get(S + "a", params={"offset": "-1"}, headers={"authorization": "Bearer scraper"})
    assert r.status_code == 403


def test_the_metrics_scope_is_given_on_the_whole_server_only() -> None:
    GuardConfig.from_json({"tokens": {"t": [{"prefix": "", "scopes": ["metrics", "read"]}]}})
    with pytest.raises(GuardConfigError, match='covers the whole server: give it in a grant with "prefix": ""'):
        GuardConfig.from_json({"tokens": {"t": [{"prefix": "pub/", "scopes": ["metrics"]}]}})
    with pytest.raises(GuardConfigError, match='"read", "write", "admin", "metrics"'):
        GuardConfig.from_json({"tokens": {"t": [{"prefix": "", "scopes": ["scrape"]}]}})


# ---------------------------------------------------------------------- onceflow serve


@pytest.mark.slow
@pytest.mark.parametrize("front", ["native", "uvicorn"])
def test_onceflow_serve_counts_requests_and_takes_the_allow_list(tmp_path: Path, front: str) -> None:
    srv = ServerProcess(tmp_path / "data", "--http", front, "--metrics-allow", "pub/", "--metrics-allow", "ops/")
    srv.start()
    try:
        with httpx.Client(base_url=srv.url) as c:
            assert c.put(S + "pub/a", headers=JSON).status_code == 201
            assert c.post(S + "pub/a", content=b"[1]", headers=JSON).status_code == 204
            assert c.put(S + "ops/b", headers=JSON).status_code == 201
            assert c.post(S + "ops/b", content=b"[2]", headers=JSON).status_code == 204
            m = parse(c.get("/metrics").text)
    finally:
        srv.kill()
    assert value(m, "onceflow_appends_total", stream="pub/a") == 1
    assert value(m, "onceflow_appends_total", stream="ops/b") == 1
    assert requests(m, "stream.create", 201) == 2
    assert (value(m, "onceflow_fsync_duration_seconds_count") or 0) >= 1
