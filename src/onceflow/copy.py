"""``onceflow copy``: a transactional copier (Kafka's TransactionalMessageCopier, for onceflow).

Reads the input streams as consumer group ``group`` (read_committed, starting from the group's
committed offsets) and writes every message to one of the output streams, in transactions of about
``txn_size`` messages that also carry the consumed offsets. Kill it at any moment and start it again
with the same transactional id: ``init`` aborts the half-done transaction, the consumer resumes from
the last committed offsets, and the outputs hold every input message exactly once.

If retention deleted input the group had not copied yet, the copier stops with an error naming
the earliest offset kept, unless ``offset_reset="earliest"`` (``--offset-reset earliest``) lets it
go on from there, skipping what was deleted.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import zlib
from collections.abc import Sequence
from typing import Any

from .client.consumer import AsyncConsumer, OffsetReset
from .client.lowlevel import ServerURL
from .client.transactions import AsyncTransactionalProducer
from .errors import OnceflowError

__all__ = ["copy_streams", "route"]


def route(value: Any, outputs: int) -> int:
    """The output a message goes to: CRC-32 of its compact JSON text (stable everywhere)."""
    if isinstance(value, bytes):
        data = value
    else:
        data = json.dumps(value, separators=(",", ":"), sort_keys=True).encode()
    return zlib.crc32(data) % outputs


async def copy_streams(
    base_url: ServerURL,
    inputs: Sequence[str],
    outputs: Sequence[str],
    *,
    transactional_id: str,
    group: str,
    txn_size: int = 750,
    live: bool = False,
    idle_commit: float = 0.5,
    progress: bool = False,
    max_read_bytes: int = 64 << 10,
    txn_timeout_ms: int = 60_000,
    offset_reset: OffsetReset = "error",
) -> int:
    """Copy until the inputs are exhausted (``live=False``) or forever; returns messages copied."""
    producer = AsyncTransactionalProducer(base_url, transactional_id, timeout_ms=txn_timeout_ms)
    await producer.init()
    consumer = AsyncConsumer(
        base_url,
        group=group,
        streams=list(inputs),
        delivery="exactly-once",
        live="long-poll" if live else None,
        max_read_bytes=max_read_bytes,
        offset_reset=offset_reset,
    )
    await consumer.start()
    copied = 0
    started = time.monotonic()
    try:
        while True:
            in_txn = 0
            async with producer.transaction():
                while in_txn < txn_size:
                    msgs = await consumer.poll(timeout=idle_commit if in_txn else (5.0 if live else None))
                    if not msgs:
                        break
                    for m in msgs:
                        await producer.append(outputs[route(m.value, len(outputs))], m.value)
                    await producer.flush()  # send as it goes: the commit only has to write markers
                    in_txn += len(msgs)
                await producer.send_offsets_to_transaction(group, consumer.positions())
            copied += in_txn
            if progress and in_txn:
                rate = copied / max(1e-9, time.monotonic() - started)
                print(
                    f"copied {copied:,} messages ({rate:,.0f}/s), last transaction {in_txn}",
                    file=sys.stderr,
                    flush=True,
                )
            if not in_txn and not live:
                return copied
    finally:
        await consumer.close()
        await producer.close()


def run_copy(args: Any) -> int:
    try:
        n = asyncio.run(
            copy_streams(
                args.url,
                args.input,
                args.output,
                transactional_id=args.transactional_id,
                group=args.group,
                txn_size=args.txn_size,
                live=args.live,
                progress=not args.quiet,
                max_read_bytes=args.max_read_bytes,
                txn_timeout_ms=int(args.txn_timeout * 1000),
                offset_reset=args.offset_reset,
            )
        )
    except OnceflowError as exc:
        print(f"onceflow copy: {exc}", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"copied {n:,} messages", flush=True)
    return 0
