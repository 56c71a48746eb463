"""``format("onceflow")``: the Python Data Source that ties the source and the sink together."""

from __future__ import annotations

from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
)
from pyspark.sql.types import StructType

from .options import OptionError, Options, Role
from .source import OnceflowBatchReader, OnceflowStreamReader, is_text_type, source_schema
from .writer import OnceflowBatchWriter, OnceflowStreamWriter, check_sink_schema

__all__ = ["OnceflowDataSource"]


class OnceflowDataSource(DataSource):
    """Read and write onceflow streams from Spark (batch and Structured Streaming).

    Register it once per session with ``onceflow.spark.register(spark)``; then
    ``spark.readStream.format("onceflow").option("url", ...).option("streams", "a,b")`` and
    ``df.writeStream.format("onceflow").option("url", ...).option("stream", "out")``.
    """

    @classmethod
    def name(cls) -> str:
        return "onceflow"

    extra_options: tuple[str, ...] = ()  # names a subclass takes besides the connector's own

    def _opts(self, role: Role) -> Options:
        """The options, for the source or the sink: a name that side does not take is an error."""
        return Options.parse(self.options, role, self.extra_options)

    def _text_values(self, opts: Options) -> bool:
        forced = {k.lower(): v for k, v in self.options.items()}.get("valuetype")
        if forced is not None:
            if forced not in ("string", "binary"):
                raise OptionError(f"option valueType must be string or binary, got {forced!r}")
            return forced == "string"
        with opts.connect() as conn:
            if opts.pattern is not None:
                types = [s.content_type for s in conn.list_streams(opts.pattern)]
            else:
                types = []
                for name in opts.streams:
                    info = conn.head(name)
                    if info is None:
                        raise OptionError(f"onceflow stream {name!r} does not exist at {opts.url}")
                    types.append(info.content_type)
        # string values when every stream holds text (JSON included), so from_json() just works
        return bool(types) and all(is_text_type(t) for t in types)

    def schema(self) -> StructType:
        opts = self._opts("source")
        opts.check_source()
        return source_schema(self._text_values(opts))

    def reader(self, schema: StructType) -> DataSourceReader:
        opts = self._opts("source")
        opts.check_source()
        return OnceflowBatchReader(opts, _value_is_text(schema))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:  # noqa: N802 (Spark's name)
        opts = self._opts("source")
        opts.check_source()
        return OnceflowStreamReader(opts, _value_is_text(schema))

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        opts = self._opts("sink")
        check_sink_schema(schema, opts)
        return OnceflowBatchWriter(opts)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:  # noqa: N802
        opts = self._opts("sink")
        check_sink_schema(schema, opts)
        if opts.sink_id is None:
            raise OptionError(
                'the streaming onceflow sink needs .option("sinkId", "<name>"): a name that stays the same across '
                "restarts of this query (like its checkpoint), under which the sink records which batches it committed"
            )
        return OnceflowStreamWriter(opts, opts.sink_id)


def _value_is_text(schema: StructType) -> bool:
    from pyspark.sql.types import StringType

    return any(f.name == "value" and isinstance(f.dataType, StringType) for f in schema.fields)
