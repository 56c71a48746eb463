"""Throwaway PostgreSQL and Redis servers for tests, benches and chaos runs (public through :mod:`onceflow.testing`).

Each lives in its own temporary directory and listens on a free loopback port (never the standard
5432 / 6379, so an installed server is never touched); ``stop()`` ends it and removes the
directory. PostgreSQL: ``initdb`` + ``pg_ctl`` from ``pg_config --bindir`` (or
``/usr/lib/postgresql/*/bin``), its Unix socket in the temporary directory; ``initdb`` refuses to
run as root, so as root both run as the unprivileged user ``nobody``. Redis: ``redis-server``
without persistence unless asked (``appendonly``).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from ..errors import OnceflowError
from .processes import free_port

__all__ = ["PostgresServer", "RedisServer", "ServiceUnavailable", "postgres_bindir"]


class ServiceUnavailable(OnceflowError, RuntimeError):
    """The server's binaries are not installed (``scripts/setup.sh dev`` installs them)."""


def postgres_bindir() -> Path:
    """Where ``initdb`` and ``pg_ctl`` are."""
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True).stdout.strip()
        if out and (Path(out) / "initdb").exists():
            return Path(out)
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0,
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb:
        return Path(os.path.realpath(initdb)).parent
    raise ServiceUnavailable(
        "PostgreSQL's initdb was not found (pg_config --bindir, /usr/lib/postgresql/*/bin, PATH); "
        "scripts/setup.sh dev installs Debian's postgresql package"
    )


class PostgresServer:
    """``initdb`` into a temporary directory, then ``pg_ctl start`` on a free loopback port.

    ``conninfo(dbname)`` connects as the superuser ``postgres`` (trust authentication, loopback
    only). ``fsync=False`` trades crash safety of the database itself for speed (tests kill
    clients, not this server). ``max_prepared_transactions`` > 0 enables two-phase commit.
    """

    def __init__(self, *, fsync: bool = True, max_prepared_transactions: int = 64) -> None:
        self.bindir = postgres_bindir()
        self.fsync = fsync
        self.max_prepared_transactions = max_prepared_transactions
        self.port = 0
        self.root: Path | None = None
        self._user: str | None = "nobody" if os.geteuid() == 0 else None

    def _run(self, argv: list[str], timeout: float = 120.0) -> None:
        kw: dict[str, object] = {}
        if self._user is not None:
            pw = pwd.getpwnam(self._user)
            kw = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=self.root, check=False, **kw)  # type: ignore[call-overload]
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:2])} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")

    @property
    def data(self) -> Path:
        assert self.root is not None, "start() first"
        return self.root / "data"

    def start(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="onceflow-pg-"))
        if self._user is not None:
            pw = pwd.getpwnam(self._user)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self._run(
            [
                str(self.bindir / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ]
        )
        last: Exception | None = None
        for _ in range(3):  # a free port can be taken between the probe and the bind
            self.port = free_port()
            opts = (
                f"-p {self.port} -h 127.0.0.1 -k {self.root} -c fsync={'on' if self.fsync else 'off'} "
                f"-c max_prepared_transactions={self.max_prepared_transactions} -c max_connections=100"
            )
            try:
                self._run(
                    [
                        str(self.bindir / "pg_ctl"),
                        "-D",
                        str(self.data),
                        "-l",
                        str(self.root / "postgres.log"),
                        "-w",
                        "-t",
                        "60",
                        "-o",
                        opts,
                        "start",
                    ]
                )
                return
            except RuntimeError as exc:
                last = exc
        self.stop()
        raise RuntimeError(f"PostgreSQL did not start: {last}")

    def conninfo(self, dbname: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={dbname} connect_timeout=10"

    def stop(self) -> None:
        if self.root is None:
            return
        if (self.data / "postmaster.pid").exists():
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self._run(
                    [str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"], timeout=60
                )
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    def __enter__(self) -> PostgresServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisServer:
    """``redis-server`` on a free loopback port, in the foreground as a child process."""

    def __init__(self, *, appendonly: bool = False, appendfsync: str = "everysec") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ServiceUnavailable(
                "redis-server was not found on PATH; scripts/setup.sh dev installs Debian's redis-server package"
            )
        self.binary = binary
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.port = 0
        self.root: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="onceflow-redis-"))
        last = ""
        for _ in range(3):
            self.port = free_port()
            argv = [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.root),
                "--save",
                "",
                "--appendonly",
                "yes" if self.appendonly else "no",
                "--appendfsync",
                self.appendfsync,
                "--daemonize",
                "no",
                "--logfile",
                str(self.root / "redis.log"),
            ]
            self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._wait_ready():
                return
            self._kill()
            last = (
                (self.root / "redis.log").read_text(errors="replace")[-2000:]
                if (self.root / "redis.log").exists()
                else ""
            )
        raise RuntimeError(f"redis-server did not start:\n{last}")

    def _wait_ready(self, timeout: float = 20.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return True
            time.sleep(0.05)
        return False

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        """Kill -9 and start again on the same directory (what survives depends on ``appendonly``)."""
        self._kill()
        self.start()

    def stop(self) -> None:
        self._kill()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
