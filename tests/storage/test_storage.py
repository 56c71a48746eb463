"""Unit tests of the storage layer: batch framing, positions and StreamLog (no HTTP)."""

from __future__ import annotations

import asyncio
import json
import os
import struct
import tempfile
from pathlib import Path

import crc32c
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.logkit import ZERO, Spec, producer_specs, read_all, seg_files, write_log
from onceflow.storage.batch import (
    FLAG_CLOSE,
    FLAG_JSON,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_BATCH_BYTES,
    CorruptBatch,
    encode_batch,
    parse_header,
)
from onceflow.storage.log import SNAPSHOT_NAME, InvalidPosition, ProducerState, StreamLog, TailState
from onceflow.storage.position import Position, parse_token

# ---------------------------------------------------------------------- helpers


def dir_bytes(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in seg_files(directory)}


# ---------------------------------------------------------------------- batch format


def test_header_layout_is_60_bytes() -> None:
    assert HEADER_SIZE == 60
    assert HEADER.size == 60


def test_batch_round_trip_with_producer_and_stream_seq() -> None:
    payload = b'{"a":1},{"b":2},'
    data = encode_batch(
        base_offset=1234,
        count=2,
        payload=payload,
        flags=FLAG_JSON | FLAG_CLOSE,
        producer_id="prod-\u00e9",
        epoch=3,
        first_seq=10,
        last_seq=11,
        stream_seq=b"seq-0042",
        timestamp=1_700_000_000_123,
    )
    pid = "prod-\u00e9".encode()
    assert len(data) == HEADER_SIZE + len(pid) + len(b"seq-0042") + len(payload)
    # the stored CRC32C covers exactly bytes [4, length)
    assert struct.unpack_from("<I", data, 0)[0] == crc32c.crc32c(data[4:])
    assert struct.unpack_from("<I", data, 4)[0] == len(data)
    assert data[8] == MAGIC

    h = parse_header(data, 0)
    assert h.length == len(data)
    assert h.flags == FLAG_JSON | FLAG_CLOSE
    assert h.closes
    assert h.base_offset == 1234
    assert h.count == 2
    assert h.timestamp == 1_700_000_000_123
    assert (h.epoch, h.first_seq, h.last_seq) == (3, 10, 11)
    assert h.producer_id == "prod-\u00e9"
    assert h.stream_seq == b"seq-0042"
    assert data[h.payload_start : h.length] == payload


def test_batch_round_trip_without_producer() -> None:
    # producer fields are forced to -1 when no producer id is given
    data = encode_batch(base_offset=0, count=1, payload=b"hello", epoch=5, first_seq=6, last_seq=7)
    h = parse_header(data, 0)
    assert h.producer_id is None
    assert (h.epoch, h.first_seq, h.last_seq) == (-1, -1, -1)
    assert h.stream_seq is None
    assert not h.closes
    assert data[h.payload_start :] == b"hello"


def test_parse_at_an_offset_inside_a_larger_buffer() -> None:
    a = encode_batch(base_offset=0, count=1, payload=b"first")
    b = encode_batch(base_offset=1, count=3, payload=b"second batch", producer_id="p", epoch=0, first_seq=0, last_seq=2)
    buf = a + b + b"trailing"
    ha = parse_header(buf, 0)
    hb = parse_header(buf, ha.length)
    assert (ha.base_offset, ha.count) == (0, 1)
    assert (hb.base_offset, hb.count, hb.producer_id) == (1, 3, "p")
    start = ha.length
    assert buf[start + hb.payload_start : start + hb.length] == b"second batch"
    # the same through a memoryview
    assert parse_header(memoryview(buf), ha.length) == hb


def test_parse_rejects_bad_magic_even_without_verify() -> None:
    data = bytearray(encode_batch(base_offset=0, count=1, payload=b"x" * 20))
    data[8] = 0xB2
    # re-seal the checksum so only the magic is wrong
    struct.pack_into("<I", data, 0, crc32c.crc32c(bytes(data[4:])))
    with pytest.raises(CorruptBatch, match="magic"):
        parse_header(bytes(data), 0)
    with pytest.raises(CorruptBatch, match="magic"):
        parse_header(bytes(data), 0, verify=False)


