"""onceflow: a durable stream log with exactly-once semantics."""

from .errors import OnceflowError

__version__ = "0.1.0"
__all__ = ["OnceflowError", "__version__"]
