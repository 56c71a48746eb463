"""Shared fixtures: an in-process broker + ASGI client, and a real server subprocess."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class InProcess:
    broker: Broker
    app: App
    client: httpx.AsyncClient
    data: Path


@pytest.fixture
async def onceflow(tmp_path: Path) -> AsyncIterator[InProcess]:
    """A broker on a temp dir served in-process (no sockets) with a small body limit."""
    broker = Broker(tmp_path / "data")
    broker.open()
    app = App(broker, AppConfig(long_poll_timeout=0.3, max_body_bytes=64 * 1024))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        yield InProcess(broker, app, client, tmp_path / "data")
    await broker.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`onceflow serve` as a child process on a free loopback port; restartable on the same data."""

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
            [sys.executable, "-m", "onceflow.cli", "serve", "--data", str(self.data), "--port", str(self.port),
             "--long-poll-timeout", "0.5", *self.extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=self._limits,
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


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path / "data")
    srv.start()
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """One local[2] Spark session for the whole test run (it costs 10-20 s to start).

    Spark's Python workers run this interpreter, so they import the installed onceflow package.
    """
    import os

    pyspark = pytest.importorskip("pyspark.sql", reason="pyspark is part of the dev install (scripts/setup.sh dev)")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # loopback only
    session = (
        pyspark.SparkSession.builder.master("local[2]")
        .appName("onceflow-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.execution.pythonUDF.arrow.enabled", "false")  # it wants pandas, which onceflow does not need
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
