"""Errors of the grammar package; the server maps GrammarError to a 400 naming `param`."""

from __future__ import annotations

INSTALL_HINT = (
    "structured output needs the [grammar] extra: pip install 'deepinfer-server[grammar]'"
)


class GrammarError(Exception):
    """A structured-output option that cannot be honoured; `param` names the request field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class GrammarUnavailable(GrammarError):
    """xgrammar is not installed, so no grammar can be built, compiled or matched."""

    def __init__(self, param: str | None = None) -> None:
        super().__init__(INSTALL_HINT, param)
