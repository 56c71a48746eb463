"""Errors of the processor runtime: subclasses of the package root :class:`~onceflow.errors.OnceflowError`."""

from __future__ import annotations

from ..errors import OnceflowError

__all__ = ["ProcessorError", "ProcessorFencedError"]


class ProcessorError(OnceflowError):
    """A processor was misused or found its streams in a state it cannot continue from."""


class ProcessorFencedError(ProcessorError):
    """Another instance of the same processor (or source) id took over; this one must stop.

    ``epoch`` is this instance's claim and ``current_epoch`` the newer one (None for sources,
    which have no epochs: another writer appended to their output first).
    """

    def __init__(self, message: str, *, epoch: int | None = None, current_epoch: int | None = None) -> None:
        super().__init__(message, code="processor_fenced")
        self.epoch = epoch
        self.current_epoch = current_epoch
