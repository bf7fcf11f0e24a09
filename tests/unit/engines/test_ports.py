"""MASTER_PORT choice: a free port whose port - 50 is free too, never the HTTP port."""

from __future__ import annotations

import socket

import pytest

from deepinfer_server.engines.deepinfer.ports import RENDEZVOUS_OFFSET, choose_master_port
from deepinfer_server.errors import ConfigError


def _is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_chosen_port_and_rendezvous_are_free() -> None:
    port = choose_master_port(8000, environ={})
    assert port != 8000 and port - RENDEZVOUS_OFFSET != 8000
    assert _is_free(port) and _is_free(port - RENDEZVOUS_OFFSET)


def test_environment_port_is_checked_and_used() -> None:
    free = choose_master_port(8000, environ={})
    assert choose_master_port(8000, environ={"MASTER_PORT": str(free)}) == free


def test_environment_port_whose_rendezvous_is_busy_is_refused() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        with pytest.raises(ConfigError, match="rendezvous"):
            choose_master_port(8000, environ={"MASTER_PORT": str(taken + RENDEZVOUS_OFFSET)})


def test_environment_port_equal_to_http_port_is_refused() -> None:
    with pytest.raises(ConfigError):
        choose_master_port(9050, environ={"MASTER_PORT": "9100"})
    with pytest.raises(ConfigError):
        choose_master_port(9100, environ={"MASTER_PORT": "9100"})
    with pytest.raises(ConfigError):
        choose_master_port(9100, environ={"MASTER_PORT": "not-a-port"})
