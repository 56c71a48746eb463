"""Limits that hold without configuration: open files and the number of streams (issue: edge hardening)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from helpers.servers import ServerProcess

S = "/v1/stream/"
JSON = {"content-type": "application/json"}


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
