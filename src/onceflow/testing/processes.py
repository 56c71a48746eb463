"""Child processes for tests, benches and chaos runs: ``onceflow serve``, any server with a ready line.

Public through :mod:`onceflow.testing`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from ..errors import OnceflowError

__all__ = ["OnceflowProcess", "ServerFailure", "ServerProcess", "free_port", "kill_now", "onceflow_server"]


class ServerFailure(OnceflowError):
    """A server process did not become ready (it exited, or printed no ready line in time)."""


def kill_now(proc: subprocess.Popen[bytes] | None) -> None:
    """``kill -9`` ``proc`` and reap it: continued first, in case it is stopped (SIGSTOP), so that
    it dies now; a process already gone is fine."""
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """A server child process: started in its own session, its output drained, stopped by pid.

    ``ready`` matches the line that makes it ready, its first group the server's URL. ``serving``, when
    given, matches a later line that must follow before it is: a server on a shared store listens
    (and prints its URL) at once, but serves only once it leads (``onceflow serve --store``).
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        ready: re.Pattern[str],
        *,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        serving: re.Pattern[str] | None = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.ready = ready
        self.serving = serving
        self.cwd = cwd
        self.env = env
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self._lines: deque[str] = deque(maxlen=40)
        self._ready_at: float | None = None
        self._ready_event = threading.Event()
        self._reader: threading.Thread | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout: float = 60.0) -> float:
        """Start and wait for the ready line; returns the seconds from spawn to ready."""
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.argv,
            cwd=self.cwd,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C reaches only us; we stop the child in a finally
        )
        self._reader = threading.Thread(target=self._drain, name=f"drain-{self.name}", daemon=True)
        self._reader.start()
        deadline = t0 + timeout
        while not self._ready_event.wait(0.002):
            if self.proc.poll() is not None:
                self._reader.join(2)
                raise ServerFailure(
                    f"{self.name} exited with code {self.proc.returncode} before it was ready:\n{self.output_tail()}"
                )
            if time.perf_counter() > deadline:
                raise ServerFailure(f"{self.name} was not ready after {timeout:.0f} s:\n{self.output_tail()}")
        return (self._ready_at or time.perf_counter()) - t0

    def _drain(self) -> None:
        proc = self.proc
        if proc is None or proc.stdout is None:
            return
        serving = self.serving is None  # no later line to wait for
        for raw in proc.stdout:
            now = time.perf_counter()
            line = raw.decode("utf-8", "replace").rstrip()
            self._lines.append(line)
            if self._ready_event.is_set():
                continue
            if not self.url:
                m = self.ready.search(line)
                if m:
                    self.url = m.group(1).rstrip("/")
            elif self.serving is not None and self.serving.search(line):
                serving = True
            if self.url and serving:
                self._ready_at = now
                self._ready_event.set()

    def output_tail(self) -> str:
        return "\n".join(f"    | {line}" for line in self._lines) or "    | (no output)"

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the process (all threads) so far, from /proc."""
        if self.proc is None:
            return None
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return None
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 15 s. Safe to call twice."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                print(f"[{self.name}] pid {proc.pid} ignored SIGTERM for 15 s; killing it", file=sys.stderr, flush=True)
                proc.kill()
                proc.wait()
        if self._reader is not None:
            self._reader.join(5)
        if proc.stdout is not None:
            proc.stdout.close()
        self.proc = None


def onceflow_server(data: Path, fsync: str = "always", *extra: str, store: str | None = None) -> ServerProcess:
    """``onceflow serve`` on a free loopback port with its data in ``data``, or, given ``store`` (a
    PostgreSQL conninfo or URL), in that database: then it is ready once it leads the store.
    ``extra``: more ``serve`` arguments."""
    where = ["--data", str(data)] if store is None else ["--store", store]
    argv = [sys.executable, "-m", "onceflow.cli", "serve", *where, "--host", "127.0.0.1", "--port", "0"]
    argv += ["--fsync", fsync, *extra]
    listening = re.compile(r"onceflow listening on (http://\S+)")
    if store is None:
        return ServerProcess("onceflow serve", argv, listening)
    return ServerProcess("onceflow serve --store", argv, listening, serving=re.compile(r"onceflow leads the store"))


class OnceflowProcess:
    """`onceflow serve` as a child process on a free loopback port; restartable on the same data and port.

    The tests' server (``tests/conftest.py`` calls it ``ServerProcess``): ``extra`` are more ``serve``
    arguments, ``open_files`` the server's RLIMIT_NOFILE; ``kill()`` is SIGKILL, ``stop()`` SIGTERM.
    """

    def __init__(self, data: Path, *extra: str, open_files: int | None = None) -> None:
        self.data = data
        self.extra = extra
        self.open_files = open_files  # RLIMIT_NOFILE (soft and hard) of the server process
        self.port = free_port()
        self.proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "onceflow.cli",
                "serve",
                "--data",
                str(self.data),
                "--port",
                str(self.port),
                "--long-poll-timeout",
                "0.5",
                *self.extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=self._limits,
        )
        assert self.proc.stdout is not None
        seen: list[str] = []
        while True:  # recovery may log warnings before the ready line
            line = self.proc.stdout.readline()
            if "listening" in line:
                return
            if not line:  # the process ended without becoming ready
                self.proc.wait()
                raise RuntimeError("server did not start:\n" + "".join(seen))
            seen.append(line)

    def _limits(self) -> None:
        if self.open_files is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (self.open_files, self.open_files))

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            assert self.proc.stdout is not None
            self.proc.stdout.close()
            self.proc = None

    def stop(self) -> int:
        """SIGTERM and wait; returns the exit code."""
        assert self.proc is not None
        self.proc.terminate()
        code = self.proc.wait(15)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self.proc = None
        return code
