"""The batch line a task answers in process (`batch_runner.BatchRunner`), for the Responses
session that writes its answer to the store (`responses_session.py`, `store/batch_effects.py`).

Carried out of band, in a context variable the runner sets around its in-process request: the
ASGI app runs in the runner's task, and the tasks the request starts copy its context. A
request from outside runs in a server task where it is unset, so no client can pass a request
off as a batch line's, whatever it sends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from deepinfer_server.store.batch_effects import LineIdentity

_ANSWERING: ContextVar[LineIdentity | None] = ContextVar("batch_line", default=None)


@contextlib.contextmanager
def answering(identity: LineIdentity) -> Iterator[None]:
    """Within: the requests this task makes (in process) answer `identity`."""
    token = _ANSWERING.set(identity)
    try:
        yield
    finally:
        _ANSWERING.reset(token)


def line_answered() -> LineIdentity | None:
    """The batch line this request answers, or None (a client's request)."""
    return _ANSWERING.get()
