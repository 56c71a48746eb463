"""File-system helpers shared by the server, the client and the sinks."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "replace_file"]


def fsync_dir(path: Path) -> None:
    """Make the creation, removal or renaming of entries in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, data: bytes, *, sync: bool = True, sync_dir: bool = True, mode: int = 0o666) -> None:
    """Put ``data`` at ``path`` all or nothing: written to ``<path>.tmp`` and synced (``sync``), then
    renamed over ``path``, and the rename synced too (``sync_dir``), so that a crash leaves either
    the old file or the new one, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if sync and sync_dir:
        fsync_dir(path.parent)
