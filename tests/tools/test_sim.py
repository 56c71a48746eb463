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
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from onceflow.cli import build_parser
from onceflow_tools.sim import cli
from onceflow_tools.sim.disk import SimDisk
from onceflow_tools.sim.fast import fast_httpx, response
from onceflow_tools.sim.run import run_seed

# Seeds that found a hole on the code before its fix (docs/reliability.md, "What the simulator
# found"), with this simulator; each must run clean now. what it found: seed.
REGRESSION_SEEDS = {
    "1 offsets while a commit is unfinished": 1,
    "2 transactional producer after an unknown outcome": 126,
    "3 batch write failed after committing": 5,
    "4 streaming sink under a reused sinkId": 15,
    "5 forks bypass read_committed": 4,
    "6 sink commit/abort deadlock": 417,
    "7 late duplicate opens a phantom transaction": 69,
    # found by the 100,000-seed soak, after the fixes of the seven
    "a failed completion record loses the commit's offsets": 18050,
    # liveness: a producer fenced though nothing it did called for it
    "the producer's abort that finishes a fenced abort answered 200": 23705,
    "a late copy of a replaced init fences the working producer": 26411,
    "a retried append answered as a duplicate while its transaction's fenced abort was unfinished": 30221,
    # false alarms of the simulator itself, each fixed in it, not in onceflow
    "copier stopped before a writer's late retry landed (lost-write)": 65925,
    "copier stopped before a writer's late copy landed (lost-write)": 68690,
    "copier stopped before a writer's retry landed, 0.75 s after its last read (lost-write)": 53792,
    "a fence that the producer's own unanswered init made, landing late (spurious-fence)": 50932,
}
# a smoke test of the single node (the soak is onceflow sim --seeds 100000, in chunks; the regression
# seeds above run every time): 500 seeds keep CI under its 30 minutes
CI_SEEDS = int(os.environ.get("ONCEFLOW_SIM_SEEDS", "500"))


def _run_seeds(seeds: list[int]) -> list[dict[str, object]]:
    """Run seeds in a fresh interpreter with a fixed string hash seed, as ``onceflow sim`` does:
    a seed replays exactly only where set iteration cannot vary."""
    code = (
        "import json, sys\n"
        "from onceflow_tools.sim.run import run_seed\n"
        "out = []\n"
        "for s in json.loads(sys.argv[1]):\n"
        "    r = run_seed(s)\n"
        "    out.append({'seed': s, 'ok': r.ok, 'anomalies': [f'{a.kind} [{a.stream}] {a.detail[:300]}' for a in r.check.anomalies[:8]],\n"
        "                'trace': r.trace[-30:]})\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(seeds)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHONHASHSEED": "0"},
        check=True,
    )
    result: list[dict[str, object]] = json.loads(done.stdout)
    return result


def test_a_seed_replays_exactly_whatever_ran_before() -> None:
    first = [run_seed(s).fingerprint for s in (11, 12)]
    run_seed(13)  # a different history of the process before the same seeds
    again = [run_seed(s).fingerprint for s in (11, 12)]
    assert first == again


def test_every_regression_seed_runs_clean() -> None:
    results = _run_seeds(list(REGRESSION_SEEDS.values()))
    bad = [r for r in results if not r["ok"]]
    holes = {seed: hole for hole, seed in REGRESSION_SEEDS.items()}
    assert not bad, "\n\n".join(
        f"seed {r['seed']} (hole {holes[int(str(r['seed']))]}):\n" + "\n".join(map(str, r["anomalies"])) for r in bad
    )


