"""Errors of the grammar package; the server maps GrammarError to a 400 naming `param`."""

from __future__ import annotations

# The package is installed from its checkout (it is not on PyPI): the advice is the command
# that works there.
INSTALL_HINT = (
    "structured output needs the [grammar] extra: pip install '.[grammar]' "
    "in the deepinfer-server checkout"
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


class CompileRefused(Exception):
    """A grammar that was not compiled for want of capacity, not for a fault of its own: the
    client should retry after `retry_after` seconds. `per_key`: this API key has as many
    compiles queued as it may (a 429); otherwise the server is out of compile capacity for now
    (a 503)."""

    def __init__(self, message: str, retry_after: int, *, per_key: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        self.per_key = per_key
