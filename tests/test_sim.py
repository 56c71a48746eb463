"""The deterministic simulator (``onceflow sim``, docs/reliability.md): it replays a seed exactly,
its disk loses what a power loss would, and a bounded batch of seeds (and every regression seed)
finds no anomaly."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from onceflow.sim.disk import SimDisk
from onceflow.sim.run import run_seed

# Seeds that found a hole before its fix (docs/reliability.md, "What the simulator found"), kept as
# regressions: each must now run clean.
REGRESSION_SEEDS = [0, 2, 3, 5, 16, 28, 71, 111, 119, 287, 454, 735]
CI_SEEDS = int(os.environ.get("ONCEFLOW_SIM_SEEDS", "1000"))


def test_a_seed_replays_exactly_whatever_ran_before() -> None:
    first = [run_seed(s).fingerprint for s in (11, 12)]
    run_seed(13)  # a different history of the process before the same seeds
    again = [run_seed(s).fingerprint for s in (11, 12)]
    assert first == again


@pytest.mark.parametrize("seed", REGRESSION_SEEDS)
def test_regression_seed_runs_clean(seed: int) -> None:
    r = run_seed(seed)
    assert r.ok, "\n".join(f"{a.kind} [{a.stream}] {a.detail[:300]}" for a in r.check.anomalies[:10]) + "\n" + "\n".join(r.trace[-40:])


@pytest.mark.slow
def test_a_bounded_batch_of_seeds_finds_nothing() -> None:
    """What CI runs of the simulator (about two minutes on two cores); soaks run more:
    ``onceflow sim --seeds 100000 --start K --jobs 2``."""
    out = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "sim", "--seeds", str(CI_SEEDS), "--jobs", "2", "--check-replay", "--json"],
        capture_output=True, text=True, timeout=1200, check=False,
    )
    summary = json.loads(out.stdout)
    print(f"onceflow sim: {summary['seeds']} seeds at {summary['seeds_per_second']} seeds/s, "
          f"{summary['requests']} requests in {summary['simulated_seconds']} simulated seconds")
    assert summary["failed"] == 0, f"failing seeds {summary['failing_seeds']} ({summary['anomalies_by_kind']}); replay one with onceflow sim --seed S"
    assert out.returncode == 0, out.stderr[-2000:]


class _KeepPrefix(random.Random):
    def __init__(self, keep: int) -> None:
        super().__init__(0)
        self.keep = keep

    def randint(self, a: int, b: int) -> int:
        return min(b, a + self.keep)


@pytest.mark.parametrize("keep", [0, 1, 2])
def test_a_power_loss_keeps_what_was_synced_and_a_prefix_of_the_rest(keep: int) -> None:
    disk = SimDisk(_KeepPrefix(keep))
    fs = disk.mount()
    fs.mkdir(Path("/d"))
    fs.sync_dir(Path("/"))
    f = fs.open_file(Path("/d/f"), create=True)
    fs.sync_dir(Path("/d"))
    f.pwrite(b"a" * 10, 0)
    f.sync()
    for chunk in (b"b" * 10, b"c" * 10):  # unsynced
        f.pwrite(chunk, f.size())
    fs.open_file(Path("/d/new"), create=True)  # an unsynced name
    disk.power_loss()
    after = disk.mount()
    with pytest.raises(OSError):
        f.size()  # the process that held it is gone
    g = after.open_file(Path("/d/f"), create=False)
    assert g.pread(100, 0) == (b"a" * 10 + b"b" * 10 + b"c" * 10)[: 10 + 10 * keep]
    assert after.exists(Path("/d/new")) == (keep >= 1)  # names: a prefix of the directory's unsynced changes


def test_a_failed_sync_never_makes_its_writes_durable() -> None:
    """Linux drops the dirty pages of a failed fsync ("fsyncgate"): a later sync that succeeds
    does not save them, though reads still see them until the process goes."""
    disk = SimDisk(_KeepPrefix(10))
    fs = disk.mount()
    fs.mkdir(Path("/d"))
    fs.sync_dir(Path("/"))
    f = fs.open_file(Path("/d/f"), create=True)
    fs.sync_dir(Path("/d"))
    f.pwrite(b"lost", 0)
    disk.faults.sync_eio = 1.0
    with pytest.raises(OSError):
        f.sync()
    disk.faults.sync_eio = 0.0
    f.sync()
    assert f.pread(4, 0) == b"lost"
    disk.power_loss()
    assert disk.mount().open_file(Path("/d/f"), create=False).pread(4, 0) == b""
