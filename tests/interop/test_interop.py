"""Interoperability with the Durable Streams ecosystem, in both directions.

1. The official Python client (``durable-streams`` from PyPI) against ``onceflow serve``, on both
   HTTP front ends (the native server and uvicorn), and through the follower of two servers on the
   PostgreSQL store (every request passed on to the leader, docs/ha.md).
2. onceflow's client (``onceflow.client``) against the Node reference server
   (``@durable-streams/server`` from npm, installed into ``.ci/interop`` on first use).
3. The official TypeScript client (``@durable-streams/client`` 0.2.7 from npm, installed into
   ``.ci/ts-client`` by ``scripts/setup.sh dev`` or on first use) against ``onceflow serve`` on both
   front ends and through a PostgreSQL store's follower: ``.ci/ts-client/checks.mjs`` drives it across its API (create with content types, TTL
   and Expires-At, JSON and byte appends, Stream-Seq, the IdempotentProducer with fencing and
   autoClaim, catch-up reads, long-poll, SSE for JSON, text and base64 binary, close with and
   without a final message, where a close without one must leave the tail where it was, HEAD,
   delete, 404/409/400 errors) and prints one PASS/FAIL line per named check.

What each side does not support, and so is not tested here:
- ``durable-streams`` 0.1.0 has no idempotent producer (no ``Producer-*`` headers), cannot close a
  stream, ignores ``Stream-Closed`` (a long-poll read of a closed stream would poll forever; an SSE
  read ends because the server ends the response), refuses SSE on binary content types (no base64
  SSE), needs an explicit ``offset`` for live reads (both servers answer ``400`` without one), and
  maps every ``409`` of an append to ``SeqConflictError``.
- ``@durable-streams/client`` 0.2.7 reports most refusals as a ``FetchError`` (status, headers) from
  its retrying fetch, never reaching its own ``StreamClosedError`` / ``DurableStreamError`` codes,
  so those checks look at the status and headers; its ``connect()`` does not fail for a missing
  stream (``head()`` says ``exists: false``); and its SSE session's ``headers`` are synthetic, so the
  ``Stream-SSE-Data-Encoding`` header is checked through the decoded bytes.
- The reference server has no ``/v1/streams`` listing (so no prefix consumers or topics), no
  ``If-Match`` conditional appends (onceflow's extension), and its fault injection acts before a
  request is processed (a lost acknowledgement is simulated on the client side instead).

Liveness is checked without timing: readers signal when they have caught up or sent a request, the
writer appends only after that, and every wait has a generous upper bound.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from durable_streams import (
    AsyncDurableStream,
    DurableStream,
    DurableStreamError,
    SeqConflictError,
    StreamExistsError,
    StreamNotFoundError,
)

from helpers.servers import ServerProcess
from onceflow.client import (
    AsyncIdempotentProducer,
    AsyncStream,
    ConflictError,
    Consumer,
    IdempotentProducer,
    MemoryOffsetStore,
    ProducerFencedError,
    Stream,
    StreamClosedError,
)
from onceflow.client import StreamNotFoundError as OnceflowNotFound

ROOT = Path(__file__).resolve().parents[2]
INTEROP = ROOT / ".ci" / "interop"
TS_CLIENT = ROOT / ".ci" / "ts-client"
WAIT = 60.0  # upper bound for anything a test waits on; never a timing assertion

HAVE_NODE = shutil.which("node") is not None and shutil.which("npm") is not None
needs_node = pytest.mark.skipif(
    not HAVE_NODE, reason="needs Node.js and npm for the @durable-streams/server reference server"
)

REFERENCE_SERVER_JS = """
import { DurableStreamTestServer } from "@durable-streams/server";
const server = new DurableStreamTestServer({ port: 0, host: "127.0.0.1", longPollTimeout: 500 });
const url = await server.start();
console.log("listening " + url);
let stopping = false;
async function stop() {
  if (stopping) return;
  stopping = true;
  setTimeout(() => process.exit(0), 3000).unref();
  try { await server.stop(); } finally { process.exit(0); }
}
process.stdin.on("end", stop);
process.stdin.on("close", stop);
process.stdin.resume();
process.on("SIGTERM", stop);
"""


def fresh(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


# --------------------------------------------------------------------------------------- servers


@pytest.fixture(scope="module", params=["native", "uvicorn", "postgresql-follower"])
def onceflow_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One ``onceflow serve`` per HTTP front end for the whole module (500 ms long-poll timeout);
    and, ``postgresql-follower``, the follower of two ``onceflow serve --store`` servers over a
    PostgreSQL primary and its synchronous standby: every request of the official clients passes
    through a follower to the leader (its headers sealed, docs/ha.md), and back."""
    if request.param == "postgresql-follower":
        from onceflow.testing import HaCluster, ServiceUnavailable

        cluster = HaCluster(work=tmp_path_factory.mktemp("onceflow-ha"), extra=("--long-poll-timeout", "0.5"))
        try:
            cluster.start()
        except ServiceUnavailable as exc:
            cluster.stop()
            pytest.skip(f"PostgreSQL is not installed here: {exc}")
        try:
            leader = cluster.leader()
            follower = next(s.url for s in cluster.servers if s is not leader)
            for _ in range(600):  # until the follower knows the leader (it reads the lease once a second)
                try:
                    if httpx.get(f"{follower}/v1/leader", timeout=5).json()["leader"] == leader.url:
                        break
                except httpx.TransportError:  # not listening yet: it reaches the store first (a loaded CI)
                    pass
                time.sleep(0.05)
            yield follower
        finally:
            cluster.stop()
        return
    srv = ServerProcess(tmp_path_factory.mktemp(f"onceflow-{request.param}") / "data", "--http", request.param)
    srv.start()
    try:
        yield srv.url
    finally:
        try:
            srv.stop()  # SIGTERM: a clean shutdown with live readers still connected
        finally:
            srv.kill()


