"""Limits that hold without configuration: open files and the number of streams (issue: edge hardening)."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import httpx
import pytest

from helpers.servers import ServerProcess

S = "/v1/stream/"
JSON = {"content-type": "application/json"}


def test_groups_transactional_ids_sinks_and_subscriptions_past_the_limit_are_refused_with_429(tmp_path: Path) -> None:
    """Issue 28, item 3: without a guard, nothing bounded them. The server-wide limits (flags) hold
    for anyone; what exists goes on working and a deletion makes room; a sink's task needs a
    transactional id like any other."""
    flags = ("--max-groups", "1", "--max-transactional-ids", "2", "--max-sinks", "1", "--max-subscriptions", "1")
    server = ServerProcess(tmp_path / "data", *flags)
    server.start()

    def limited(r: httpx.Response, flag: str) -> bool:
        return r.status_code == 429 and r.json()["error"]["code"] == "limit" and flag in r.json()["error"]["message"]

    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert c.put(f"{S}s", headers=JSON).status_code == 201
            tail = c.post(f"{S}s", json=[1]).headers["stream-next-offset"]
            assert c.post("/v1/groups/g1/offsets", json={"offsets": {"s": tail}}).status_code == 200
            assert limited(c.post("/v1/groups/g2/offsets", json={"offsets": {"s": tail}}), "--max-groups")
            assert limited(c.post("/v1/groups/g2/reset", json={"to": "latest", "streams": ["s"]}), "--max-groups")
            assert c.post("/v1/groups/g1/offsets", json={"offsets": {"s": tail}}).status_code == 200
            epoch = c.post("/v1/txn/t1/init", json={}).json()["epoch"]
            r = c.post("/v1/txn/t1/offsets", json={"epoch": epoch, "group": "g2", "offsets": {"s": tail}})
            assert limited(r, "--max-groups")
            begin = {"query": "q", "batch": 0, "partition": 0, "task": "a"}
            assert c.post("/v1/sinks/k1/begin", json=begin).status_code == 200
            assert limited(c.post("/v1/sinks/k2/begin", json=begin), "--max-sinks")
            r = c.post("/v1/sinks/k1/begin", json={**begin, "partition": 1, "task": "b"})  # a third id
            assert limited(r, "--max-transactional-ids")
            assert limited(c.post("/v1/txn/t2/init", json={}), "--max-transactional-ids")
            sub = {"type": "pull-wake", "pattern": "subs/*", "wake_stream": "s"}
            assert c.put(f"{S}__ds/subscriptions/x1", json=sub).status_code == 201
            assert limited(c.put(f"{S}__ds/subscriptions/x2", json=sub), "--max-subscriptions")
            assert c.delete("/v1/groups/g1").status_code == 204
            assert c.post("/v1/groups/g2/offsets", json={"offsets": {"s": tail}}).status_code == 200
            assert c.delete("/v1/txn/t1").status_code == 204
            assert c.post("/v1/txn/t2/init", json={}).status_code == 200
    finally:
        server.kill()


@pytest.mark.slow
def test_more_streams_than_open_files_are_served_and_survive_a_restart(tmp_path: Path) -> None:
    """Every stream used to keep its segment file open: under a 256-file limit, a few hundred
    anonymous PUTs made the server answer 503, and it then failed to start on that data (EMFILE)."""
    limit, count = 256, 700
    server = ServerProcess(tmp_path / "data", open_files=limit)
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for i in range(count):
                r = c.put(f"{S}s{i}", headers=JSON)
                assert r.status_code == 201, (i, r.status_code, r.text)
                assert c.post(f"{S}s{i}", json=[{"n": i}]).status_code in (200, 204), i
        server.kill()
        server.start()  # recovery opens every stream's log
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for i in range(count):
                r = c.get(f"{S}s{i}", params={"offset": "-1"})
                assert r.status_code == 200, (i, r.text)
                assert r.json() == [{"n": i}]
            r = c.post(f"{S}s3", json=[{"n": "again"}])  # and appends still work everywhere
            assert r.status_code in (200, 204)
    finally:
        server.kill()


def test_a_stream_past_the_limit_is_refused_with_429(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "data", "--max-streams", "3")
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for i in range(3):
                assert c.put(f"{S}s{i}", headers=JSON).status_code == 201
            r = c.put(f"{S}one-more", headers=JSON)
            assert r.status_code == 429
            assert "--max-streams" in r.json()["error"]["message"]
            assert c.head(f"{S}one-more").status_code == 404  # nothing was created
            assert c.put(f"{S}s1", headers=JSON).status_code == 200  # an existing one is still confirmed
            assert c.delete(f"{S}s0").status_code == 204
            assert c.put(f"{S}one-more", headers=JSON).status_code == 201
    finally:
        server.kill()


def test_answers_the_http_layer_gives_itself_are_counted_in_metrics(tmp_path: Path) -> None:
    """A request the HTTP layer refuses before the app sees it (431 for too many headers, 503 for a
    connection over the cap) never reached the request counters: an operator watching /metrics saw
    nothing while clients were turned away. They are counted by status and code; a request with
    ``Upgrade``, which the app answers, is not a refusal."""
    server = ServerProcess(tmp_path / "data", "--max-connections", "2", "--max-headers", "5")
    server.start()
    try:
        port = int(server.url.rsplit(":", 1)[1])
        heads = "".join(f"x-h{i}: v\r\n" for i in range(8))
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(f"GET /metrics HTTP/1.1\r\nhost: x\r\n{heads}\r\n".encode())
            assert s.recv(65536).startswith(b"HTTP/1.1 431")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /v1/streams HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: h2c\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
        held: list[socket.socket] = []
        refused = False
        try:
            while not refused and len(held) < 10:  # open connections until one is over the cap
                s = socket.create_connection(("127.0.0.1", port), timeout=10)
                held.append(s)
                s.settimeout(0.5)
                try:
                    refused = s.recv(65536).startswith(b"HTTP/1.1 503")
                except TimeoutError:
                    pass  # accepted: it waits for a request
            assert refused
        finally:
            for s in held:
                s.close()
        deadline = time.monotonic() + 10
        while True:  # until the held connections' close reaches the server
            r = httpx.get(server.url + "/metrics", timeout=10)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text
        refusals = {
            (m.group(2), m.group(1)): float(m.group(3))
            for m in re.finditer(r'onceflow_http_refused_total\{code="(\w+)",status="(\d+)"\} (\S+)', r.text)
        }
        assert refusals.get(("431", "too_many_headers")) == 1
        assert refusals.get(("503", "too_many_connections"), 0) >= 1  # a scrape refused above counts too
        assert ("400", "bad_request") not in refusals, refusals
    finally:
        server.kill()
