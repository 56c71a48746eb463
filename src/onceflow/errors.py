"""The one root of everything onceflow raises: :class:`OnceflowError`.

Every public exception of the package descends from it (the client's HTTP errors, the server
core's refusals, the processors', sinks' and Spark connector's errors), so ``except OnceflowError``
catches all of them, and ``retriable`` says for each whether doing the same thing again may succeed.
Classes that were ``ValueError``\\ s before (``OptionError``, ``JsonError``, ``GuardConfigError``)
keep that base too. See docs/architecture.md, "The vocabulary".
"""

from __future__ import annotations

__all__ = ["OnceflowError"]


class OnceflowError(Exception):
    """Root of every onceflow error.

    ``retriable``: whether sending (doing) the same thing again may succeed; a class attribute
    (False unless a class says otherwise), overridable per instance. ``code``: a short machine
    name of the reason (a protocol error code such as ``stream_closed``, a refusal kind; "" when
    none). ``status``: the HTTP status of the answer the error came from (client side; None when
    no answer arrived or none is involved).
    """

    retriable: bool = False

    def __init__(
        self, message: str = "", *, status: int | None = None, code: str = "", retriable: bool | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        if retriable is not None:
            self.retriable = retriable

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, status={self.status}, code={self.code!r})"
