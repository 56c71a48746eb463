"""``onceflow bench compare --quick`` end to end, bounded: onceflow and a throwaway Redis (and NATS
JetStream when ``nats-server`` is installed), and onceflow on a throwaway PostgreSQL store beside the
local store (``--store postgresql``). Checks that the command completes, measures each
system, that every measured stream held exactly what its system acknowledged, and that the plots
are written. No timing assertions: the figures depend on the machine.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from onceflow_tools.bench.compare import FLOOR

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

pytest.importorskip("matplotlib", reason="matplotlib is in the bench extra: pip install -e '.[bench]'")


def _compare(tmp_path: Path, systems: str, only: str, *extra: str) -> dict[str, Any]:
    out = tmp_path / "compare.json"
    argv = [
        sys.executable,
        "-m",
        "onceflow.cli",
        "bench",
        "compare",
        "--quick",
        "--seconds",
        "1",
        "--systems",
        systems,
        "--only",
        only,
        "--out-dir",
        str(tmp_path / "img"),
        "--out",
        str(out),
        *extra,
    ]
    if shutil.which("wrk"):
        argv += ["--generator", "wrk"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=110, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    doc: dict[str, Any] = json.loads(out.read_text())
    assert doc["failures"] == []
    for m in doc["measurements"]:
        assert m["failures"] == [], m
        if m["system"] == FLOOR:  # the no-op app stores nothing: no read-back
            assert m["stored"] is None and m["msg_per_s"] > 0 and m["server_cpu_pct"] > 0, m
            continue
        assert m["stored"] is not None, m
        if m["exact"]:
            assert m["stored"] == m["acknowledged"], m
        else:  # wrk stops with up to one request per connection in flight, stored but never counted
            assert m["acknowledged"] <= m["stored"] <= m["acknowledged"] + 2 * 75, m
        assert m["msg_per_s"] > 0, m
    for lat in doc["latencies"]:
        assert lat["failures"] == [] and lat["received"] == lat["sent"], lat
    for name in ("compare-throughput.png", "compare-latency-cdf.png", "compare.md"):
        path = tmp_path / "img" / name
        assert path.exists() and path.stat().st_size > 0, name
    assert (tmp_path / "img" / "compare-throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return doc


@pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None,
    reason="redis-server / redis-benchmark not installed (Debian's redis-server package)",
)
def test_compare_quick_onceflow_and_redis(tmp_path: Path) -> None:
    # single-message appends need wrk for the HTTP side; without it (no apt-get in a test) they are left out
    only = "produce,append,latency" if shutil.which("wrk") else "produce,latency"
    doc = _compare(tmp_path, "onceflow,redis", only)
    systems = {m["system"] for m in doc["measurements"]}
    assert {"onceflow", "Redis (fsync always)", "Redis (fsync everysec)"} <= systems
    workloads = {(m["workload"], m["system"]) for m in doc["measurements"]}
    for system in ("onceflow", "Redis (fsync always)"):
        assert ("produce-100", system) in workloads and ("produce-1024", system) in workloads
        assert ("catch-up-100", system) in workloads
    assert {lat["system"] for lat in doc["latencies"]} == {"onceflow", "Redis (fsync always)"}
    if "append" in only:  # the floors under onceflow's single-message append, same run
        assert ("append", FLOOR) in workloads
        assert doc["app_us"] > 0


@pytest.mark.skipif(
    shutil.which("nats-server") is None, reason="nats-server not installed (Debian's nats-server package)"
)
def test_compare_quick_jetstream(tmp_path: Path) -> None:
    pytest.importorskip("nats", reason="nats-py is in the bench extra: pip install -e '.[bench]'")
    doc = _compare(tmp_path, "nats", "produce")
    assert {m["workload"] for m in doc["measurements"] if m["system"] == "JetStream"} >= {"produce-100", "produce-1024"}


def _postgres_missing() -> str | None:
    """Why the PostgreSQL store cannot be measured here, or None."""
    try:
        import psycopg_pool  # noqa: F401
    except ImportError:
        return "the PostgreSQL store needs psycopg_pool (onceflow[postgresql])"
    from onceflow.testing import ServiceUnavailable, postgres_bindir

    try:
        postgres_bindir()
    except ServiceUnavailable as exc:
        return str(exc)
    return None


@pytest.mark.skipif(_postgres_missing() is not None, reason=str(_postgres_missing()))
def test_compare_quick_onceflow_on_a_postgresql_store_beside_the_local_store(tmp_path: Path) -> None:
    only = "produce,append,latency" if shutil.which("wrk") else "produce,latency"
    doc = _compare(tmp_path, "onceflow", only, "--store", "postgresql")
    pg = "onceflow (PostgreSQL store)"
    workloads = {(m["workload"], m["system"]) for m in doc["measurements"]}
    for system in ("onceflow", pg):
        assert {("produce-100", system), ("produce-1024", system), ("catch-up-100", system)} <= workloads
    for m in doc["measurements"]:
        if m["system"] == pg and m["workload"].startswith("produce"):
            assert m["db"]["transactions"] > 0, m  # the acknowledged appends were committed to the database
    assert {lat["system"] for lat in doc["latencies"]} == {"onceflow", pg}
    ratios = {t["comparison"] for t in doc["targets"] if t["value"] is not None}
    assert f"{pg} / onceflow" in ratios
    assert f"{pg} p99 (ms)" in ratios
    assert "onceflow's stores side by side" in (tmp_path / "img" / "compare.md").read_text()
