"""Where the tests find the repository's files, wherever a test module sits."""

from __future__ import annotations

from pathlib import Path

#: The tests folder.
TESTS = Path(__file__).resolve().parent
#: The repository's root.
REPO = TESTS.parent
