"""onceflow: a durable stream log with exactly-once semantics."""

__version__ = "0.1.0"
__all__ = ["__version__"]
