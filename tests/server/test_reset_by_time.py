"""A group reset by time (``POST /v1/groups/<g>/reset`` with ``"to": "time"``) is bounded by design
(issue 28, item 2): it names at most a cap of streams, finds each stream's offset without reading
the stream from its start, lets other requests in between two streams (and fails if one of them
was deleted meanwhile), and answers exactly what a scan from the earliest offset kept would (the
first batch appended at or after the time, in log order, even where the server's clock stepped
back).

Forks are free to create and share their source's data, so one reset naming many forks of one long
stream is the case that once cost minutes of CPU: it is the case measured here. What is counted is
bytes read from the store (every segment file's ``pread``), never time: this machine is noisy.
Runs on both stores (``ONCEFLOW_TEST_STORE=postgresql``), through the ``onceflow`` fixture.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from helpers.servers import InProcess
from helpers.txn import S
from onceflow.core.broker import StreamState

pytestmark = pytest.mark.anyio


class Clock:
    """Wall clock and monotonic clock in one, moved by the test: append times are exact."""

    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def c(onceflow: InProcess) -> tuple[InProcess, Clock]:
    """The ``onceflow`` server, stamping the streams created from now on with a clock the test moves."""
    clock = Clock()
    onceflow.broker.clock = clock
    return onceflow, clock


S0 = "0000000000000000_0000000000000000"


def ms(clock: Clock) -> int:
    return int(clock.now * 1000)


async def create(c: InProcess, name: str, **headers: str) -> None:
    r = await c.client.put(S + name, headers=headers)
    assert r.status_code == 201, r.text


async def round_of(c: InProcess, name: str, batches: int, size: int = 200) -> None:
    """``batches`` appends of ``size`` bytes, sent at once: one group commit, one append time."""
    outcomes = await asyncio.gather(
        *(c.broker.append(name, b"x" * size, content_type="application/octet-stream") for _ in range(batches))
    )
    assert all(o.kind == "appended" for o in outcomes), outcomes[:3]


def tail(c: InProcess, name: str) -> str:
    s = c.broker.get(name)
    assert s is not None
    return s.tail.token()


def scanned(s: StreamState, time_ms: int) -> str:
    """Where a reset to ``time_ms`` puts a group in ``s``, found as the server found it before issue 28:
    by reading every batch from the earliest offset kept, in log order, to the first one appended at
    or after ``time_ms``; the tail when none was."""
    at, end = s.earliest, s.tail
    while at.pos < end.pos:
        batches = s.read_range(at, 1 << 20, end)
        for b in batches:
            if b.header.timestamp >= time_ms:
                return b.start.token()
        at = batches[-1].end
    return end.token()


async def reset(c: InProcess, time_ms: int, streams: list[str], **body: Any) -> dict[str, str]:
    r = await c.client.post(
        "/v1/groups/g/reset", json={"to": "time", "time_ms": time_ms, "dry_run": True, "streams": streams, **body}
    )
    assert r.status_code == 200, r.text
    offsets: dict[str, str] = r.json()["offsets"]
    return offsets


class ReadCounter:
    """Bytes read from the streams' segment files (on either store) while ``counting``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, c: InProcess, name: str) -> None:
        s = c.broker.get(name)
        assert s is not None
        file_class = type(s.log._segments[0].file)
        real: Callable[[Any, int, int], bytes] = file_class.pread
        self.bytes = 0
        self.counting = False

        def pread(f: Any, n: int, at: int) -> bytes:
            data = real(f, n, at)
            if self.counting:
                self.bytes += len(data)
            return data

        monkeypatch.setattr(file_class, "pread", pread)

    async def during(self, work: Any) -> int:
        """The bytes read while awaiting ``work``."""
        self.bytes, self.counting = 0, True
        try:
            await work
        finally:
            self.counting = False
        return self.bytes


# ---------------------------------------------------------------------- the cap


async def test_a_reset_by_time_naming_more_streams_than_the_cap_is_refused_before_any_work(
    c: tuple[InProcess, Clock],
) -> None:
    """The cap (1,000 streams) is checked first: the refusal names it and what to do, and nothing is
    looked up (the streams named here do not even exist, which would be a 404 otherwise)."""
    server, _ = c
    names = [f"s{i}" for i in range(1001)]
    r = await server.client.post("/v1/groups/g/reset", json={"to": "time", "time_ms": 1, "streams": names})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "bad_request"
    assert "at most 1000 streams" in message and "1001" in message and "in parts" in message
    assert (await server.client.get("/v1/groups")).json() == {"groups": []}
    # the cap is about time: a reset to the earliest offsets finds each in memory
    r = await server.client.post("/v1/groups/g/reset", json={"to": "earliest", "streams": names})
    assert r.status_code == 404 and "no stream named 's0'" in r.json()["error"]["message"]


