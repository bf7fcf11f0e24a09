"""The package's public face: its version, matching the installed distribution."""

from __future__ import annotations

from importlib.metadata import version

import deepinfer_server


def test_public_names_and_version() -> None:
    assert deepinfer_server.__all__ == ["__version__"]
    assert deepinfer_server.__version__ == version("deepinfer-server")