@pytest.mark.parametrize("verify", [True, False])
def test_parse_rejects_every_short_buffer(verify: bool) -> None:
    data = encode_batch(
        base_offset=7, count=1, payload=b"payload-bytes" * 3, producer_id="abc", epoch=0, first_seq=0, last_seq=0
    )
    for n in range(len(data)):
        with pytest.raises(CorruptBatch, match="truncated"):
            parse_header(data[:n], 0, verify=verify)
        # also when the batch starts further into the buffer
        with pytest.raises(CorruptBatch, match="truncated"):
            parse_header(b"\0" * 13 + data[:n], 13, verify=verify)
    assert parse_header(data, 0, verify=verify).length == len(data)


def test_parse_rejects_checksum_mismatch_for_every_flipped_byte() -> None:
    data = encode_batch(
        base_offset=99,
        count=2,
        payload=b"0123456789abcdef",
        producer_id="pp",
        epoch=1,
        first_seq=4,
        last_seq=5,
        stream_seq=b"s1",
    )
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x5A
        with pytest.raises(CorruptBatch):
            parse_header(bytes(bad), 0)
    # A payload byte flip is only caught by the checksum.
    bad = bytearray(data)
    bad[-1] ^= 0x01
    with pytest.raises(CorruptBatch, match="checksum"):
        parse_header(bytes(bad), 0)
    assert parse_header(bytes(bad), 0, verify=False).length == len(data)
    # So is a wrong CRC field itself.
    bad = bytearray(data)
    bad[0] ^= 0x80
    with pytest.raises(CorruptBatch, match="checksum"):
        parse_header(bytes(bad), 0)


def _resealed(data: bytes, **fields: int) -> bytes:
    """``data`` with header fields overwritten and a valid checksum again."""
    names = [
        "crc",
        "length",
        "magic",
        "flags",
        "res",
        "base",
        "count",
        "ts",
        "epoch",
        "fseq",
        "lseq",
        "pid_len",
        "sseq_len",
    ]
    values = dict(zip(names, HEADER.unpack_from(data, 0), strict=True))
    values.update(fields)
    head = HEADER.pack(*(values[n] for n in names))
    body = head[4:] + data[HEADER_SIZE:]
    return struct.pack("<I", crc32c.crc32c(body)) + body


def test_parse_rejects_impossible_lengths_and_negative_count() -> None:
    data = encode_batch(base_offset=0, count=1, payload=b"abcdef", producer_id="xy", epoch=0, first_seq=0, last_seq=0)
    with pytest.raises(CorruptBatch, match="length"):
        parse_header(_resealed(data, length=HEADER_SIZE - 1), 0)
    with pytest.raises(CorruptBatch, match="length"):  # shorter than header + producer id
        parse_header(_resealed(data, length=HEADER_SIZE + 1), 0)
    with pytest.raises(CorruptBatch, match="length"):
        parse_header(_resealed(data, length=MAX_BATCH_BYTES + 1), 0)
    with pytest.raises(CorruptBatch, match="negative"):
        parse_header(_resealed(data, count=-1), 0)
    assert parse_header(_resealed(data), 0).count == 1


def test_encode_rejects_oversized_producer_id() -> None:
    with pytest.raises(ValueError):
        encode_batch(base_offset=0, count=1, payload=b"", producer_id="p" * 0x10000, epoch=0, first_seq=0, last_seq=0)
    with pytest.raises(ValueError):
        encode_batch(base_offset=0, count=1, payload=b"", stream_seq=b"s" * 0x10000)


# ---------------------------------------------------------------------- positions


def test_position_tokens_round_trip_and_sort() -> None:
    positions = [Position(0, 0), Position(1, 61), Position(10, 700), Position(12345, 10**12)]
    for p in positions:
        assert parse_token(p.token()) == p
    tokens = [p.token() for p in positions]
    assert tokens == sorted(tokens)
    for bad in ["", "-1", "now", "0_0", "000000000000000a_0000000000000000", "0000000000000000_0000000000000000_"]:
        assert parse_token(bad) is None


# ---------------------------------------------------------------------- StreamLog


def _mixed_specs() -> list[Spec]:
    specs: list[Spec] = []
    seqs = {"a": 0, "b": 0}
    for i in range(40):
        size = (i * 97) % 900
        payload = bytes((i + k) % 256 for k in range(size))
        if i % 3 == 0:
            specs.append(Spec(payload=payload, count=1 if payload else 0))
        else:
            pid = "a" if i % 3 == 1 else "b"
            n = 1 + i % 2
            specs.append(
                Spec(
                    payload=payload,
                    count=n,
                    producer_id=pid,
                    epoch=0,
                    first_seq=seqs[pid],
                    last_seq=seqs[pid] + n - 1,
                    stream_seq=f"{i:04d}".encode(),
                )
            )
            seqs[pid] += n
    return specs