async def test_a_group_with_more_streams_than_the_cap_is_reset_by_time_in_parts(c: tuple[InProcess, Clock]) -> None:
    """Without ``"streams"`` a reset moves every stream the group has offsets in: past the cap it is
    refused the same way, and naming the streams in parts of at most the cap works."""
    server, _ = c
    server.app.config.max_time_reset_streams = 2
    for name in ("a", "b", "c"):
        await create(server, name)
        await round_of(server, name, 1)
    offsets = {name: tail(server, name) for name in ("a", "b", "c")}
    assert (await server.client.post("/v1/groups/g/offsets", json={"offsets": offsets})).status_code == 200
    r = await server.client.post("/v1/groups/g/reset", json={"to": "time", "time_ms": 0})
    assert r.status_code == 400, r.text
    assert "at most 2 streams" in r.json()["error"]["message"] and "3" in r.json()["error"]["message"]
    assert await reset(server, 0, ["a", "b"], dry_run=False) == {"a": S0, "b": S0}
    assert await reset(server, 0, ["c"], dry_run=False) == {"c": S0}
    assert (await server.client.get("/v1/groups/g/offsets")).json()["offsets"] == {"a": S0, "b": S0, "c": S0}


# ---------------------------------------------------------------------- the cost


async def long_stream_with_forks(c: InProcess, clock: Clock, forks: int) -> tuple[int, int]:
    """``src``: 16,000 batches of 200 bytes (about 4 MiB), in 32 rounds a second apart; ``f0``... its
    forks at its tail. Returns the last round's append time and the log's size in bytes."""
    await create(c, "src")
    for _ in range(32):
        clock.now += 1
        await round_of(c, "src", 500)
    for i in range(forks):
        await create(c, f"f{i}", **{"stream-forked-from": S + "src"})
    s = c.broker.get("src")
    assert s is not None
    return ms(clock), s.tail.pos


