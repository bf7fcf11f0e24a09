"""The router lane: real simulated replicas behind real routers (vLLM Router, SGLang gateway,
the Shepherd Model Gateway in prefill/decode mode)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.routers.fleet import Router, smg_binary, smg_pd_gateway

#: make_pd_gateway(prefill=[(url, bootstrap_port or None), ...], decode=[url, ...]) -> Router
MakePdGateway = Callable[[list[tuple[str, int | None]], list[str]], Router]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "routers: replicas behind vLLM Router / the SGLang gateway (needs their binary)"
    )


@pytest.fixture()
def make_pd_gateway(tmp_path: Path) -> Iterator[MakePdGateway]:
    """Starts `smg launch --pd-disaggregation` in front of the given prefill and decode URLs,
    returns it once smg lists every one of them as healthy, and stops it after the test.
    Skips (before anything starts) when scripts/install-smg.sh has not installed smg."""
    smg_binary()
    gateways: list[Router] = []

    def make(prefill: list[tuple[str, int | None]], decode: list[str]) -> Router:
        gateway = smg_pd_gateway(prefill, decode, tmp_path / f"smg-pd-{len(gateways)}.log")
        gateways.append(gateway)
        # smg registers (and classifies) its workers in the background after it listens.
        gateway.wait_healthy({url for url, _ in prefill} | set(decode))
        return gateway

    yield make
    for gateway in gateways:
        gateway.stop()