def test_append_and_read_round_trip(tmp_path: Path) -> None:
    specs = _mixed_specs()
    written = write_log(tmp_path, specs)
    assert written[0].start == ZERO
    for prev, cur in zip(written, written[1:], strict=False):
        assert cur.start == prev.end
    for w in written:
        assert w.end.offset == w.start.offset + w.spec.count
    log = StreamLog.open(tmp_path, ZERO)
    try:
        assert log.durable.end == written[-1].end
        got = log.read(ZERO, 1 << 30)
        assert [(b.start, b.end, b.payload) for b in got] == [(w.start, w.end, w.spec.payload) for w in written]
        for b, w in zip(got, written, strict=True):
            assert b.header.producer_id == w.spec.producer_id
            assert (b.header.first_seq, b.header.last_seq) == (w.spec.first_seq, w.spec.last_seq)
            assert b.header.stream_seq == w.spec.stream_seq
        # a read starting at any boundary returns exactly the suffix
        for k, w in enumerate(written):
            assert [b.start for b in log.read(w.start, 1 << 30)] == [x.start for x in written[k:]]
        assert log.read(log.durable.end, 1 << 30) == []
    finally:
        asyncio.run(log.close())


def test_group_commit_of_many_staged_batches(tmp_path: Path) -> None:
    specs = producer_specs("g", 50, size=10)

    async def go() -> list[Position]:
        log = StreamLog.open(tmp_path, ZERO, segment_bytes=1024)
        try:
            staged = [log.stage(**s.kwargs()) for s in specs]  # type: ignore[arg-type]
            # staging moves the pending tail but nothing is durable until the group is written
            assert log.pending.end == staged[-1].end
            assert log.durable.end == ZERO
            assert log.producer("g") is not None and log.producer("g").last_seq == 49  # type: ignore[union-attr]
            assert log.durable_producer("g") is None
            await asyncio.gather(*(s.done for s in staged))
            assert log.durable.end == staged[-1].end
            return [s.start for s in staged]
        finally:
            await log.close()

    starts = asyncio.run(go())
    log = StreamLog.open(tmp_path, ZERO, segment_bytes=1024, use_snapshot=False)
    try:
        assert [b.start for b in log.read(ZERO, 1 << 30)] == starts
        assert [b.payload for b in log.read(ZERO, 1 << 30)] == [s.payload for s in specs]
        assert log.producers["g"].last_seq == 49
    finally:
        log.close_files()


