"""Choice of DeepInfer's distributed port: MASTER_PORT, whose rendezvous uses MASTER_PORT - 50."""

from __future__ import annotations

import os
import socket

from deepinfer_server.errors import ConfigError

RENDEZVOUS_OFFSET = 50


def _is_free(port: int, host: str = "127.0.0.1") -> bool:
    if not 0 < port < 65536:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _usable(port: int, http_port: int) -> bool:
    rendezvous = port - RENDEZVOUS_OFFSET
    return http_port not in (port, rendezvous) and _is_free(port) and _is_free(rendezvous)


def choose_master_port(http_port: int, environ: dict[str, str] | None = None) -> int:
    """MASTER_PORT from the environment (checked), or a free port whose port - 50 is free too."""
    env = os.environ if environ is None else environ
    if "MASTER_PORT" in env:
        try:
            port = int(env["MASTER_PORT"])
        except ValueError:
            raise ConfigError(f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number") from None
        if not _usable(port, http_port):
            raise ConfigError(
                f"MASTER_PORT={port} cannot be used: DeepInfer needs port "
                f"{port - RENDEZVOUS_OFFSET} "
                f"free for its rendezvous, and neither may be the HTTP port {http_port}"
            )
        return port
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            candidate = int(probe.getsockname()[1])
        if candidate > RENDEZVOUS_OFFSET + 1024 and _usable(candidate, http_port):
            return candidate
    raise ConfigError("no free MASTER_PORT found whose MASTER_PORT - 50 is free too")
