#!/usr/bin/env python3
"""Run the Durable Streams server conformance suite against a throwaway `onceflow serve`.

Starts the server (file-backed, temp dir, free loopback port, 500 ms long-poll timeout), runs the
npm suite from .ci/conformance with vitest (the reserved subscription APIs included; the suite starts
its own webhook receivers on 127.0.0.1), prints the count and exits non-zero unless every test that
ran passed. Installs the npm packages first when they are missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from onceflow.testing import free_port

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / ".ci" / "conformance"


def main() -> int:
    if not (SUITE / "node_modules" / "@durable-streams" / "server-conformance-tests").exists():
        print("conformance: installing @durable-streams/server-conformance-tests@0.3.6 from npm", flush=True)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error"], cwd=SUITE, check=True)
    port = free_port()
    data = Path(tempfile.mkdtemp(prefix="onceflow-conformance-"))
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "onceflow.cli",
            "serve",
            "--data",
            str(data),
            "--port",
            str(port),
            "--long-poll-timeout",
            "0.5",
            "--fsync",
            "always",
            "--webhook-targets",
            "loopback",
        ],  # the suite's webhook receivers listen on 127.0.0.1
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if "listening" not in line:
            print(f"conformance: server did not start: {line}{server.stdout.read()}", file=sys.stderr)
            return 1
        out = data / "result.json"
        env = dict(os.environ, CONFORMANCE_BASE_URL=f"http://127.0.0.1:{port}", CONFORMANCE_LONG_POLL_MS="500")
        started = time.monotonic()
        run = subprocess.run(
            ["npx", "vitest", "run", "--reporter=json", f"--outputFile={out}"],
            cwd=SUITE,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if not out.exists():
            print(run.stdout[-5000:])
            print("conformance: the suite produced no report", file=sys.stderr)
            return 1
        report = json.loads(out.read_text())
        failed = []
        for f in report["testResults"]:
            for a in f["assertionResults"]:
                if a["status"] == "failed":
                    msg = (a.get("failureMessages") or [""])[0].splitlines()
                    failed.append(f"{' > '.join(a['ancestorTitles'][1:])} :: {a['title']}: {msg[0] if msg else ''}")
        for line in failed:
            print(f"  FAILED {line}")
        print(
            f"conformance (@durable-streams/server-conformance-tests 0.3.6): {report['numPassedTests']} passed, "
            f"{report['numFailedTests']} failed, {report['numPendingTests']} skipped "
            f"of {report['numTotalTests']} in {time.monotonic() - started:.0f}s",
            flush=True,
        )
        ok = report["numFailedTests"] == 0 and report["numPassedTests"] > 0 and run.returncode == 0
        return 0 if ok else 1
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
