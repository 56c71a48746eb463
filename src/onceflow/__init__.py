"""onceflow: a durable stream log with exactly-once semantics."""

from importlib.metadata import PackageNotFoundError, version

from .errors import OnceflowError

try:
    __version__ = version("onceflow")  # the one place it is written is pyproject.toml
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["OnceflowError", "__version__"]
