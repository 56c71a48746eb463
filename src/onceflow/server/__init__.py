"""HTTP server: the Durable Streams protocol (plus onceflow's extensions) over the broker."""

from .app import App, AppConfig
from .run import serve

__all__ = ["App", "AppConfig", "serve"]