def _install_reference_server() -> None:
    if (INTEROP / "node_modules" / "@durable-streams" / "server" / "package.json").exists():
        return
    subprocess.run(
        ["npm", "install", "--no-audit", "--no-fund", "--loglevel=error"], cwd=INTEROP, check=True, timeout=600
    )


@pytest.fixture(scope="module")
def reference_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The Node reference server (in-memory store, 500 ms long-poll timeout) for the whole module."""
    if not HAVE_NODE:
        pytest.skip("needs Node.js and npm")
    _install_reference_server()
    log_path = tmp_path_factory.mktemp("reference") / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            ["node", "--input-type=module", "-e", REFERENCE_SERVER_JS],
            cwd=INTEROP,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + WAIT
        url = ""
        while not url:
            text = log_path.read_text()
            for line in text.splitlines():
                if line.startswith("listening "):
                    url = line.split(" ", 1)[1].strip().rstrip("/")
            if url:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"reference server did not start: {text}")
            time.sleep(0.05)
        assert url.startswith("http://127.0.0.1:"), url
        yield url
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # the script stops the server when its stdin ends
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------------------- helpers


class RequestWatch:
    """An httpx request hook counting the live reads (``live=<mode>``) a client has sent."""

    def __init__(self, live: str) -> None:
        self.live = live
        self.count = 0
        self._cond = threading.Condition()

    def __call__(self, request: httpx.Request) -> None:
        if request.method == "GET" and request.url.params.get("live") == self.live:
            with self._cond:
                self.count += 1
                self._cond.notify_all()

    async def async_hook(self, request: httpx.Request) -> None:
        self(request)

    def wait_for(self, n: int) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.count >= n, WAIT), f"only {self.count} live request(s) sent"


class Background(threading.Thread):
    """Runs ``fn`` in a daemon thread; ``result()`` joins (bounded) and re-raises its exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self._fn = fn
        self._result: Any = None
        self._error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self._result = self._fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self._error = exc

    def result(self) -> Any:
        self.join(WAIT)
        assert not self.is_alive(), "background reader did not finish"
        if self._error is not None:
            raise self._error
        return self._result


def strictly_increasing(offsets: list[str]) -> bool:
    """Offsets of one stream sort lexicographically (protocol), so each append moves them forward."""
    return all(a < b for a, b in zip(offsets, offsets[1:], strict=False))


# ================================================ 1. the official Python client against onceflow


def test_official_json_create_append_catch_up(onceflow_url: str) -> None:
    url = f"{onceflow_url}/v1/stream/{fresh('json')}"
    values: list[Any] = [
        {"id": 1, "text": "héllo"},
        [1, 2, 3],
        "plain string",
        42,
        None,
        {"nested": {"a": [True, False]}},
    ]
    with DurableStream.create(url, content_type="application/json", batching=False) as h:
        assert h.content_type is not None and h.content_type.startswith("application/json")
        offsets = [h.append(v).next_offset for v in values]
        assert strictly_increasing(offsets)
        head = h.head()
        assert head.offset == offsets[-1]
        assert head.content_type is not None and head.content_type.startswith("application/json")

        with h.stream(live=False) as r:
            assert r.read_json() == values  # a list value stays one message
            assert r.offset == offsets[-1]
            assert r.up_to_date
        with h.stream(offset=offsets[1], live=False) as r:
            assert r.read_json() == values[2:]
        with h.stream(offset=offsets[-1], live=False) as r:
            assert r.read_json() == []
        with h.stream(live=False) as r:
            events = list(r.iter_events())
        assert [m for e in events for m in e.data] == values
        assert events[-1].next_offset == offsets[-1] and events[-1].up_to_date

    # the same data through onceflow's own client
    with Stream(url) as s:
        assert list(s.messages()) == values
        assert s.head().next_offset == offsets[-1]


