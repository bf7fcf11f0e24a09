"""The router lane: real simulated replicas behind real routers (vLLM Router, SGLang gateway)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "routers: replicas behind vLLM Router / the SGLang gateway (needs their binary)"
    )
