"""Processors on onceflow streams, without Spark.

- Cues-style exactly-once processors (seed 000): :class:`StreamProcessor` (inputs -> one output
  stream, exactly once), :class:`SinkProcessor` (at least once, with a stable hash per input range
  for idempotent targets) and :class:`Source` (outside data plus its position in one append); each
  with an ``Async`` twin.
- Wallaroo-style watermarking (seed 001): :class:`Watermarker` and :class:`Acker`, pure bookkeeping.
- Built on them: :class:`Pipeline` (source -> steps -> outputs, fan-out, offsets committed only
  below what every downstream step finished) and :class:`ParallelConsumer` (one step, concurrent,
  out-of-order completion), at-least-once or exactly-once (outputs and offsets in one transaction).

See docs/processors.md for when to use which.
"""

from ._cues import (
    AsyncSinkProcessor,
    AsyncSource,
    AsyncStreamProcessor,
    Batch,
    Record,
    Recovery,
    SinkProcessor,
    Snapshot,
    Source,
    StepResult,
    StreamProcessor,
    snapshot_hash,
)
from ._errors import ProcessorError, ProcessorFencedError
from ._pipeline import Output, ParallelConsumer, Pipeline, PipelineDelivery, PipelineStats, Step
from ._watermark import FILTERED, Acker, Watermarker

__all__ = [
    "FILTERED",
    "Acker",
    "AsyncSinkProcessor",
    "AsyncSource",
    "AsyncStreamProcessor",
    "Batch",
    "Output",
    "ParallelConsumer",
    "Pipeline",
    "PipelineDelivery",
    "PipelineStats",
    "ProcessorError",
    "ProcessorFencedError",
    "Record",
    "Recovery",
    "SinkProcessor",
    "Snapshot",
    "Source",
    "Step",
    "StepResult",
    "StreamProcessor",
    "Watermarker",
    "snapshot_hash",
]