def test_official_bytes_append_connect_and_resume(onceflow_url: str) -> None:
    url = f"{onceflow_url}/v1/stream/{fresh('bytes')}"
    parts: list[bytes | str] = [b"\x00\x01binary\xff", "text héllo\n", b"", b"tail"]
    with DurableStream.create(url, content_type="application/octet-stream") as h:
        offsets = [h.append(p).next_offset for p in parts if p]
    assert strictly_increasing(offsets)
    expected = b"".join(p.encode() if isinstance(p, str) else p for p in parts)

    with DurableStream.connect(url) as h:  # HEAD learns the content type
        assert h.content_type == "application/octet-stream"
        with h.stream(live=False) as r:
            assert b"".join(r) == expected
            assert r.offset == offsets[-1]
        with h.stream(offset=offsets[0], live=False) as r:
            assert r.read_bytes() == b"text h\xc3\xa9llo\ntail"
    with Stream(url) as s:
        assert s.read().data == expected


def test_official_create_semantics_ttl_initial_body_and_delete(onceflow_url: str) -> None:
    url = f"{onceflow_url}/v1/stream/{fresh('life')}"
    with pytest.raises(StreamNotFoundError):
        DurableStream.connect(url)

    with DurableStream.create(url, content_type="text/plain", ttl_seconds=3600, body="seed;") as h:
        with DurableStream.create(url, content_type="text/plain", ttl_seconds=3600) as again:  # same config: idempotent
            assert again.content_type is not None and again.content_type.startswith("text/plain")
        with pytest.raises(StreamExistsError):
            DurableStream.create(url, content_type="application/json")
        h.append("more")
        with h.stream(live=False) as r:
            assert r.read_text() == "seed;more"
        with Stream(url) as s:
            info = s.head()
            assert info.ttl_seconds == 3600
            assert info.content_type.startswith("text/plain")
        assert DurableStream.head_static(url).offset == info.next_offset

        h.delete()
        with pytest.raises(StreamNotFoundError):
            h.head()
        with pytest.raises(StreamNotFoundError), h.stream(live=False):
            pass


def test_official_json_with_charset_and_initial_messages(onceflow_url: str) -> None:
    url = f"{onceflow_url}/v1/stream/{fresh('charset')}"
    seed = [{"seed": 1}, {"seed": "två"}]
    with DurableStream.create(url, content_type="application/json; charset=utf-8", body=seed, batching=False) as h:
        assert h.content_type == "application/json; charset=utf-8"
        last = h.append({"after": "é"}).next_offset
        with h.stream(live=False) as r:
            assert r.read_json() == [*seed, {"after": "é"}]
            assert r.offset == last
        with h.stream(offset="now", live=False) as r:
            assert r.read_json() == []
            assert r.offset == last and r.up_to_date


def test_official_stream_seq_rejects_regression(onceflow_url: str) -> None:
    url = f"{onceflow_url}/v1/stream/{fresh('seq')}"
    with DurableStream.create(url, content_type="text/plain", batching=False) as h:
        h.append("a", seq="0001")
        h.append("b", seq="0002")
        with pytest.raises(SeqConflictError):
            h.append("again", seq="0002")
        with pytest.raises(SeqConflictError):
            h.append("older", seq="0001")
        h.append("c", seq="0010")
        with h.stream(live=False) as r:
            assert r.read_text() == "abc"


def test_official_batched_concurrent_appends_stored_once_in_order(onceflow_url: str) -> None:
    url = f"{onceflow_url}/v1/stream/{fresh('batch')}"
    writers, per_writer = 6, 30
    with DurableStream.create(url, content_type="application/json") as h:  # batching=True

        def write(w: int) -> list[str]:
            return [h.append({"w": w, "n": n}).next_offset for n in range(per_writer)]

        threads = [Background(functools.partial(write, w)) for w in range(writers)]
        results = [t.result() for t in threads]
        with h.stream(live=False) as r:
            stored = r.read_json()
        tail = h.head().offset
    assert len(stored) == writers * per_writer
    for w in range(writers):
        assert [m["n"] for m in stored if m["w"] == w] == list(range(per_writer))  # each writer's order kept
        assert strictly_increasing(results[w]) and results[w][-1] <= tail  # each append acknowledged after the last


