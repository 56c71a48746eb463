"""Recovery that cannot read a stream's metadata (an I/O error: a failed disk read, a connection to
the PostgreSQL store reset mid-read) must not start without that stream: it would serve 404 for a
stream never deleted, with its acknowledged appends, and a create of the same name would then move
its directory to the trash as debris. Cluster simulator seed 132217: a new leader's read of a
stream's meta.json lost its connection, the stream was skipped as "unreadable", and it was gone."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from onceflow.core.broker import Broker
from onceflow.storage.fs import OsFileSystem
from onceflow.storage.meta import META_NAME

pytestmark = pytest.mark.anyio


class _MetaReadFails(OsFileSystem):
    """The real disk, but the next ``fails`` reads of a stream's metadata raise EIO."""

    def __init__(self) -> None:
        super().__init__()
        self.fails = 0

    def read_bytes(self, path: Path) -> bytes:
        if path.name == META_NAME and self.fails > 0:
            self.fails -= 1
            raise OSError(errno.EIO, "injected read error", str(path))
        return super().read_bytes(path)


async def test_an_io_error_reading_a_streams_metadata_fails_the_recovery_rather_than_losing_the_stream(
    tmp_path: Path,
) -> None:
    fs = _MetaReadFails()
    first = Broker(tmp_path, fs=fs)
    first.open()
    assert first.create("kept", content_type="text/plain", body=b"acknowledged").kind == "created"
    await first.close()

    fs.fails = 1
    second = Broker(tmp_path, fs=fs)
    with pytest.raises(OSError, match="injected read error"):
        second.open()  # not served without the stream: the leader steps down, and one retries
    await second.close()

    third = Broker(tmp_path, fs=fs)  # the error passed: the stream is there, with its bytes
    third.open()
    try:
        assert "kept" in third.streams
    finally:
        await third.close()


async def test_metadata_that_does_not_parse_is_still_skipped(tmp_path: Path) -> None:
    """Content that no retry will make readable (a damaged file) is skipped, as before."""
    fs = _MetaReadFails()
    first = Broker(tmp_path, fs=fs)
    first.open()
    first.create("damaged", content_type="text/plain")
    first.create("fine", content_type="text/plain")
    directory = first.streams["damaged"].directory
    await first.close()
    (directory / META_NAME).write_bytes(b"{not json")

    second = Broker(tmp_path, fs=fs)
    second.open()
    try:
        assert set(second.streams) == {"fine"}
    finally:
        await second.close()
