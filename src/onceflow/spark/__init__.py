"""onceflow for PySpark: ``format("onceflow")`` sources and exactly-once sinks.

>>> import onceflow.spark
>>> onceflow.spark.register(spark)
>>> df = spark.readStream.format("onceflow").option("url", url).option("streams", "events").load()

Needs ``pip install onceflow[spark]`` (pyspark 4.x and pyarrow) on the driver and the executors.
"""

from __future__ import annotations

from typing import Any

from .datasource import OnceflowDataSource
from .options import OptionError
from .sinks import PostgresBatchSink, RedisBatchSink, postgres_sink, redis_sink

__all__ = ["OnceflowDataSource", "OptionError", "PostgresBatchSink", "RedisBatchSink", "postgres_sink", "redis_sink", "register"]


def register(spark: Any) -> None:
    """Make ``format("onceflow")`` available in ``spark`` (a SparkSession)."""
    spark.dataSource.register(OnceflowDataSource)
