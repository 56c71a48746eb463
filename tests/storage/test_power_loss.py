"""What a power loss may take, on the simulator's disk (onceflow_tools.sim.disk): nothing acknowledged.

The simulated disk keeps, after a power loss, only what was synced (files by fsync, names by a sync
of their directory) plus a random prefix of the rest; here the prefix is always empty, the worst
case, so every durability promise must rest on an explicit sync.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from onceflow.core.broker import Broker
from onceflow_tools.sim.disk import SimDisk

DATA = Path("/data")


class _KeepNothing(random.Random):
    """A power loss keeps no unsynced write and no unsynced name."""

    def randint(self, a: int, b: int) -> int:
        return a


def _disk() -> SimDisk:
    disk = SimDisk(_KeepNothing(0))
    fs = disk.mount()
    fs.mkdir(DATA)
    fs.sync_dir(Path("/"))
    fs.sync_dir(DATA)
    return disk


def test_created_streams_appended_data_and_deletes_survive_a_power_loss() -> None:
    disk = _disk()

    async def before() -> None:
        b = Broker(DATA, fs=disk.mount())
        b.open()
        await b.start()
        assert b.create("kept", content_type="application/json").kind == "created"
        assert (await b.append("kept", b'[{"n":1}]', content_type="application/json")).kind == "appended"
        assert b.create("gone", content_type="application/json").kind == "created"
        assert b.delete("gone").kind == "deleted"
        init = await b.coordinator.init("t")
        assert init.epoch == 0
        disk.power_loss()  # no clean shutdown: the process and the page cache are gone

    async def after() -> None:
        b = Broker(DATA, fs=disk.mount())
        b.open()
        await b.start()
        s = b.get("kept")
        assert s is not None, "a stream whose creation was acknowledged vanished"
        assert [bt.payload for bt in b.read(s, s.log.base).batches] == [b'{"n":1},']
        assert b.get("gone") is None, "a delete that was acknowledged was undone"
        assert b.coordinator.txns["t"].epoch == 0, "an acknowledged init was lost"
        await b.close()

    asyncio.run(before())
    asyncio.run(after())