async def test_a_reset_by_time_reads_a_long_stream_once_not_once_per_fork(
    c: tuple[InProcess, Clock], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reset naming a long stream and ten forks of it, to a time near its end (a scan from the
    start reads nearly all of it for each): the first reads the stream's batch headers once, for all
    eleven; a second reads a small piece of it per stream named, however long the stream is."""
    server, clock = c
    last, size = await long_stream_with_forks(server, clock, forks=10)
    names = ["src", *(f"f{i}" for i in range(10))]
    src = server.broker.get("src")
    assert src is not None
    want = scanned(src, last)
    assert int(want.split("_")[1]) > size * 9 // 10  # the last round starts near the end
    counter = ReadCounter(monkeypatch, server, "src")
    found: dict[str, str] = {}

    async def run() -> None:
        found.update(await reset(server, last, names))

    first = await counter.during(run())
    assert found == dict.fromkeys(names, want)
    assert first < 2 * size, f"the first reset read {first} bytes of a {size}-byte stream named 11 times"
    found.clear()
    second = await counter.during(run())
    assert found == dict.fromkeys(names, want)
    assert second < size // 3, f"the second reset read {second} bytes of a {size}-byte stream for 11 streams"


async def test_other_requests_are_answered_between_the_streams_of_a_reset(
    c: tuple[InProcess, Clock], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each stream's lookup is one short piece of work on the event loop, and the reset pauses for
    the loop between two of them: a task that runs whenever the loop is free sees the reset's
    lookups one at a time, and a read sent while the reset runs is answered before the reset is."""
    server, clock = c
    last, _ = await long_stream_with_forks(server, clock, forks=30)
    names = [f"f{i}" for i in range(30)]
    await reset(server, last, names)  # whatever the first lookup of the stream prepares is done

    lookups = 0
    real = server.broker.position_at_time

    async def counted(s: StreamState, time_ms: int, **kw: Any) -> Any:
        nonlocal lookups
        got = await real(s, time_ms, **kw)
        lookups += 1
        return got

    monkeypatch.setattr(server.broker, "position_at_time", counted)
    seen: list[int] = []
    running = asyncio.create_task(reset(server, last, names))
    while not running.done():
        seen.append(lookups)
        await asyncio.sleep(0)
    await running
    seen.append(lookups)
    assert lookups == 30
    steps = [b - a for a, b in zip(seen, seen[1:], strict=False)]
    assert max(steps) <= 1, f"the reset did {max(steps)} lookups without letting the loop run"

    lookups = 0
    running = asyncio.create_task(reset(server, last, names))
    while lookups == 0:
        await asyncio.sleep(0)
    r = await server.client.get(S + "f0", params={"offset": "now"})
    assert r.status_code == 200 and not running.done(), "the read waited for the whole reset"
    await running


# ---------------------------------------------------------------------- the answer


async def test_a_reset_by_time_finds_what_a_scan_from_the_start_finds_when_the_clock_steps_back(
    c: tuple[InProcess, Clock],
) -> None:
    """Append times are the server's wall clock, which can step back, and a group commit stamps many
    batches alike. On such a history (several segments, a fork at a point inside it, a fork of that
    fork with appends of its own, a stream retention cut) the offset a reset by time gives every
    stream, for every time around every append time, is the one a scan from the earliest offset
    kept finds: the first batch in log order appended at or after the time."""
    server, clock = c
    server.broker.segment_bytes = 40_000  # several segments, each of several pieces of the index
    stamps = [10, 20, 20, 15, 30, 5, 30, 25, 40, 40, 35, 50, 45]  # seconds after the clock's start
    base = clock.now
    await create(server, "src")
    fork_at = ""
    for i, t in enumerate(stamps):
        clock.now = base + t
        await round_of(server, "src", 60, size=100 + 37 * i)
        if i == 6:
            fork_at = tail(server, "src")
    await create(server, "mid", **{"stream-forked-from": S + "src", "stream-fork-offset": fork_at})
    await create(server, "mid2", **{"stream-forked-from": S + "mid"})
    for t in (12, 60, 8, 60):
        clock.now = base + t
        await round_of(server, "mid2", 40)
    await create(server, "r", **{"stream-retention-bytes": "80000"})
    for t in stamps:
        clock.now = base + t
        await round_of(server, "r", 60, size=300)
    assert (await server.broker.enforce_retention()).get("r", 0) > 0

    names = ["src", "mid", "mid2", "r"]
    streams = [server.broker.get(n) for n in names]
    assert all(s is not None for s in streams)
    seconds = sorted({*stamps, 12, 60, 8})
    times = sorted({int((base + t) * 1000) + d for t in seconds for d in (-1, 0, 1)} | {0})
    for time_ms in times:
        want = {n: scanned(s, time_ms) for n, s in zip(names, streams, strict=True) if s is not None}
        assert await reset(server, time_ms, names) == want, time_ms


async def test_a_stream_deleted_while_the_reset_pauses_fails_it_and_nothing_is_committed(
    c: tuple[InProcess, Clock], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reset pauses between streams, and a stream it looked up may be deleted and created anew
    meanwhile: the offset it found is a position of the deleted stream, and committing it would
    move the group in the new one. The reset fails (404) and the group stays where it was."""
    server, clock = c
    for name in ("a", "b"):
        await create(server, name)
        clock.now += 1
        await round_of(server, name, 3)
    start = ms(clock)
    clock.now += 1
    for name in ("a", "b"):
        await round_of(server, name, 3)
    offsets = {name: tail(server, name) for name in ("a", "b")}
    assert (await server.client.post("/v1/groups/g/offsets", json={"offsets": offsets})).status_code == 200
    real = server.broker.position_at_time

    async def then_replace_a(s: StreamState, time_ms: int, **kw: Any) -> Any:
        got = await real(s, time_ms, **kw)
        if s.name == "a":
            assert (await server.client.delete(S + "a")).status_code == 204
            await create(server, "a")
        return got

    monkeypatch.setattr(server.broker, "position_at_time", then_replace_a)
    r = await server.client.post("/v1/groups/g/reset", json={"to": "time", "time_ms": start, "streams": ["a", "b"]})
    assert r.status_code == 404, r.text
    assert "'a' was deleted while the reset ran" in r.json()["error"]["message"]
    assert (await server.client.get("/v1/groups/g/offsets")).json()["offsets"] == {"b": offsets["b"]}
