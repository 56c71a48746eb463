#!/usr/bin/env python3
"""Run the Durable Streams server conformance suite against a throwaway `onceflow serve`.

`--store local` (the default) runs it on the segment log in a temp dir; `--store postgresql` on a
throwaway PostgreSQL (initdb in a temp dir, onceflow.testing.PostgresServer), waiting until the server
holds the store's lease. Starts the server (free loopback port, 500 ms long-poll timeout), runs the
npm suite from .ci/conformance with vitest (the reserved subscription APIs included; the suite starts
its own webhook receivers on 127.0.0.1), prints the count and exits non-zero unless every test that
ran passed. Installs the npm packages first when they are missing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from onceflow.testing import PostgresServer, free_port

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / ".ci" / "conformance"


def main() -> int:
    p = argparse.ArgumentParser(description="the Durable Streams conformance suite against onceflow serve")
    p.add_argument("--store", choices=["local", "postgresql"], default="local", help="the server's store")
    p.add_argument(
        "--via-follower",
        action="store_true",
        help="with --store postgresql: start a second server and run the suite through it, the follower, "
        "which passes every request on to the leader",
    )
    args = p.parse_args()
    if args.via_follower and args.store != "postgresql":
        p.error("--via-follower needs --store postgresql")
    if not (SUITE / "node_modules" / "@durable-streams" / "server-conformance-tests").exists():
        print("conformance: installing @durable-streams/server-conformance-tests@0.3.6 from npm", flush=True)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error"], cwd=SUITE, check=True)
    with contextlib.ExitStack() as stack:
        store: list[str] = []
        if args.store == "postgresql":
            pg = stack.enter_context(PostgresServer(fsync=False))
            store = ["--store", f"postgresql://postgres@127.0.0.1:{pg.port}/postgres"]
        label = args.store + (" store, through a follower" if args.via_follower else " store")
        return run_suite(store, label, args.via_follower)


def run_suite(store: list[str], label: str, via_follower: bool = False) -> int:
    port = free_port()
    data = Path(tempfile.mkdtemp(prefix="onceflow-conformance-"))
    follower: subprocess.Popen[str] | None = None
    server = _serve(port, data, store)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if "listening" not in line:
            print(f"conformance: server did not start: {line}{server.stdout.read()}", file=sys.stderr)
            return 1
        if store and not wait_for_lead(f"http://127.0.0.1:{port}"):
            print("conformance: the server did not take the store's lease", file=sys.stderr)
            return 1
        if via_follower:
            port = free_port()
            follower = _serve(port, data, store)
            assert follower.stdout is not None
            if "listening" not in follower.stdout.readline():
                print("conformance: the follower did not start", file=sys.stderr)
                return 1
        return _run(port, data, label)
    finally:
        for proc in (server, follower):
            if proc is None:
                continue
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(data, ignore_errors=True)


def _serve(port: int, data: Path, store: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
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
            *store,
        ],  # the suite's webhook receivers listen on 127.0.0.1
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _run(port: int, data: Path, label: str) -> int:
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
        f"conformance (@durable-streams/server-conformance-tests 0.3.6, {label}): "
        f"{report['numPassedTests']} passed, "
        f"{report['numFailedTests']} failed, {report['numPendingTests']} skipped "
        f"of {report['numTotalTests']} in {time.monotonic() - started:.0f}s",
        flush=True,
    )
    ok = report["numFailedTests"] == 0 and report["numPassedTests"] > 0 and run.returncode == 0
    return 0 if ok else 1


def wait_for_lead(url: str, within: float = 60.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError, ValueError, KeyError):
            if httpx.get(f"{url}/v1/leader", timeout=5.0).json()["leads"]:
                return True
        time.sleep(0.1)
    return False


if __name__ == "__main__":
    sys.exit(main())
