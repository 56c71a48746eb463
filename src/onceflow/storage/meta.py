"""Durable per-stream metadata: ``meta.json`` in the stream's directory.

A stream exists on disk exactly when its ``meta.json`` does: creation writes the log (with any
initial content) and syncs it first, then renames ``meta.json`` into place, so a crash in between
leaves a directory that recovery discards. Updates (soft delete) are atomic replaces too.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .fs import FileSystem
from .position import Position

__all__ = ["META_NAME", "StreamMeta", "read_meta", "write_meta"]

META_NAME = "meta.json"


@dataclass(slots=True)
class StreamMeta:
    name: str
    content_type: str
    created_ms: int
    ttl_seconds: int | None = None
    expires_at: str | None = None  # RFC 3339 text as given by the client
    expires_at_epoch: float | None = None  # the same instant, seconds since the epoch
    fork_parent: str | None = None
    fork_offset: tuple[int, int] | None = None  # (record offset, byte position) the fork starts at
    fork_sub_offset: int = 0
    expiry_inherited: bool = False  # a fork that took its TTL / Expires-At from its source
    soft_deleted: bool = False
    # retention (None: the server's default): whole segments older than this / beyond this size go,
    # but never data of an open transaction, nor past the committed offset of a group named here
    retention_seconds: int | None = None
    retention_bytes: int | None = None
    retention_keep_groups: list[str] | None = None

    @property
    def base(self) -> Position:
        return Position(*self.fork_offset) if self.fork_offset else Position(0, 0)


def write_meta(fs: FileSystem, directory: Path, meta: StreamMeta) -> None:
    fs.replace_file(directory / META_NAME, json.dumps(asdict(meta)).encode())


def read_meta(fs: FileSystem, directory: Path) -> StreamMeta:
    raw = json.loads(fs.read_bytes(directory / META_NAME))
    if raw.get("fork_offset") is not None:
        raw["fork_offset"] = tuple(raw["fork_offset"])
    return StreamMeta(**raw)
