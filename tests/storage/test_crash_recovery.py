"""Crash and recovery tests: torn writes, garbage, corruption, repeated recovery and kill -9 of the server.

The storage tests damage a log's files the way a crash (or a bad disk) would and check that
:meth:`StreamLog.open` keeps exactly the intact prefix, rebuilds the producer state of that prefix and
accepts new appends right after it. The server test kills a real ``onceflow serve`` process while
idempotent producers append, restarts it and checks exactly-once delivery of every acknowledged append.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from helpers import logkit
from helpers.logkit import ZERO, Spec, Written, append_each, read_all, seg_files
from onceflow.storage.batch import HEADER_SIZE, encode_batch, parse_header
from onceflow.storage.log import SNAPSHOT_NAME, ProducerState, StreamLog, TailState
from onceflow.storage.position import Position, parse_token

# ---------------------------------------------------------------------- storage helpers


def workload(n: int, *, size: int = 50) -> list[Spec]:
    """``n`` appends by three idempotent producers (one bumps its epoch) and an anonymous writer."""
    specs: list[Spec] = []
    epochs = {"alpha": 0, "beta": 0, "gamma": 3}
    seqs = {"alpha": 0, "beta": 0, "gamma": 0}
    for i in range(n):
        payload = bytes(((i * 31 + k) % 254) + 1 for k in range(size + (i * 13) % 40))  # never all zero
        pid = [None, "alpha", "beta", "gamma"][i % 4]
        if pid is None:
            specs.append(Spec(payload=payload, stream_seq=f"s{i:05d}".encode()))
            continue
        if pid == "beta" and i == 10:
            epochs[pid], seqs[pid] = epochs[pid] + 1, 0
        n_rec = 1 + i % 3
        specs.append(
            Spec(
                payload=payload,
                count=n_rec,
                producer_id=pid,
                epoch=epochs[pid],
                first_seq=seqs[pid],
                last_seq=seqs[pid] + n_rec - 1,
            )
        )
        seqs[pid] += n_rec
    return specs


def write_log(directory: Path, specs: list[Spec], *, segment_bytes: int, clean_close: bool = False) -> list[Written]:
    """As logkit.write_log, but by default the files are just dropped: a crash, no closing snapshot."""
    return logkit.write_log(directory, specs, segment_bytes=segment_bytes, clean_close=clean_close)


def append_more(directory: Path, specs: list[Spec], *, segment_bytes: int, use_snapshot: bool = True) -> list[Written]:
    """Open (recovering), append, crash."""

    async def go() -> list[Written]:
        log = StreamLog.open(directory, ZERO, segment_bytes=segment_bytes, use_snapshot=use_snapshot)
        try:
            return await append_each(log, specs)
        finally:
            log.close_files()

    return asyncio.run(go())


def seg_base(path: Path) -> int:
    return int(path.name.split("-")[0])


def sizes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in seg_files(directory)}


def contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in seg_files(directory)}


def segment_of(directory: Path, pos: int) -> Path:
    return [p for p in seg_files(directory) if seg_base(p) <= pos][-1]


def batches_of(written: list[Written]) -> list[tuple[Position, Position, bytes]]:
    return [(w.start, w.end, w.spec.payload) for w in written]


def state_after(written: list[Written], k: int) -> tuple[TailState, dict[str, ProducerState]]:
    """Durable tail and producers after the first ``k`` batches."""
    if k == 0:
        return TailState(ZERO), {}
    return written[k - 1].tail_after, written[k - 1].producers_after


def next_spec(written: list[Written], k: int, producer: str = "alpha") -> Spec:
    """A valid next append for ``producer`` after the first ``k`` batches (a retry of what was lost)."""
    _, producers = state_after(written, k)
    st = producers.get(producer)
    epoch, seq = (st.epoch, st.last_seq + 1) if st is not None else (0, 0)
    return Spec(payload=b"after-recovery", count=1, producer_id=producer, epoch=epoch, first_seq=seq, last_seq=seq)


def restore(src: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)


def snapshot_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def restore_files(files: dict[str, bytes], dst: Path) -> None:
    """Make ``dst`` hold exactly ``files`` (cheaper than a copytree for small logs)."""
    dst.mkdir(exist_ok=True)
    for p in dst.iterdir():
        if p.name not in files:
            p.unlink()
    for name, data in files.items():
        path = dst / name
        if not path.exists() or path.read_bytes() != data:
            path.write_bytes(data)


def assert_recovered_prefix(
    directory: Path, written: list[Written], k: int, *, segment_bytes: int, use_snapshot: bool, then_append: bool = True
) -> None:
    """The log in ``directory`` recovers to exactly the first ``k`` batches and accepts an append after them."""
    tail, producers = state_after(written, k)
    log = StreamLog.open(directory, ZERO, segment_bytes=segment_bytes, use_snapshot=use_snapshot)
    try:
        assert log.durable == tail
        assert log.pending == tail
        assert log.producers == producers
        assert read_all(log) == batches_of(written[:k])
    finally:
        log.close_files()
    # the files hold exactly the prefix: the segment holding its end is cut there, none follow it
    last = segment_of(directory, tail.end.pos)
    assert last == seg_files(directory)[-1]
    assert last.stat().st_size == tail.end.pos - seg_base(last)
    assert sum(sizes(directory).values()) == tail.end.pos
    if not then_append:
        return

    spec = next_spec(written, k)
    [w] = append_more(directory, [spec], segment_bytes=segment_bytes, use_snapshot=use_snapshot)
    assert w.start == tail.end
    assert w.end == Position(tail.end.offset + 1, tail.end.pos + HEADER_SIZE + len("alpha") + len(spec.payload))
    assert w.producers_after["alpha"].last_seq == spec.last_seq
    # and that append survives the next crash
    log = StreamLog.open(directory, ZERO, segment_bytes=segment_bytes, use_snapshot=False)
    try:
        assert log.durable.end == w.end
        assert read_all(log) == [*batches_of(written[:k]), (w.start, w.end, spec.payload)]
        assert log.producers == w.producers_after
    finally:
        log.close_files()


# ---------------------------------------------------------------------- a. torn last batch

# name -> (batches, segment_bytes); the layouts are asserted in the test
LAYOUTS = {
    "one-segment": (6, 1 << 20),
    "mid-segment": (12, 400),
    "first-in-segment": (9, 0),  # segment_bytes chosen so the last batch opens a new segment
}


@pytest.mark.parametrize("mode", ["truncate", "zero-fill"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_torn_last_batch_at_every_byte(tmp_path: Path, layout: str, mode: str) -> None:
    n, segment_bytes = LAYOUTS[layout]
    specs = workload(n)
    if layout == "first-in-segment":
        probe = write_log(tmp_path / "probe", specs, segment_bytes=1 << 20)
        segment_bytes = probe[-2].end.pos  # full after batch N-1, so batch N rolls
    pristine = tmp_path / "pristine"
    written = write_log(pristine, specs, segment_bytes=segment_bytes)
    assert not (pristine / SNAPSHOT_NAME).exists() or layout != "one-segment"
    last = written[-1]
    seg = segment_of(pristine, last.start.pos)
    rel_start, rel_end = last.start.pos - seg_base(seg), last.end.pos - seg_base(seg)
    assert seg == seg_files(pristine)[-1]
    assert seg.stat().st_size == rel_end
    if layout == "one-segment":
        assert len(seg_files(pristine)) == 1
    elif layout == "mid-segment":
        assert len(seg_files(pristine)) >= 3 and rel_start > 0
    else:
        assert len(seg_files(pristine)) == 2 and rel_start == 0

    files = snapshot_files(pristine)
    # the full check (append after recovery, crash again) at the interesting cuts, recovery alone at all
    interesting = {0, 1, 3, 4, 7, 8, 11, 12, 59, 60, 61, rel_end - rel_start - 1}
    work = tmp_path / "work"
    for use_snapshot in (True, False):
        for cut in range(rel_start, rel_end):
            restore_files(files, work)
            target = work / seg.name
            if mode == "truncate":
                os.truncate(target, cut)
            else:  # the file kept its length but the end of the batch never reached the disk
                with open(target, "r+b") as f:
                    f.seek(cut)
                    f.write(b"\0" * (rel_end - cut))
            full = (cut - rel_start) in interesting or (cut - rel_start) % 16 == 5
            assert_recovered_prefix(
                work, written, n - 1, segment_bytes=segment_bytes, use_snapshot=use_snapshot, then_append=full
            )


# ---------------------------------------------------------------------- b. garbage after the last batch


def _garbage_cases(written: list[Written]) -> dict[str, bytes]:
    rng = random.Random(1234)
    end = written[-1].end
    alpha = written[-1].producers_after["alpha"]
    nxt = encode_batch(
        base_offset=end.offset,
        count=1,
        payload=b"never acknowledged",
        producer_id="alpha",
        epoch=alpha.epoch,
        first_seq=alpha.last_seq + 1,
        last_seq=alpha.last_seq + 1,
    )
    wrong_crc = bytes([nxt[0] ^ 0xFF]) + nxt[1:]
    last_batch = encode_batch(
        base_offset=written[-1].start.offset,
        count=written[-1].spec.count,
        payload=written[-1].spec.payload,
        producer_id=written[-1].spec.producer_id,
        epoch=written[-1].spec.epoch,
        first_seq=written[-1].spec.first_seq,
        last_seq=written[-1].spec.last_seq,
    )
    return {
        "random-1": bytes([rng.randrange(256)]),
        "random-59": rng.randbytes(59),
        "random-61": rng.randbytes(61),
        "random-5000": rng.randbytes(5000),
        "zeros-1": b"\0",
        "zeros-60": b"\0" * 60,
        "zeros-4096": b"\0" * 4096,
        "header-wrong-crc": wrong_crc[:HEADER_SIZE],
        "batch-wrong-crc": wrong_crc,
        "batch-wrong-crc-plus-valid": wrong_crc + encode_batch(base_offset=end.offset + 1, count=1, payload=b"x"),
        # intact checksum but not where the log is: replay of the last batch (wrong base offset)
        "replayed-last-batch": last_batch,
    }


@pytest.mark.parametrize("segment_bytes", [1 << 20, 500], ids=["one-segment", "segments"])
def test_garbage_after_last_batch_is_truncated(tmp_path: Path, segment_bytes: int) -> None:
    specs = workload(14)
    pristine = tmp_path / "pristine"
    written = write_log(pristine, specs, segment_bytes=segment_bytes)
    # sanity: the crafted "wrong CRC" batch would otherwise be valid where it sits
    good = _garbage_cases(written)["batch-wrong-crc"]
    with pytest.raises(Exception, match="checksum"):
        parse_header(good, 0)
    assert parse_header(good, 0, verify=False).base_offset == written[-1].end.offset
    work = tmp_path / "work"
    for name, garbage in _garbage_cases(written).items():
        for use_snapshot in (True, False):
            restore(pristine, work)
            last = seg_files(work)[-1]
            with open(last, "ab") as f:
                f.write(garbage)
            assert sum(sizes(work).values()) == written[-1].end.pos + len(garbage), name
            assert_recovered_prefix(work, written, len(written), segment_bytes=segment_bytes, use_snapshot=use_snapshot)


# ---------------------------------------------------------------------- c. corruption in a middle batch


def _flip(directory: Path, pos: int) -> None:
    seg = segment_of(directory, pos)
    with open(seg, "r+b") as f:
        f.seek(pos - seg_base(seg))
        b = f.read(1)
        f.seek(pos - seg_base(seg))
        f.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("where", ["payload", "seq-field", "length-field"])
def test_middle_batch_corruption_keeps_only_the_prefix(tmp_path: Path, where: str) -> None:
    segment_bytes = 450
    specs = workload(16)
    pristine = tmp_path / "pristine"
    written = write_log(pristine, specs, segment_bytes=segment_bytes, clean_close=True)
    segs = seg_files(pristine)
    assert len(segs) >= 4
    stale_snapshot = (pristine / SNAPSHOT_NAME).read_bytes()
    (pristine / SNAPSHOT_NAME).unlink()  # a crash leaves no fresh snapshot
    seg_starts = {seg_base(p) for p in segs}
    first_in_later_segment = next(k for k, w in enumerate(written) if w.start.pos in seg_starts and w.start.pos > 0)
    mid_first_segment = next(k for k, w in enumerate(written) if k > 0 and written[k].end.pos < seg_base(segs[1]))
    candidates = sorted({0, mid_first_segment, first_in_later_segment, len(written) // 2, len(written) - 2})
    offset_in_batch = {"payload": None, "seq-field": 41, "length-field": 5}[where]
    work = tmp_path / "work"
    for k in candidates:
        w = written[k]
        at = w.start.pos + (offset_in_batch if offset_in_batch is not None else (w.end.pos - w.start.pos) // 2 + 30)
        assert w.start.pos <= at < w.end.pos
        for use_snapshot in (True, False):
            restore(pristine, work)
            _flip(work, at)
            later = [p.name for p in seg_files(work) if seg_base(p) > w.start.pos]
            log = StreamLog.open(work, ZERO, segment_bytes=segment_bytes, use_snapshot=use_snapshot)
            try:
                tail, producers = state_after(written, k)
                assert log.durable == tail
                assert log.producers == producers
                assert read_all(log) == batches_of(written[:k])
            finally:
                log.close_files()
            remaining = {p.name for p in seg_files(work)}
            assert not remaining & set(later), "segments after the corrupt batch must be dropped"
            assert seg_files(work)[-1].stat().st_size == w.start.pos - seg_base(seg_files(work)[-1])

            # A stale snapshot that names a tail beyond the recovered end must be ignored.
            (work / SNAPSHOT_NAME).write_bytes(stale_snapshot)
            assert_recovered_prefix(work, written, k, segment_bytes=segment_bytes, use_snapshot=True)


def test_snapshot_written_after_recovery_agrees_with_a_scan(tmp_path: Path) -> None:
    """A snapshot written after recovery (clean close) matches a full scan of the recovered log."""
    specs = workload(10)
    written = write_log(tmp_path, specs, segment_bytes=1 << 20, clean_close=True)
    (tmp_path / SNAPSHOT_NAME).unlink()
    _flip(tmp_path, written[6].start.pos + 70)

    async def reopen_and_close() -> None:
        log = StreamLog.open(tmp_path, ZERO, use_snapshot=False)
        await log.close()

    asyncio.run(reopen_and_close())
    snap = json.loads((tmp_path / SNAPSHOT_NAME).read_text())
    assert snap["end"] == [written[5].end.offset, written[5].end.pos]
    logs = [StreamLog.open(tmp_path, ZERO, use_snapshot=u) for u in (True, False)]
    try:
        for log in logs:
            assert (log.durable, log.producers) == state_after(written, 6)
    finally:
        for log in logs:
            log.close_files()


def test_stale_snapshot_is_not_trusted_after_the_log_grows_past_it(tmp_path: Path) -> None:
    segment_bytes = 1 << 20
    specs = workload(8)
    written = write_log(tmp_path, specs, segment_bytes=segment_bytes, clean_close=True)  # snapshot at batch 8's end
    # the tail of the (synced) log is lost, e.g. a bad sector: the snapshot now names a tail past the end
    [seg] = seg_files(tmp_path)
    os.truncate(seg, written[3].end.pos)
    # recovery (the broker's default, use_snapshot=True) ignores the stale snapshot: correct so far
    log = StreamLog.open(tmp_path, ZERO, segment_bytes=segment_bytes)
    try:
        assert (log.durable, log.producers) == state_after(written, 4)
    finally:
        log.close_files()
    # new acknowledged appends grow the log past the snapshot's tail, then the process crashes
    more = [Spec(payload=b"n" * 120, producer_id="delta", epoch=0, first_seq=i, last_seq=i) for i in range(8)]
    acked = append_more(tmp_path, more, segment_bytes=segment_bytes)
    assert acked[-1].end.pos > written[-1].end.pos
    log = StreamLog.open(tmp_path, ZERO, segment_bytes=segment_bytes)
    try:
        assert log.durable.end == acked[-1].end, "acknowledged appends were lost by recovery"
        assert log.producers == acked[-1].producers_after
    finally:
        log.close_files()


# ---------------------------------------------------------------------- d. repeated recovery


def _damage_torn(d: Path, written: list[Written]) -> None:
    last = seg_files(d)[-1]
    os.truncate(last, last.stat().st_size - 7)
    with open(last, "ab") as f:
        f.write(b"\xab" * 33)


def _damage_middle(d: Path, written: list[Written]) -> None:
    (d / SNAPSHOT_NAME).unlink(missing_ok=True)
    _flip(d, written[len(written) // 3].start.pos + 50)


def _damage_none(d: Path, written: list[Written]) -> None:
    pass


@pytest.mark.parametrize("between", ["crash", "clean-close"])
@pytest.mark.parametrize("use_snapshot", [True, False], ids=["snapshot", "scan"])
@pytest.mark.parametrize("damage", [_damage_torn, _damage_middle, _damage_none], ids=["torn", "middle", "intact"])
def test_repeated_recovery_is_stable(tmp_path: Path, damage, use_snapshot: bool, between: str) -> None:  # type: ignore[no-untyped-def]
    segment_bytes = 500
    written = write_log(tmp_path, workload(15), segment_bytes=segment_bytes)
    damage(tmp_path, written)
    before = contents(tmp_path)

    async def close(log: StreamLog) -> None:
        await log.close()

    seen: list[
        tuple[TailState, dict[str, ProducerState], dict[str, bytes], list[tuple[Position, Position, bytes]]]
    ] = []
    for _ in range(3):
        log = StreamLog.open(tmp_path, ZERO, segment_bytes=segment_bytes, use_snapshot=use_snapshot)
        try:
            seen.append((log.durable, dict(log.producers), contents(tmp_path), read_all(log)))
        finally:
            if between == "crash":
                log.close_files()
            else:
                asyncio.run(close(log))
    assert seen[0] == seen[1] == seen[2]
    tail, producers, files, batches = seen[0]
    # and what recovery kept is a prefix of what was written, with its producer state
    k = len(batches)
    assert batches == batches_of(written[:k])
    assert (tail, producers) == state_after(written, k)
    assert sum(len(b) for b in files.values()) == tail.end.pos
    if damage is _damage_none:
        assert k == len(written) and files == before
    else:
        assert k < len(written) and files != before


# ---------------------------------------------------------------------- e. kill -9 of the server


class KillableServer:
    """``onceflow serve`` in a subprocess on 127.0.0.1; always killed by :meth:`stop`."""

    def __init__(self, data: Path, log_path: Path) -> None:
        self.data = data
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.url = ""
        self._stderr = open(log_path, "ab")  # closed in stop()

    def start(self) -> str:
        assert self.proc is None
        for port in dict.fromkeys([self.port, 0]):  # the previous port first, any free one otherwise
            cmd = [
                sys.executable,
                "-m",
                "onceflow.cli",
                "serve",
                "--data",
                str(self.data),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--long-poll-timeout",
                "0.5",
            ]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._stderr, stdin=subprocess.DEVNULL)
            line = self._ready_line(timeout=30.0)
            if line is not None:
                self.port = int(line.rsplit(":", 1)[1])
                self.url = f"http://127.0.0.1:{self.port}"
                return self.url
            self.kill()
        raise AssertionError(f"server did not start; log:\n{self.log_tail()}")

    def _ready_line(self, timeout: float) -> str | None:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.1)
            if ready:
                raw = self.proc.stdout.readline()
                if not raw:
                    return None  # exited
                text = raw.decode().strip()
                if text.startswith("onceflow listening on http://127.0.0.1:"):
                    return text
            elif self.proc.poll() is not None:
                return None
        return None

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()

    def stop(self) -> None:
        try:
            self.kill()
        finally:
            self._stderr.close()

    def log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""


@pytest.fixture
def crash_server(tmp_path: Path) -> Iterator[KillableServer]:
    srv = KillableServer(tmp_path / "data", tmp_path / "server.log")
    try:
        yield srv
    finally:
        srv.stop()


def read_stream(client: httpx.Client, url: str) -> list[dict[str, int]]:
    """Every message, from the start, following Stream-Next-Offset until Stream-Up-To-Date."""
    out: list[dict[str, int]] = []
    offset = "-1"
    for _ in range(10_000):
        r = client.get(url, params={"offset": offset})
        assert r.status_code == 200, r.text
        out.extend(r.json())
        nxt = r.headers["stream-next-offset"]
        assert parse_token(nxt) is not None
        if r.headers.get("stream-up-to-date") == "true":
            return out
        assert nxt != offset
        offset = nxt
    raise AssertionError("the read never reached the end of the stream")


def producer_headers(pid: str, epoch: int, seq: int) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "Producer-Id": pid,
        "Producer-Epoch": str(epoch),
        "Producer-Seq": str(seq),
    }


@dataclass
class ProducerLog:
    acked: dict[int, int] = field(default_factory=dict)  # seq -> status of the acknowledging response
    attempts: dict[int, int] = field(default_factory=dict)  # seq -> requests it took
    transport_errors: int = 0


@pytest.mark.slow
def test_kill9_during_idempotent_appends_then_retry(crash_server: KillableServer) -> None:
    server = crash_server
    producers = 8
    kills = 3
    rng = random.Random()
    url_lock = threading.Lock()
    current = {"url": server.start() + "/v1/stream/crash"}
    stop = threading.Event()
    abort = threading.Event()  # the test failed: producers give up at once
    logs = [ProducerLog() for _ in range(producers)]
    errors: list[str] = []

    with httpx.Client(timeout=10.0) as client:
        r = client.put(current["url"], headers={"Content-Type": "application/json"})
        assert r.status_code == 201, r.text

    def run_producer(idx: int) -> None:
        pid, plog = f"producer-{idx}", logs[idx]
        seq = 0
        try:
            with httpx.Client(timeout=10.0) as client:
                while not stop.is_set():
                    body = json.dumps({"p": idx, "i": seq}).encode()
                    deadline = time.monotonic() + 45.0
                    attempt = 0
                    while True:  # the same request, with the same seq, until it is acknowledged
                        if abort.is_set():
                            return
                        if time.monotonic() > deadline:
                            errors.append(f"{pid} seq {seq}: not acknowledged in time")
                            return
                        with url_lock:
                            url = current["url"]
                        attempt += 1
                        try:
                            resp = client.post(url, content=body, headers=producer_headers(pid, 0, seq))
                        except httpx.TransportError:
                            plog.transport_errors += 1
                            time.sleep(0.02)
                            continue
                        if resp.status_code in (200, 204):
                            if (
                                resp.headers.get("producer-seq") != str(seq)
                                or parse_token(resp.headers.get("stream-next-offset", "")) is None
                            ):
                                errors.append(f"{pid} seq {seq}: bad headers {dict(resp.headers)}")
                            plog.acked[seq] = resp.status_code
                            plog.attempts[seq] = attempt
                            break
                        if resp.status_code == 503:
                            time.sleep(0.05)
                            continue
                        errors.append(f"{pid} seq {seq}: unexpected {resp.status_code} {resp.text}")
                        return
                    seq += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(f"{pid}: {exc!r}")

    threads = [threading.Thread(target=run_producer, args=(i,), daemon=True) for i in range(producers)]
    for t in threads:
        t.start()
    try:
        for _ in range(kills):
            before = sum(len(p.acked) for p in logs)
            time.sleep(rng.uniform(0.4, 1.2))
            server.kill()
            # progress was made while it was up (otherwise the kill tests nothing)
            assert sum(len(p.acked) for p in logs) > before, server.log_tail()
            new_url = server.start() + "/v1/stream/crash"
            with url_lock:
                current["url"] = new_url
        time.sleep(rng.uniform(0.3, 0.8))
    except BaseException:
        abort.set()
        raise
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors

    with httpx.Client(timeout=10.0) as client:
        messages = read_stream(client, current["url"])
    # kill once more with nothing in flight: everything must still be there after recovery
    server.kill()
    url = server.start() + "/v1/stream/crash"
    with httpx.Client(timeout=10.0) as client:
        assert read_stream(client, url) == messages

    seen = [(m["p"], m["i"]) for m in messages]
    assert len(seen) == len(set(seen)), "a message was stored twice"
    for idx, plog in enumerate(logs):
        mine = [i for p, i in seen if p == idx]
        assert mine == sorted(mine), f"producer {idx} out of order"
        # every acknowledged append is there, exactly once, and nothing that was never sent
        assert mine == sorted(plog.acked) == list(range(len(plog.acked)))
        # a duplicate answer only ever comes for a retried request
        for seq, status in plog.acked.items():
            if status == 204:
                assert plog.attempts[seq] > 1, f"producer {idx} seq {seq}: first attempt answered as a duplicate"
    assert sum(len(p.acked) for p in logs) > 0
    # the kills hit the producers
    assert sum(p.transport_errors for p in logs) >= kills


@pytest.mark.slow
def test_retry_after_restart_is_answered_as_duplicate(crash_server: KillableServer) -> None:
    server = crash_server
    url = server.start() + "/v1/stream/dedup"
    with httpx.Client(timeout=10.0) as client:
        assert client.put(url, headers={"Content-Type": "application/json"}).status_code == 201
        nexts: list[str] = []
        for seq in range(5):
            r = client.post(url, content=json.dumps({"p": 0, "i": seq}), headers=producer_headers("dup", 0, seq))
            assert r.status_code == 200, r.text
            nexts.append(r.headers["stream-next-offset"])
    server.kill()
    url = server.start() + "/v1/stream/dedup"
    with httpx.Client(timeout=10.0) as client:
        for seq in (4, 2, 0):
            r = client.post(url, content=json.dumps({"p": 0, "i": seq}), headers=producer_headers("dup", 0, seq))
            assert r.status_code == 204, (seq, r.status_code, r.text)
            assert r.headers["stream-next-offset"] == nexts[seq]
        r = client.post(url, content=json.dumps({"p": 0, "i": 6}), headers=producer_headers("dup", 0, 6))
        assert r.status_code == 409
        assert r.headers["producer-expected-seq"] == "5"
        r = client.post(url, content=json.dumps({"p": 0, "i": 5}), headers=producer_headers("dup", 0, 5))
        assert r.status_code == 200
        assert r.headers["stream-next-offset"] > nexts[-1]
        assert read_stream(client, url) == [{"p": 0, "i": i} for i in range(6)]
