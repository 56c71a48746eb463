"""``onceflow sim`` shows its progress only on a terminal: piped, stdout is the JSON alone and stderr
carries no bar, no ``\\r`` counter and no ANSI codes (soak logs stay clean)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_sim_piped_prints_json_and_no_progress() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")}
    done = subprocess.run(
        [sys.executable, "-m", "onceflow.cli", "sim", "--seeds", "3", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads(done.stdout)  # the whole of stdout, nothing around it
    assert summary["seeds"] == 3 and summary["failed"] == 0
    assert "\r" not in done.stderr and "\x1b" not in done.stderr and "seeds" not in done.stderr, done.stderr