@pytest.mark.parametrize("max_bytes", [1, HEADER_SIZE, 100, 333, 1000, 5000])
def test_small_reads_split_across_batches_and_segments(tmp_path: Path, max_bytes: int) -> None:
    specs = _mixed_specs()
    written = write_log(tmp_path, specs, segment_bytes=4096)
    assert len(seg_files(tmp_path)) > 3, "the test needs segment rolls"
    log = StreamLog.open(tmp_path, ZERO, segment_bytes=4096)
    try:
        expected = [(w.start, w.end, w.spec.payload) for w in written]
        at = ZERO
        got: list[tuple[Position, Position, bytes]] = []
        calls = 0
        while at != log.durable.end:
            batches = log.read(at, max_bytes)
            calls += 1
            assert batches, "a read before the end returns at least one batch"
            lengths = [b.end.pos - b.start.pos for b in batches]
            # the budget is only exceeded by the batch that exhausted it
            assert sum(lengths[:-1]) < max_bytes
            for b in batches:
                assert b.start == at
                got.append((b.start, b.end, b.payload))
                at = b.end
        assert got == expected
        if max_bytes <= HEADER_SIZE:
            assert calls == len(written)
        # a whole-log read crosses every segment boundary in one call
        assert [(b.start, b.end, b.payload) for b in log.read(ZERO, 1 << 30)] == expected
        # read with a limit stops at the limit
        mid = written[len(written) // 2].start
        assert [b.end for b in log.read(ZERO, 1 << 30, limit=mid)][-1] == mid
    finally:
        log.close_files()


def test_check_position_accepts_boundaries_only(tmp_path: Path) -> None:
    specs = [Spec(payload=bytes([0x11]) * (30 + 7 * i), count=1 + i % 3) for i in range(30)]
    written = write_log(tmp_path, specs, segment_bytes=512)
    assert len(seg_files(tmp_path)) > 2
    log = StreamLog.open(tmp_path, ZERO, segment_bytes=512)
    try:
        end = log.durable.end
        boundaries = [w.start for w in written] + [end]
        for b in boundaries:
            log.check_position(b)
        by_pos = {b.pos: b for b in boundaries}
        # every other byte position, with the offsets a forger would try
        for pos in range(end.pos + 1):
            near = max(b for b in boundaries if b.pos <= pos)
            for offset in {near.offset, near.offset + 1, 0}:
                at = Position(offset, pos)
                if by_pos.get(pos) == at:
                    continue
                with pytest.raises(InvalidPosition):
                    log.check_position(at)
        # past the end
        for at in (
            Position(end.offset, end.pos + 1),
            Position(end.offset + 1, end.pos),
            Position(end.offset + 5, end.pos + 500),
        ):
            with pytest.raises(InvalidPosition):
                log.check_position(at)
    finally:
        log.close_files()


def test_check_position_rejects_a_header_copied_inside_a_payload(tmp_path: Path) -> None:
    # A payload carrying the bytes of a batch header (its checksum no longer matching) is not a
    # boundary. A *complete, checksum-valid* batch embedded in one's own payload still passes: see
    # docs/storage.md ("Offsets") for why that only ever misleads the client that forged the offset.
    forged = bytearray(encode_batch(base_offset=0, count=1, payload=b"FORGED"))
    forged[0] ^= 0xFF
    written = write_log(tmp_path, [Spec(payload=bytes(forged))])
    log = StreamLog.open(tmp_path, ZERO)
    try:
        inside = Position(0, written[0].start.pos + HEADER_SIZE)  # where the payload starts: not a boundary
        with pytest.raises(InvalidPosition):
            log.check_position(inside)
        log.check_position(written[0].start)
    finally:
        log.close_files()


def _state(log: StreamLog) -> tuple[TailState, dict[str, ProducerState]]:
    return log.durable, dict(log.producers)


@pytest.mark.parametrize("clean_close", [True, False], ids=["close", "crash"])
@pytest.mark.parametrize("use_snapshot", [True, False], ids=["snapshot", "scan"])
def test_producer_state_rebuilt_after_reopen(tmp_path: Path, use_snapshot: bool, clean_close: bool) -> None:
    specs = (
        producer_specs("p1", 8)
        + producer_specs("p2", 3, epoch=2)
        + [Spec(payload=b"anon", stream_seq=b"zz")]
        + producer_specs("p1", 4, epoch=1)  # new epoch restarts at 0
        + producer_specs("p2", 2, epoch=2, seq0=3)
    )
    written = write_log(tmp_path, specs, segment_bytes=600, clean_close=clean_close)
    assert (tmp_path / SNAPSHOT_NAME).exists()  # written at segment rolls and/or on close
    before = dir_bytes(tmp_path)
    expected_tail, expected_producers = written[-1].tail_after, written[-1].producers_after
    assert expected_producers["p1"].epoch == 1 and expected_producers["p1"].last_seq == 3
    assert expected_producers["p2"].epoch == 2 and expected_producers["p2"].last_seq == 4
    assert expected_tail.stream_seq == b"zz"
    for _ in range(2):
        log = StreamLog.open(tmp_path, ZERO, segment_bytes=600, use_snapshot=use_snapshot)
        try:
            assert _state(log) == (expected_tail, expected_producers)
            assert log.pending == log.durable
        finally:
            log.close_files()
    assert dir_bytes(tmp_path) == before  # recovery of an intact log changes nothing


def test_snapshot_is_used_when_present(tmp_path: Path) -> None:
    """A clean close leaves a snapshot naming the end; recovery starts there and agrees with a scan."""
    written = write_log(tmp_path, producer_specs("s", 6))
    snap = json.loads((tmp_path / SNAPSHOT_NAME).read_text())
    assert snap["end"] == [written[-1].end.offset, written[-1].end.pos]
    assert snap["producers"]["s"]["last_seq"] == 5
    logs = [StreamLog.open(tmp_path, ZERO, use_snapshot=u) for u in (True, False)]
    try:
        assert _state(logs[0]) == _state(logs[1]) == (written[-1].tail_after, written[-1].producers_after)
    finally:
        for log in logs:
            log.close_files()


# ---------------------------------------------------------------------- property test

_op = st.tuples(
    st.sampled_from([None, "p0", "p1", "p2"]),  # producer
    st.booleans(),  # bump the producer's epoch (restarting at seq 0)
    st.integers(min_value=0, max_value=3),  # records in the batch
    st.binary(max_size=700),  # payload
    st.one_of(st.none(), st.binary(min_size=1, max_size=8)),  # Stream-Seq
)


def _specs_from_ops(ops: list[tuple[str | None, bool, int, bytes, bytes | None]]) -> list[Spec]:
    epochs: dict[str, int] = {}
    next_seq: dict[str, int] = {}
    specs: list[Spec] = []
    for pid, bump, count, payload, sseq in ops:
        if pid is None:
            specs.append(Spec(payload=payload, count=count, stream_seq=sseq))
            continue
        n = max(count, 1)
        if pid not in epochs:
            epochs[pid], next_seq[pid] = 0, 0
        elif bump:
            epochs[pid], next_seq[pid] = epochs[pid] + 1, 0
        first = next_seq[pid]
        next_seq[pid] = first + n
        specs.append(
            Spec(
                payload=payload,
                count=n,
                producer_id=pid,
                epoch=epochs[pid],
                first_seq=first,
                last_seq=first + n - 1,
                stream_seq=sseq,
            )
        )
    return specs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(_op, min_size=1, max_size=25),
    segment_bytes=st.sampled_from([256, 2048, 1 << 20]),
    clean_close=st.booleans(),
    use_snapshot=st.booleans(),
)
def test_reopen_reproduces_tail_producers_and_bytes(
    ops: list[tuple[str | None, bool, int, bytes, bytes | None]],
    segment_bytes: int,
    clean_close: bool,
    use_snapshot: bool,
) -> None:
    specs = _specs_from_ops(ops)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        written = write_log(d, specs, segment_bytes=segment_bytes, clean_close=clean_close)
        files = dir_bytes(d)
        expected_batches = [(w.start, w.end, w.spec.payload) for w in written]
        for _ in range(2):
            log = StreamLog.open(d, ZERO, segment_bytes=segment_bytes, use_snapshot=use_snapshot)
            try:
                assert log.durable == written[-1].tail_after
                assert log.producers == written[-1].producers_after
                for pid, state in log.producers.items():
                    last = [w.spec for w in written if w.spec.producer_id == pid][-1]
                    assert (state.epoch, state.last_seq) == (last.epoch, last.last_seq)
                assert read_all(log) == expected_batches
                assert read_all(log, max_bytes=100) == expected_batches
            finally:
                log.close_files()
            assert dir_bytes(d) == files
        # the stored bytes are exactly the encoded batches, back to back
        assert sum(len(b) for b in files.values()) == written[-1].end.pos
        # recovery always leaves a snapshot of exactly what it recovered
        snap = json.loads((d / SNAPSHOT_NAME).read_text())
        assert snap["end"] == [written[-1].end.offset, written[-1].end.pos]