@pytest.mark.slow
@pytest.mark.timeout(1300)  # its own subprocesses are bounded (1200 s); pytest's 300 s is not enough on a busy machine
def test_a_bounded_batch_of_seeds_finds_nothing_and_replays() -> None:
    """What CI runs of the simulator (about two minutes on two cores); soaks run more:
    ``onceflow sim --seeds 100000 --start K --jobs 2``."""
    out = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "sim", "--seeds", str(CI_SEEDS), "--jobs", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    summary = json.loads(out.stdout)
    print(
        f"onceflow sim: {summary['seeds']} seeds at {summary['seeds_per_second']} seeds/s, "
        f"{summary['requests']} requests in {summary['simulated_seconds']} simulated seconds"
    )
    assert summary["failed"] == 0, (
        f"failing seeds {summary['failing_seeds']} ({summary['anomalies_by_kind']}); replay one with onceflow sim --seed S"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # and every seed of another range runs the same twice, in one process
    again = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "sim", "--seeds", "20", "--start", "900000", "--check-replay", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    replay = json.loads(again.stdout)
    assert replay["not_replayed"] == [] and replay["failed"] == 0, replay


def test_a_seed_whose_run_raises_fails_alone_and_the_run_goes_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Seed 126311 of the cluster once raised out of its run (the final reads met no leader), and
    took the 999 other seeds of its soak chunk with it. A seed whose run raises is a failing seed
    (``harness-error``, with the traceback), and the seeds after it run."""
    ran: list[int] = []

    def run(seed: int, cluster: bool, mutations: tuple[str, ...]) -> Any:
        ran.append(seed)
        if seed == 11:
            raise RuntimeError("the harness broke")
        return SimpleNamespace(
            ok=True,
            check=SimpleNamespace(anomalies=[]),
            fingerprint=f"f{seed}",
            sim_seconds=1.0,
            requests=1,
            workload=SimpleNamespace(actors=[]),
        )

    monkeypatch.setattr(cli, "_run", run)
    monkeypatch.setattr(cli, "_settle_heap", lambda cluster: None)  # no gc.freeze of the test process
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # no re-exec
    args = build_parser().parse_args(["sim", "--cluster", "--seeds", "3", "--start", "10", "--json"])
    assert cli.cmd_sim(args) == 1
    summary = json.loads(capsys.readouterr().out)
    assert ran == [10, 11, 12]
    assert (summary["seeds"], summary["failed"], summary["failing_seeds"]) == (3, 1, [11])
    assert summary["anomalies_by_kind"] == {"harness-error": 1}
    assert cli._one(11, False, True)["anomalies"][0][2].endswith("RuntimeError: the harness broke\n")


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


@pytest.mark.parametrize(
    ("status", "headers", "body"),
    [
        (200, [(b"content-type", b"application/json"), (b"content-length", b"8")], b'{"a": 1}'),
        (200, [(b"stream-next-offset", b"0000000000000001_0000000000000002")], b"\x00\x01records"),
        (204, [], b""),
        (503, [(b"retry-after", b"1"), (b"Content-Type", b"text/plain")], b"not leader"),
        (200, [(b"content-encoding", b"identity")], b"plain"),
    ],
)
def test_the_simulations_fast_response_is_httpxs_response(status: int, headers: list[Any], body: bytes) -> None:
    """sim/fast.py builds the servers' answers without httpx's stream machinery: the same response."""
    fast, plain = response(status, headers, body), httpx.Response(status, headers=headers, content=body)
    assert (fast.status_code, fast.headers.raw, fast.content) == (plain.status_code, plain.headers.raw, plain.content)
    assert (fast.is_stream_consumed, fast.is_closed) == (plain.is_stream_consumed, plain.is_closed)
    assert fast.text == plain.text and fast.encoding == plain.encoding
    assert {k for k in vars(plain) if k != "_decoder"} <= set(vars(fast))


def test_the_simulations_memoized_url_parsing_parses_as_httpx_does() -> None:
    urls = ["http://onceflow.sim/v1/stream/a%20b?offset=-1&x=%2F", "http://n1.sim", "/v1/streams"]
    plain = [httpx.URL(u) for u in urls]
    with fast_httpx():
        twice = [[httpx.URL(u) for u in urls] for _ in range(2)]
        moved = [u.copy_with(host="n2.sim") for u in twice[1]]
        with pytest.raises(httpx.InvalidURL):
            httpx.URL("http://onceflow.sim/\x00")
    assert twice[0] == twice[1] == plain
    assert moved == [u.copy_with(host="n2.sim") for u in plain]
    assert httpx.URL(urls[0]) == plain[0]  # and the parser is httpx's own again
