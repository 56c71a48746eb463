"""A disk that fills up under one log: its writes fail (ENOSPC) until it heals."""

from __future__ import annotations

import errno

import pytest

import onceflow.storage.log as storage_log
from onceflow.storage.fs import File
from onceflow.storage.log import StreamLog

__all__ = ["Disk"]


class Disk:
    """Fails every write (ENOSPC) to the files of the logs given to :meth:`fail`, until :meth:`heal`;
    with ``times``, only that many writes, then it heals by itself."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.files: list[File] = []
        self.left: int | None = None
        self.failed = 0
        real = storage_log._write_all

        def write(f: File, data: bytes, at: int, sync: bool) -> None:
            if any(f is failing for failing in self.files):
                self.failed += 1
                if self.left is not None:
                    self.left -= 1
                    if self.left <= 0:
                        self.heal()
                raise OSError(errno.ENOSPC, "No space left on device")
            real(f, data, at, sync)

        monkeypatch.setattr(storage_log, "_write_all", write)

    def fail(self, log: StreamLog | None, times: int | None = None) -> None:
        assert log is not None
        self.files.append(log._segments[-1].file)
        self.left = times

    def heal(self) -> None:
        self.files.clear()
        self.left = None
