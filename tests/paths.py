"""Where the tests find the repository's files, wherever a test module sits."""

from __future__ import annotations

from pathlib import Path

#: The tests folder.
TESTS = Path(__file__).resolve().parent
#: The repository's root.
REPO = TESTS.parent
#: The secret the test servers' prefill/decode pairs share (test data, not a real secret).
PD_SECRET = TESTS / "data" / "pd-secret"
#: The option that gives a test server with a prefill or decode role that secret.
PD_SECRET_ARGS = ("--disaggregation-secret-file", str(PD_SECRET))
