"""The router lane: real simulated replicas behind real routers (vLLM Router, SGLang gateway,
the Shepherd Model Gateway in prefill/decode mode)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.routers.fleet import Router, pd_gateway, smg_binary

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
    numbers = itertools.count()
    with contextlib.ExitStack() as gateways:

        def make(prefill: list[tuple[str, int | None]], decode: list[str]) -> Router:
            log_path = tmp_path / f"smg-pd-{next(numbers)}.log"
            return gateways.enter_context(pd_gateway(prefill, decode, log_path))

        yield make