def test_official_catch_up_spans_several_responses(onceflow_url: str) -> None:
    """More than one response's worth (~4 MiB each): the client must not stop before the tail."""
    url = f"{onceflow_url}/v1/stream/{fresh('big')}"
    watch = RequestWatch("long-poll")
    gets = []
    blob = os.urandom(1 << 20)
    parts = [bytes([i]) * 7 + blob for i in range(9)]  # ~9 MiB in nine appends
    with httpx.Client(timeout=60, event_hooks={"request": [watch, lambda req: gets.append(req.url)]}) as client:
        with DurableStream.create(url, content_type="application/octet-stream", client=client, batching=False) as h:
            for p in parts:
                h.append(p)
            tail = h.head().offset
            gets.clear()
            with h.stream(live=False) as r:
                assert b"".join(r) == b"".join(parts)
                assert r.offset == tail and r.up_to_date
            assert len(gets) >= 2
            with h.stream() as r:  # live="auto": follow-ups are long-polls, which return data at once
                assert r.read_bytes() == b"".join(parts)
                assert r.offset == tail
    assert watch.count >= 1


def test_official_long_poll_delivers_appends_made_after_the_read_started(onceflow_url: str) -> None:
    url = f"{onceflow_url}/v1/stream/{fresh('lp')}"
    later = [{"n": 1}, {"n": 2, "text": "two"}, [3]]
    watch = RequestWatch("long-poll")
    with (
        DurableStream.create(url, content_type="application/json", batching=False) as writer,
        httpx.Client(timeout=30, event_hooks={"request": [watch]}) as client,
        DurableStream(url, client=client, content_type="application/json") as reader,
    ):
        writer.append({"n": 0})
        tail = writer.head().offset

        def read() -> tuple[list[Any], str]:
            items: list[Any] = []
            with reader.stream(offset=tail, live="long-poll") as r:
                for item in r.iter_json():
                    items.append(item)
                    if len(items) == len(later):
                        break
                return items, r.offset

        bg = Background(read)
        watch.wait_for(2)  # the first long-poll came back empty (204) and the client polled again
        offsets = [writer.append(v).next_offset for v in later]
        items, offset = bg.result()
    assert items == later
    assert offset == offsets[-1]


@pytest.mark.parametrize(
    ("content_type", "before", "after"),
    [
        ("application/json", [{"a": 1}, {"b": "x\ny"}], [{"c": 3}, ["d"]]),
        ("text/plain", ["line one\nline two\n", "x"], ["\nthree", "-four"]),
    ],
    ids=["json", "text"],
)
def test_official_sse_delivers_live_appends_and_ends_when_stream_closes(
    onceflow_url: str, content_type: str, before: list[Any], after: list[Any]
) -> None:
    url = f"{onceflow_url}/v1/stream/{fresh('sse')}"
    caught_up = threading.Event()
    json_mode = content_type == "application/json"
    with (
        DurableStream.create(url, content_type=content_type, batching=False) as writer,
        DurableStream(url, content_type=content_type) as reader,
    ):
        for v in before:
            writer.append(v)

        def read() -> tuple[list[Any], str]:
            got: list[Any] = []
            with reader.stream(offset="-1", live="sse") as r:
                for ev in r.iter_events(mode="json" if json_mode else "text"):
                    if json_mode:
                        got.extend(ev.data)
                    else:
                        got.append(ev.data)
                    if (got if json_mode else "".join(got)) == (before if json_mode else "".join(before)):
                        caught_up.set()
                return got, r.offset  # the loop ends: the server ends the response once the stream is closed

        bg = Background(read)
        assert caught_up.wait(WAIT)
        for v in after:
            writer.append(v)
        with Stream(url) as s:  # the official client cannot close a stream
            final = s.close_stream().next_offset
        got, offset = bg.result()
    if json_mode:
        assert got == before + after
    else:
        assert "".join(got) == "".join(before + after)
    assert offset == final


