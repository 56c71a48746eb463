"""onceflow for PySpark: ``format("onceflow")`` sources and exactly-once sinks.

>>> import onceflow.spark
>>> onceflow.spark.register(spark)
>>> df = spark.readStream.format("onceflow").option("url", url).option("streams", "events").load()

Needs ``pip install onceflow[spark]`` (pyspark 4.x and pyarrow) on the driver and the executors.
Importing this package does not import pyspark (``OnceflowDataSource`` is loaded when first used),
so ``onceflow.spark.protocol``, the sink's protocol, runs without it.
"""

from __future__ import annotations

from typing import Any

from .foreach_batch import PostgresBatchSink, RedisBatchSink, postgres_sink, redis_sink
from .options import OptionError

__all__ = [
    "OnceflowDataSource",
    "OptionError",
    "PostgresBatchSink",
    "RedisBatchSink",
    "postgres_sink",
    "redis_sink",
    "register",
]


def register(spark: Any) -> None:
    """Make ``format("onceflow")`` available in ``spark`` (a SparkSession)."""
    from .datasource import OnceflowDataSource

    spark.dataSource.register(OnceflowDataSource)


def __getattr__(name: str) -> Any:
    if name == "OnceflowDataSource":
        from .datasource import OnceflowDataSource

        return OnceflowDataSource
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
