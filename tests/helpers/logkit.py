"""Helpers shared by the storage tests: append specs to a StreamLog and record the state after each."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from onceflow.storage.log import ProducerState, StreamLog, TailState
from onceflow.storage.position import Position

ZERO = Position(0, 0)


@dataclass(frozen=True)
class Spec:
    """One append as handed to StreamLog.stage."""

    payload: bytes
    count: int = 1
    flags: int = 0
    producer_id: str | None = None
    epoch: int = -1
    first_seq: int = -1
    last_seq: int = -1
    stream_seq: bytes | None = None

    def kwargs(self) -> dict[str, object]:
        return {
            "payload": self.payload,
            "count": self.count,
            "flags": self.flags,
            "producer_id": self.producer_id,
            "epoch": self.epoch,
            "first_seq": self.first_seq,
            "last_seq": self.last_seq,
            "stream_seq": self.stream_seq,
        }


@dataclass(frozen=True)
class Written:
    spec: Spec
    start: Position
    end: Position
    producers_after: dict[str, ProducerState]
    tail_after: TailState


def seg_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.seg"))


async def append_each(log: StreamLog, specs: list[Spec]) -> list[Written]:
    """Append one batch at a time (each its own group) and record the state after each."""
    out: list[Written] = []
    for spec in specs:
        staged = log.stage(**spec.kwargs())  # type: ignore[arg-type]
        await staged.done
        assert log.durable.end == staged.end
        out.append(Written(spec, staged.start, staged.end, dict(log.producers), log.durable))
    await log.drain()
    return out


def write_log(
    directory: Path,
    specs: list[Spec],
    *,
    segment_bytes: int = 1 << 20,
    clean_close: bool = True,
) -> list[Written]:
    """Create a log, append ``specs``, then close it cleanly (snapshot) or drop it like a crash."""

    async def go() -> list[Written]:
        log = StreamLog.open(directory, ZERO, segment_bytes=segment_bytes)
        try:
            written = await append_each(log, specs)
        except BaseException:
            log.close_files()
            raise
        if clean_close:
            await log.close()
        else:
            log.close_files()
        return written

    return asyncio.run(go())


def read_all(log: StreamLog, max_bytes: int = 1 << 30) -> list[tuple[Position, Position, bytes]]:
    """Every durable batch, following end positions from the base, ``max_bytes`` per call."""
    out: list[tuple[Position, Position, bytes]] = []
    at = log.base
    while at != log.durable.end:
        batches = log.read(at, max_bytes)
        assert batches, f"read at {at} returned nothing before the end {log.durable.end}"
        for b in batches:
            assert b.start == at
            out.append((b.start, b.end, b.payload))
            at = b.end
    return out


def producer_specs(pid: str, n: int, *, size: int = 40, epoch: int = 0, seq0: int = 0) -> list[Spec]:
    return [
        Spec(
            payload=bytes([(i * 7 + 1) % 251 + 1]) * (size + i),
            producer_id=pid,
            epoch=epoch,
            first_seq=seq0 + i,
            last_seq=seq0 + i,
        )
        for i in range(n)
    ]
