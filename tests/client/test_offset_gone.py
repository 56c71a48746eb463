"""Readers whose offset retention overtook, against a real server that deletes old segments: a
consumer and the transactional copier either stop with an error naming the earliest offset kept
(the default) or go on from it when told to (``offset_reset="earliest"``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.servers import ServerProcess
from onceflow.client import Consumer, GroupOffsetStore, OffsetGoneError, Retention, Stream
from onceflow.copy import copy_streams

pytestmark = pytest.mark.anyio

SEGMENT = 600  # bytes: a few messages a segment, so a few dozen make several
KEEP = 1200


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("retention") / "data",
        "--segment-bytes",
        str(SEGMENT),
        "--retention-check-interval",
        "0.2",
    )
    srv.start()
    try:
        yield srv.url
    finally:
        srv.kill()


def overtaken(url: str, name: str, n: int = 40) -> tuple[list[str], str]:
    """Create ``name`` keeping ~KEEP bytes, append messages 0..n-1 one by one and wait until
    retention deleted its start; the offsets after each append, and the earliest offset kept."""
    with Stream.connect(url, name) as s:
        s.create("application/json", retention=Retention(bytes=KEEP))
        offsets = [s.append({"i": i, "pad": "x" * 60}).next_offset for i in range(n)]
    give_up = time.monotonic() + 30
    while time.monotonic() < give_up:  # the server's sweep runs every ~1 s
        if "stream-earliest-offset" in httpx.head(f"{url}/v1/stream/{name}").headers:
            time.sleep(1.5)  # one more sweep: each deletes all it may, and nothing is appended any more
            return offsets, httpx.head(f"{url}/v1/stream/{name}").headers["stream-earliest-offset"]
        time.sleep(0.1)
    raise AssertionError(f"retention never deleted the start of {name}")


def numbers(values: list[Any]) -> list[int]:
    return [v["i"] for v in values]


def create(url: str, name: str) -> None:
    with Stream.connect(url, name) as s:
        s.create("application/json")


def everything(url: str, name: str) -> list[Any]:
    with Stream.connect(url, name) as s:
        return list(s.messages())


def commit_group(url: str, group: str, stream: str, offset: str) -> None:
    GroupOffsetStore(url).commit(group, {stream: offset})


def test_a_consumer_whose_offset_fell_off_is_told_where_the_data_begins_now(url: str) -> None:
    offsets, earliest = overtaken(url, "c/err")
    commit_group(url, "late", "c/err", offsets[2])
    with (
        Consumer(url, group="late", streams=["c/err"], delivery="exactly-once", live=None) as consumer,
        pytest.raises(OffsetGoneError) as gone,
    ):
        consumer.poll(timeout=10)
    assert gone.value.earliest_offset == earliest and earliest in str(gone.value)


def test_a_consumer_told_to_reset_goes_on_from_the_earliest_offset_kept(url: str) -> None:
    offsets, earliest = overtaken(url, "c/reset")
    commit_group(url, "late2", "c/reset", offsets[2])
    got: list[int] = []
    with Consumer(
        url, group="late2", streams=["c/reset"], delivery="exactly-once", live=None, offset_reset="earliest"
    ) as consumer:
        while batch := consumer.poll(timeout=10):
            got += numbers([m.value for m in batch])
    first = offsets.index(earliest) + 1  # the message right after the earliest offset
    assert got == list(range(first, 40)) and first > 3


async def test_the_transactional_copier_stops_or_resets_as_told(url: str) -> None:
    offsets, earliest = overtaken(url, "cp/in")
    create(url, "cp/out")
    commit_group(url, "copier", "cp/in", offsets[2])
    with pytest.raises(OffsetGoneError):
        await copy_streams(url, ["cp/in"], ["cp/out"], transactional_id="cp", group="copier")
    assert everything(url, "cp/out") == []  # nothing half-copied
    copied = await copy_streams(
        url, ["cp/in"], ["cp/out"], transactional_id="cp", group="copier", offset_reset="earliest"
    )
    first = offsets.index(earliest) + 1
    assert copied == 40 - first
    assert sorted(numbers(everything(url, "cp/out"))) == list(range(first, 40))
    # and the group's offset moved past what was deleted: a rerun copies nothing more
    assert await copy_streams(url, ["cp/in"], ["cp/out"], transactional_id="cp", group="copier") == 0


def test_the_copier_command_says_what_happened_in_one_line(url: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    offsets, earliest = overtaken(url, "cmd/in")
    create(url, "cmd/out")
    commit_group(url, "cmd", "cmd/in", offsets[1])
    out = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "copy", "--url", url, "--input", "cmd/in", "--output", "cmd/out"]
        + ["--transactional-id", "cmd", "--group", "cmd", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr and earliest in out.stderr and "offset" in out.stderr, out.stderr
