"""Shared fixtures: an in-process broker + ASGI client, and a real server subprocess.

The server processes, free ports, PostgreSQL/Redis and the fault proxy come from
:mod:`onceflow.testing`; ``ServerProcess`` (in ``tests/helpers/servers.py``) is its
:class:`~onceflow.testing.OnceflowProcess`. Helpers shared between test modules live in the
``tests/helpers`` package (``tests`` is on pytest's ``pythonpath``); a test module never imports
another test module (``tests/test_layout.py`` checks). Fixtures for one area live in that area's
``conftest.py`` (``tests/sinks/conftest.py``: Redis and a shared server); a throwaway PostgreSQL
(``postgres_server``, one per session, and ``pg``, a fresh database per test) is here, for the sinks
and the PostgreSQL store alike.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.servers import InProcess, ServerProcess
from onceflow.core.broker import Broker
from onceflow.server.app import App, AppConfig
from onceflow.testing import PostgresServer, ServiceUnavailable


def _tools_on_subprocess_path() -> None:
    """Child processes (``python -m onceflow.cli sim``, chaos workers) import the same onceflow_tools as
    this one: pytest's ``pythonpath = tools`` reaches only this interpreter, so add it to PYTHONPATH."""
    spec = importlib.util.find_spec("onceflow_tools")
    if spec is None or spec.origin is None:
        return
    where = str(Path(spec.origin).parent.parent)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep) if os.environ.get("PYTHONPATH") else []
    if where not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, where])


_tools_on_subprocess_path()


_databases = itertools.count()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    try:
        server = PostgresServer(fsync=False, max_prepared_transactions=32)
    except ServiceUnavailable as exc:
        pytest.skip(f"no PostgreSQL to start: {exc}")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def drop_prepared(conninfo: str) -> list[str]:
    """Roll back every prepared transaction of the database; returns their ids."""
    import psycopg

    with psycopg.connect(conninfo, autocommit=True) as conn:
        gids = [
            r[0]
            for r in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()").fetchall()
        ]
        for gid in gids:
            conn.execute(f"ROLLBACK PREPARED '{gid}'")
    return gids


@pytest.fixture
def pg(postgres_server: PostgresServer) -> Iterator[str]:
    """A new, empty database; its conninfo."""
    import psycopg

    name = f"t{next(_databases)}"
    with psycopg.connect(postgres_server.conninfo(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
    conninfo = postgres_server.conninfo(name)
    try:
        yield conninfo
    finally:
        drop_prepared(conninfo)
        with psycopg.connect(postgres_server.conninfo(), autocommit=True) as admin:
            admin.execute(f"DROP DATABASE {name} WITH (FORCE)")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ONCEFLOW_TEST_STORE=postgresql runs the in-process server (the ``onceflow`` fixture) on the
# PostgreSQL store (storage/pgfs.py) instead of a temp dir: the same semantic tests on both stores.
# A test that works on the local disk's files themselves is marked ``local_store``.
TEST_STORE = os.environ.get("ONCEFLOW_TEST_STORE", "local")
if TEST_STORE not in ("local", "postgresql"):
    raise RuntimeError(f"ONCEFLOW_TEST_STORE={TEST_STORE!r}: local or postgresql")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ONCEFLOW_TEST_STORE=postgresql only the tests of the in-process server run (the others
    ran with the local store already), those marked ``local_store`` skipped."""
    if TEST_STORE == "local":
        return
    skip = pytest.mark.skip(reason="works on the local store's files themselves (ONCEFLOW_TEST_STORE=postgresql)")
    chosen, other = [], []
    for item in items:
        if "onceflow" not in getattr(item, "fixturenames", ()):
            other.append(item)
            continue
        if item.get_closest_marker("local_store") is not None:
            item.add_marker(skip)
        chosen.append(item)
    if other:
        config.hook.pytest_deselected(items=other)
        items[:] = chosen


@pytest.fixture
async def onceflow(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[InProcess]:
    """A broker served in-process (no sockets) with a small body limit, on a temp dir (or on a fresh
    PostgreSQL database with ONCEFLOW_TEST_STORE=postgresql)."""
    fs = None
    data = tmp_path / "data"
    if TEST_STORE == "postgresql":
        from onceflow.storage.pgfs import PgFileSystem

        fs = PgFileSystem(request.getfixturevalue("pg"))
        data = Path("/onceflow/data")
    broker = Broker(data, fs=fs)
    broker.open()
    app = App(broker, AppConfig(long_poll_timeout=0.3, max_body_bytes=64 * 1024))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        yield InProcess(broker, app, client, data, fs)
    await broker.close()
    if fs is not None:
        fs.close()


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


@pytest.fixture
def registered(spark: Any) -> Any:
    """The session Spark, with onceflow's data source registered."""
    import onceflow.spark

    onceflow.spark.register(spark)
    return spark
