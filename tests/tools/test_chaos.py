"""``onceflow chaos``: a bounded run passes the history check after every kind of fault bit at least once."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from onceflow.demo import spark_missing
from onceflow_tools.chaos.run import FAULT_KINDS


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_chaos_run_is_clean_and_injects_every_fault(tmp_path: Path) -> None:
    """With the sink and the Spark pipeline among the clients (where Redis, PySpark and Java are installed,
    as ``scripts/setup.sh dev`` does): ~100 s, of which ~40 s waiting for Spark's first batch."""
    out = tmp_path / "chaos"
    proc = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "chaos", "--duration", "45", "--seed", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "history check: OK" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is True
    assert all(n == 0 for n in summary["anomalies"].values())
    missing = [k for k in FAULT_KINDS if summary["faults"][k] < 1]
    assert not missing, f"faults never injected: {missing}"
    effects = summary["fault_effects"]
    # the faults bit: answers were lost, garbage was cut off by recovery, writes were refused
    assert effects.get("acks dropped", 0) > 0
    assert effects.get("garbled tails dropped by recovery", 0) > 0
    assert effects.get("garbled tails kept after recovery", 0) == 0
    assert effects.get("unexpected server exits", 0) == 0
    assert effects.get("refusals while disk full", 0) > 0
    assert effects.get("refusals while read-only", 0) > 0
    ops = summary["operations"]
    assert ops["ack"] > 200 and ops["txn"] > 20 and ops["commit-offset"] > 10 and ops["read"] > 100
    assert summary["values_checked"] > 1000
    ran, skipped = summary["clients"]["ran"], summary["clients"]["skipped"]
    if shutil.which("redis-server") is None:
        assert "sink-0" in skipped and "sink" not in summary
    else:  # the sink ran, was killed once while at work, and Redis holds its input exactly once
        assert "sink-0" in ran
        sink = summary["sink"]
        assert sink["killed"] >= 1 and sink["checkpoints committed"] > 0 and sink["restores"] >= 2
        assert sink["anomalies"] == 0 and sink["values in redis"] == sink["input values"] > 100
    if spark_missing() is not None:
        assert "spark-0" in skipped and "spark" not in summary
    else:  # the Spark driver (JVM and all) was killed once after its first batch; every event enriched once
        assert "spark-0" in ran
        spark = summary["spark"]
        assert spark["killed"] >= 1 and spark["starts"] >= 2 and spark["last batch enrich"] >= 1
        assert spark["anomalies"] == 0 and spark["enriched"] == spark["events"] > 100
        assert effects.get("clients behind at the end", 0) == 0


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_broken_experiment_is_caught(tmp_path: Path) -> None:
    """Cutting acknowledged bytes off the log must fail the run: the check is not vacuous."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "onceflow.cli",
            "chaos",
            "--duration",
            "15",
            "--seed",
            "1",
            "--sabotage",
            "truncate-acked",
            "--no-spark",
            "--no-sink",
            "--out",
            str(tmp_path / "chaos"),
        ],
        capture_output=True,
        text=True,
        timeout=190,
    )
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((tmp_path / "chaos" / "summary.json").read_text())
    assert summary["faults"]["garble-tail"] >= 1
    assert summary["anomalies"]["lost-write"] > 0


def test_chaos_help_and_bad_arguments(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "chaos", "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "--duration" in r.stdout and "--seed" in r.stdout and "--out" in r.stdout
    assert "--no-spark" in r.stdout and "--no-sink" in r.stdout
    (tmp_path / "x").write_text("occupied")
    r = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "chaos", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "not empty" in r.stderr
