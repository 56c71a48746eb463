"""``onceflow chaos --store postgresql --failover-manager patroni``: the database fails over by Patroni,
not by hand, and nothing acknowledged is lost or doubled (docs/ha.md, "Running with Patroni")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from onceflow.testing import ServiceUnavailable, patroni_missing, postgres_bindir


def _chaos(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``onceflow chaos ARGS``, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "chaos", *args], capture_output=True, text=True, timeout=timeout
    )


def _missing() -> str | None:
    """Why the Patroni-managed database cannot run here (None when it can)."""
    try:
        import psycopg_pool  # noqa: F401
    except ImportError:
        return "the PostgreSQL store needs psycopg_pool (onceflow[postgresql])"
    try:
        postgres_bindir()
    except ServiceUnavailable as exc:
        return f"no PostgreSQL to start: {exc}"
    return patroni_missing()  # scripts/setup.sh dev installs Debian's patroni and etcd-server


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(_missing() is not None, reason=f"needs Patroni, etcd and PostgreSQL: {_missing()}")
def test_patroni_fails_the_database_over_and_brings_the_old_primary_back_with_nothing_lost(tmp_path: Path) -> None:
    """The primary's postgres killed under the chaos workload (no sink, no Spark): Patroni promotes the
    synchronous standby, appends are acknowledged again through both servers, the old node comes back
    as the synchronous standby, and the history check finds nothing lost, doubled or read uncommitted
    (~35 s: ~15 s of it starting etcd and Patroni)."""
    out = tmp_path / "chaos"
    proc = _chaos(
        "--store",
        "postgresql",
        "--failover-manager",
        "patroni",
        "--faults",
        "fail-over-database",
        "--duration",
        "5",
        "--seed",
        "7",
        "--no-spark",
        "--no-sink",
        "--out",
        str(out),
        timeout=230,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "history check: OK" in proc.stdout and "database failover (Patroni)" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is True and summary["failover_manager"] == "patroni"
    assert all(n == 0 for n in summary["anomalies"].values())
    assert summary["faults"] == {"fail-over-database": summary["faults"]["fail-over-database"]}
    failovers = summary["database_failovers"]
    assert failovers and all(fo["manager"] == "patroni" for fo in failovers)
    first = failovers[0]
    assert first["killed"] != first["promoted"]  # Patroni promoted the other node
    assert first["first_ack_after_promotion_s"] is not None  # appends came back (figure: docs/reliability.md)
    assert first["old_primary_back_as_sync_standby_s"] is not None  # pg_rewind, then synchronous again
    effects = summary["fault_effects"]
    assert effects.get("unexpected server exits", 0) == 0
    ops = summary["operations"]
    assert ops["ack"] > 20 and ops["txn"] > 2 and ops["read"] > 20


def test_failover_manager_option_and_its_bad_combination(tmp_path: Path) -> None:
    r = _chaos("--help", timeout=60)
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "--failover-manager {none,patroni}" in text and "Running with Patroni" in text
    r = _chaos("--failover-manager", "patroni", "--out", str(tmp_path / "a"), timeout=60)
    assert r.returncode == 2 and "--store postgresql" in r.stderr
    # the faults of the harness that act on what Patroni manages are left out, and cannot be asked for
    assert "rejoin-old-primary (Patroni brings the old primary back itself)" in text
    r = _chaos(
        "--store", "postgresql", "--failover-manager", "patroni", "--faults", "catch-up-load,lose-standby",
        "--out", str(tmp_path / "b"), timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "--faults lose-standby with --failover-manager patroni" in r.stderr
    r = _chaos(
        "--store", "postgresql", "--failover-manager", "patroni", "--faults", "rejoin-old-primary",
        "--out", str(tmp_path / "c"), timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and "rejoin-old-primary: Patroni rewinds the old primary" in r.stderr