def test_official_sse_keeps_leading_spaces_of_text_lines(onceflow_url: str) -> None:
    url = f"{onceflow_url}/v1/stream/{fresh('spaces')}"
    text = " one leading space\n  two leading spaces"
    with DurableStream.create(url, content_type="text/plain", batching=False) as h:
        h.append(text)
        with Stream(url) as s:
            s.close_stream()
        with h.stream(live=False) as r:
            assert r.read_text() == text  # catch-up reads are byte-exact
        with h.stream(offset="-1", live="sse") as r:
            got = "".join(r.iter_text())  # ends: the stream is closed
    assert got == text


def test_official_client_on_a_closed_stream(onceflow_url: str) -> None:
    url = f"{onceflow_url}/v1/stream/{fresh('closed')}"
    with DurableStream.create(url, content_type="text/plain", batching=False) as h:
        h.append("all ")
        h.append("there")
        with Stream(url) as s:
            final = s.close_stream().next_offset
        with pytest.raises(DurableStreamError) as err:
            h.append("refused")
        assert err.value.status == 409
        with h.stream(live=False) as r:
            assert r.read_text() == "all there"
            assert r.offset == final
            assert r.headers.get("stream-closed") == "true"
        assert h.head().offset == final


@pytest.mark.anyio
async def test_official_async_client_long_poll_and_catch_up(onceflow_url: str) -> None:
    url = f"{onceflow_url}/v1/stream/{fresh('async')}"
    watch = RequestWatch("long-poll")
    later = [{"late": 1}, {"late": 2}]
    async with (
        await AsyncDurableStream.create(url, content_type="application/json", batching=False) as writer,
        httpx.AsyncClient(timeout=30, event_hooks={"request": [watch.async_hook]}) as client,
        AsyncDurableStream(url, client=client, content_type="application/json") as reader,
    ):
        first = await writer.append({"early": 0})
        got: list[Any] = []

        async def read() -> None:
            async with reader.stream(offset=first.next_offset, live="long-poll") as r:
                async for item in r.iter_json():
                    got.append(item)
                    if len(got) == len(later):
                        return

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                while watch.count < 1:
                    await anyio.sleep(0.01)
                last = None
                for v in later:
                    last = await writer.append(v)
        assert got == later
        async with writer.stream(live=False) as r:
            assert await r.read_json() == [{"early": 0}, *later]
            assert last is not None and r.offset == last.next_offset


# =========================================== 3. the official TypeScript client against onceflow


def _install_ts_client() -> None:
    if (TS_CLIENT / "node_modules" / "@durable-streams" / "client" / "package.json").exists():
        return
    subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=TS_CLIENT, check=True, timeout=600)


