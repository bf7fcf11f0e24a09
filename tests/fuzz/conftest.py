"""The fuzz lane (marker `fuzz`): collected only when `-m` selects it.

It starts its own server and runs for minutes, and it needs the `fuzz` extra (schemathesis):
the default `pytest` run does not collect it at all (so it costs nothing and needs no extra),
and `pytest -m fuzz` without the extra is a collection error, not a silent skip.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

_SELECTS_FUZZ = re.compile(r"(?<!not )\bfuzz\b")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.name.startswith("test_") and not _SELECTS_FUZZ.search(
        config.getoption("markexpr") or ""
    ):
        return True
    return None
