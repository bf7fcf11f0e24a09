"""Configuration: the options as given (`ServerConfig`) and as resolved (`ResolvedConfig`)."""

from deepinfer_server.config.options import ServerConfig, option
from deepinfer_server.config.resolved import ResolvedConfig, derive_parallelism, resolve

__all__ = ["ResolvedConfig", "ServerConfig", "derive_parallelism", "option", "resolve"]