@pytest.mark.skipif(not HAVE_NODE, reason="needs Node.js and npm for @durable-streams/client")
def test_official_typescript_client_across_its_api(onceflow_url: str) -> None:
    """Every named check of ``.ci/ts-client/checks.mjs`` passes (the failing ones are listed)."""
    _install_ts_client()
    run = subprocess.run(
        ["node", "checks.mjs", onceflow_url],
        cwd=TS_CLIENT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = run.stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAIL ")]
    passed = [line for line in lines if line.startswith("PASS ")]
    summary = [line for line in lines if line.startswith("SUMMARY ")]
    report = "\n".join(failed) or (run.stdout[-4000:] + run.stderr[-4000:])
    assert not failed and run.returncode == 0, (
        f"{len(failed)} of {len(failed) + len(passed)} TypeScript client checks failed:\n{report}"
    )
    assert summary == [f"SUMMARY passed={len(passed)} failed=0"], report
    assert len(set(passed)) == len(passed), "two checks share a name"
    assert len(passed) >= 100, f"only {len(passed)} checks ran:\n{report}"  # the script ran through


# ========================================== 2. onceflow's client against the Node reference server


@needs_node
def test_reference_json_create_append_read(reference_url: str) -> None:
    with Stream.connect(reference_url, fresh("json")) as s:
        info = s.create("application/json")
        assert s.create("application/json").next_offset == info.next_offset  # same config: idempotent
        with pytest.raises(ConflictError):
            s.create("text/plain")
        offsets = [
            str(s.append({"a": 1}).next_offset),
            str(s.append([1, 2]).next_offset),  # one message that is a list
            str(s.append_many([{"b": 2}, "three", None]).next_offset),
        ]
        assert strictly_increasing([info.next_offset, *offsets])
        assert s.head().next_offset == offsets[-1]
        chunk = s.read()
        assert chunk.messages() == [{"a": 1}, [1, 2], {"b": 2}, "three", None]
        assert chunk.next_offset == offsets[-1] and chunk.up_to_date and not chunk.closed
        assert list(s.messages(offsets[0])) == [[1, 2], {"b": 2}, "three", None]
        assert s.read("now").data == b"" and s.read("now").next_offset == offsets[-1]


@needs_node
def test_reference_bytes_resume_initial_data_ttl_and_delete(reference_url: str) -> None:
    with Stream.connect(reference_url, fresh("bytes")) as s:
        s.create("application/octet-stream", ttl=3600, data=b"seed|")
        assert s.head().ttl_seconds == 3600
        mid = str(s.append(b"\x00\xff\n").next_offset)
        end = s.append("tail").next_offset
        assert [c.data for c in s.chunks()] == [b"seed|\x00\xff\ntail"]
        assert s.read(mid).data == b"tail" and s.read(mid).next_offset == end
        s.delete()
        assert not s.exists()
        with pytest.raises(OnceflowNotFound):
            s.read()


@needs_node
def test_reference_streams_at_any_path(reference_url: str) -> None:
    """The reference server serves streams at any path; onceflow's handles take full stream URLs."""
    url = f"{reference_url}/tenants/acme/{fresh('events')}"
    with Stream(url) as s:
        s.create("application/json")
        s.append({"direct": True})
        with IdempotentProducer(url, producer_id="by-url", epoch=0) as p:  # a full URL, no stream name
            p.append({"produced": True})
        assert list(s.messages()) == [{"direct": True}, {"produced": True}]
        assert s.name == url.rsplit("/", 1)[1]


@needs_node
def test_reference_stream_seq_regression_is_refused(reference_url: str) -> None:
    with Stream.connect(reference_url, fresh("seq")) as s:
        s.create("text/plain")
        s.append("a", seq="0001")
        s.append("b", seq="0002")
        with pytest.raises(ConflictError):
            s.append("again", seq="0002")
        s.append("c", seq="0003")
        assert s.read().data == b"abc"


@needs_node
def test_reference_long_poll_delivers_later_appends_then_eof(reference_url: str) -> None:
    watch = RequestWatch("long-poll")
    name = fresh("lp")
    with (
        Stream.connect(reference_url, name) as writer,
        httpx.Client(timeout=30, event_hooks={"request": [watch]}) as client,
        Stream.connect(reference_url, name, client=client) as reader,
    ):
        writer.create("application/json")
        tail = writer.append({"before": True}).next_offset
        assert tail is not None
        bg = Background(lambda: list(reader.chunks(tail, live="long-poll")))  # runs until the closed chunk
        watch.wait_for(2)  # one long-poll timed out empty (204) and the client polled again
        writer.append({"n": 1})
        writer.append_many([{"n": 2}, {"n": 3}])
        final = writer.close_stream().next_offset
        chunks = bg.result()
    assert [m for c in chunks for m in c.messages()] == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert chunks[-1].closed and chunks[-1].next_offset == final
    assert not any(c.closed for c in chunks[:-1])


@needs_node
@pytest.mark.parametrize(
    ("content_type", "before", "after"),
    [
        ("application/json", [{"a": 1}, {"b": "x\ny"}], [{"c": 3}, ["d"]]),
        ("text/plain", ["line one\nline two\n", "x"], ["\nthree", "-four"]),
        ("application/octet-stream", [b"\x00\x01\n\r\n", b"\xff" * 5], [b"\x80\x81", b"\n\n"]),  # base64 SSE
    ],
    ids=["json", "text", "binary"],
)
def test_reference_sse_live_then_eof(
    reference_url: str, content_type: str, before: list[Any], after: list[Any]
) -> None:
    name = fresh("sse")
    caught_up = threading.Event()
    json_mode = content_type == "application/json"
    with Stream.connect(reference_url, name) as writer, Stream.connect(reference_url, name) as reader:
        writer.create(content_type)
        for v in before:
            writer.append(v)
        expected_before = before if json_mode else b"".join(v.encode() if isinstance(v, str) else v for v in before)

        def read() -> list[Any]:
            chunks = []
            for c in reader.chunks("-1", live="sse"):
                chunks.append(c)
                seen = [m for c in chunks for m in c.messages()] if json_mode else b"".join(c.data for c in chunks)
                if seen == expected_before:
                    caught_up.set()
            return chunks

        bg = Background(read)
        assert caught_up.wait(WAIT)
        for v in after:
            writer.append(v)
        final = writer.close_stream().next_offset
        chunks = bg.result()
    if json_mode:
        assert [m for c in chunks for m in c.messages()] == before + after
    else:
        assert b"".join(c.data for c in chunks) == b"".join(
            v.encode() if isinstance(v, str) else v for v in before + after
        )
    assert chunks[-1].closed and chunks[-1].next_offset == final


@needs_node
def test_reference_close_stream_reports_eof(reference_url: str) -> None:
    with Stream.connect(reference_url, fresh("close")) as s:
        s.create("text/plain")
        s.append("one ")
        closed = s.append("two", close=True)  # append and close in one request
        assert closed.closed
        assert s.close_stream().next_offset == closed.next_offset  # closing again is harmless
        info = s.head()
        assert info.closed and info.next_offset == closed.next_offset
        chunk = s.read()
        assert chunk.data == b"one two" and chunk.closed and chunk.up_to_date
        live = list(s.chunks(closed.next_offset or "", live="long-poll"))  # returns at once: EOF
        assert len(live) == 1 and live[0].closed and live[0].data == b""
        with pytest.raises(StreamClosedError) as err:
            s.append("three")
        assert err.value.next_offset == closed.next_offset
        p = IdempotentProducer(reference_url, s.name, producer_id="late", epoch=0, content_type="text/plain")
        try:
            p.append("refused")
            with pytest.raises(StreamClosedError):
                p.flush(WAIT)  # not retried: a closed stream is final
            assert p.stats.failed == 1 and p.stats.acked == 0
        finally:
            p.close(flush=False)
        assert s.read().data == b"one two"

    with Stream.connect(reference_url, fresh("born-closed")) as s:
        s.create("application/json", closed=True, data=b'[{"only": 1}]')
        chunk = s.read()
        assert chunk.closed and chunk.messages() == [{"only": 1}]


@needs_node
def test_reference_idempotent_producer_pipelined_batches(reference_url: str) -> None:
    name = fresh("prod")
    with Stream.connect(reference_url, name) as s:
        s.create("application/json")
        values = [{"i": i, "pad": "x" * (i % 7)} for i in range(300)]
        with IdempotentProducer(
            reference_url, name, producer_id="pipelined", epoch=0, max_batch_bytes=256, max_in_flight=4
        ) as p:
            for v in values:
                p.append(v)
            p.flush(WAIT)
            stats = p.stats
        assert stats.acked == len(values) and stats.failed == 0
        assert stats.batches_sent > 1
        assert list(s.messages()) == values


@needs_node
def test_reference_producer_retries_injected_faults_without_duplicates(reference_url: str) -> None:
    name = fresh("faults")
    path = f"/v1/stream/{name}"
    with Stream.connect(reference_url, name) as s, httpx.Client(timeout=30) as admin:
        s.create("application/json")

        def inject(**fault: Any) -> None:
            resp = admin.post(f"{reference_url}/_test/inject-error", json={"path": path, "method": "POST", **fault})
            assert resp.status_code == 200, resp.text

        with IdempotentProducer(
            reference_url,
            name,
            producer_id="faulty",
            epoch=0,
            retry_backoff=(0.01, 0.1),
            content_type="application/json",
        ) as p:
            inject(status=503, retryAfter=0, count=3)
            for i in range(10):
                p.append({"i": i})
            p.flush(WAIT)
            inject(dropConnection=True, count=2)
            for i in range(10, 20):
                p.append({"i": i})
            p.flush(WAIT)
            stats = p.stats
        assert stats.retries >= 5 and stats.failed == 0 and stats.acked == 20
        assert list(s.messages()) == [{"i": i} for i in range(20)]
        admin.delete(f"{reference_url}/_test/inject-error")


class LoseAcknowledgements(httpx.AsyncBaseTransport):
    """Forwards every request; the first ``n`` successful (200) append responses are thrown away and
    the client sees a dropped connection: the append is stored, its acknowledgement is lost."""

    def __init__(self, n: int) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.n = n
        self.lost = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.method == "POST" and response.status_code == 200 and self.lost < self.n:
            await response.aread()
            await response.aclose()
            self.lost += 1
            raise httpx.ReadError("acknowledgement lost (test)", request=request)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()


@needs_node
@pytest.mark.anyio
async def test_reference_lost_acknowledgements_are_deduplicated(reference_url: str) -> None:
    name = fresh("lost")
    async with AsyncStream.connect(reference_url, name) as s:
        await s.create("application/json")
        transport = LoseAcknowledgements(2)
        async with httpx.AsyncClient(transport=transport, timeout=30) as client:
            p = AsyncIdempotentProducer(
                reference_url, name, producer_id="lossy", epoch=0, retry_backoff=(0.01, 0.1), client=client
            )
            async with p:
                for i in range(12):
                    p.append({"i": i})
                    if i % 4 == 3:
                        await p.flush(WAIT)  # three batches; the first two are stored but unacknowledged
        assert transport.lost == 2
        assert p.stats.duplicates == 2 and p.stats.acked == 12 and p.stats.failed == 0
        assert [m async for m in s.messages()] == [{"i": i} for i in range(12)]

        # the same by hand: one (id, epoch, seq) sent twice is stored once
        first = await s.append({"manual": 1}, producer=("manual", 0, 0))
        again = await s.append({"manual": 1}, producer=("manual", 0, 0))
        assert not first.duplicate and again.duplicate
        nxt = await s.append({"manual": 2}, producer=("manual", 0, 1))
        assert not nxt.duplicate
        assert [m async for m in s.messages(first.next_offset or "-1")] == [{"manual": 2}]
        assert [m async for m in s.messages()].count({"manual": 1}) == 1


@needs_node
def test_reference_producer_epochs_fence_zombies(reference_url: str) -> None:
    name = fresh("fence")
    with Stream.connect(reference_url, name) as s:
        s.create("application/json")
        old = IdempotentProducer(reference_url, name, producer_id="writer", epoch=1)
        try:
            old.append({"epoch": 1})
            old.flush(WAIT)
            with IdempotentProducer(reference_url, name, producer_id="writer", epoch=2) as new:
                new.append({"epoch": 2})
                new.flush(WAIT)
            old.append({"epoch": "zombie"})
            with pytest.raises(ProducerFencedError) as err:
                old.flush(WAIT)
            assert err.value.current_epoch == 2
        finally:
            old.close(flush=False)
        with IdempotentProducer(reference_url, name, producer_id="writer", epoch=0, auto_claim=True) as claimer:
            claimer.append({"epoch": "claimed"})
            claimer.flush(WAIT)
            assert claimer.epoch == 3
        assert list(s.messages()) == [{"epoch": 1}, {"epoch": 2}, {"epoch": "claimed"}]


@needs_node
@pytest.mark.anyio
async def test_reference_async_stream_sse_and_long_poll(reference_url: str) -> None:
    name = fresh("async")
    async with AsyncStream.connect(reference_url, name) as writer, AsyncStream.connect(reference_url, name) as reader:
        await writer.create("application/json")
        await writer.append({"n": 0})
        got: dict[str, list[Any]] = {"sse": [], "long-poll": []}
        ready = {mode: anyio.Event() for mode in got}

        async def read(mode: Any) -> None:
            async for chunk in reader.chunks("-1", live=mode):
                got[mode].extend(chunk.messages())
                if got[mode] == [{"n": 0}]:
                    ready[mode].set()

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(read, "sse")
                tg.start_soon(read, "long-poll")
                for ev in ready.values():
                    await ev.wait()
                await writer.append({"n": 1})
                await writer.append({"n": 2}, close=True)
        assert got["sse"] == got["long-poll"] == [{"n": 0}, {"n": 1}, {"n": 2}]
        assert (await reader.head()).closed


@needs_node
def test_reference_consumer_with_explicit_streams(reference_url: str) -> None:
    names = [fresh("orders-a"), fresh("orders-b")]
    streams = [Stream.connect(reference_url, n) for n in names]
    try:
        for i, s in enumerate(streams):
            s.create("application/json")
            s.append_many([{"s": i, "n": n} for n in range(5)])
        store = MemoryOffsetStore()

        with Consumer(reference_url, group="g", streams=names, store=store, live=None) as c:
            msgs = list(c)
            c.commit()
            positions = c.positions()
        for i, name in enumerate(names):
            assert [m.value for m in msgs if m.stream == name] == [{"s": i, "n": n} for n in range(5)]
            assert positions[name] == streams[i].head().next_offset

        with Consumer(reference_url, group="g", streams=names, store=store, live=None) as c:
            assert list(c) == []  # everything committed

        streams[1].append({"s": 1, "n": 5})
        with Consumer(reference_url, group="g", streams=names, store=store, live="long-poll") as c:
            deadline = time.monotonic() + WAIT
            live_msgs: list[Any] = []
            while not live_msgs and time.monotonic() < deadline:
                live_msgs = c.poll(timeout=1.0)
            streams[0].append({"s": 0, "n": 5})
            more: list[Any] = []
            while not more and time.monotonic() < deadline:
                more = c.poll(timeout=1.0)
        assert [m.value for m in live_msgs] == [{"s": 1, "n": 5}]
        assert [m.value for m in more] == [{"s": 0, "n": 5}]
    finally:
        for s in streams:
            s.close()