def test_the_file_system_keeps_at_most_max_open_descriptors_and_reopens_on_use(tmp_path: Path) -> None:
    from onceflow.storage.fs import OsFileSystem

    fs = OsFileSystem(max_open=4)
    files = [fs.open_file(tmp_path / f"f{i}", create=True) for i in range(20)]
    for i, f in enumerate(files):
        f.pwrite(b"x" * i, 0)
        assert fs.open_count <= 4
    for i, f in enumerate(files):  # every file works again after its descriptor was closed
        assert f.size() == i
        assert f.pread(i, 0) == b"x" * i
        f.sync()
        assert fs.open_count <= 4
    assert fs.reopened >= 16
    proc_fds = len(os.listdir("/proc/self/fd"))
    for f in files:
        f.close()
    assert fs.open_count == 0
    assert len(os.listdir("/proc/self/fd")) <= proc_fds
    with pytest.raises(OSError):
        files[0].pread(1, 0)


def test_a_log_works_when_its_descriptors_are_taken_by_others(tmp_path: Path) -> None:
    """Two logs on a two-descriptor file system: each write and read reopens what it needs."""
    from onceflow.storage.fs import OsFileSystem

    async def go() -> None:
        fs = OsFileSystem(max_open=2)
        logs = [StreamLog.open(tmp_path / f"l{i}", ZERO, fs=fs, segment_bytes=200) for i in range(3)]
        for round_ in range(5):
            for i, lg in enumerate(logs):
                await lg.stage(count=1, payload=f"{i}-{round_}".encode()).done
        for i, lg in enumerate(logs):
            assert [b.payload for b in lg.read(ZERO, 1 << 20)] == [f"{i}-{r}".encode() for r in range(5)]
            await lg.close()
        again = [StreamLog.open(tmp_path / f"l{i}", ZERO, fs=fs) for i in range(3)]
        assert [lg.durable.end for lg in again] == [lg.durable.end for lg in logs]
        for lg in again:
            await lg.close()

    asyncio.run(go())
