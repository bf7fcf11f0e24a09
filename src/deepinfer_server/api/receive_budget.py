"""The memory one API server process lets requests hold while they are still being received.

Each connection bounds its own request (`--max-header-bytes`, `--max-request-bytes`), but a
thousand connections each sending a large head or body slowly add up: 60 connections holding
10 MB heads once grew a process by 600 MB. Every head being received and every body being read
takes its bytes from one `ReceiveBudget` (`--max-receive-buffer-mb`) as they arrive, and gives
them back once the request is complete or gone; a request whose bytes do not fit is refused
with a 503 instead of buffered.
"""

from __future__ import annotations

from deepinfer_server.errors import ApiError, ErrorKind


class ReceiveBudget:
    """Bytes held by requests still being received, against one limit (one event loop)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, size: int, *, force: bool = False) -> bool:
        """Hold `size` more bytes if they fit (or `force`: probes are never refused);
        False, holding nothing, if they do not."""
        if not force and self.used + size > self.limit:
            return False
        self.used += size
        return True

    def give(self, size: int) -> None:
        """Release `size` bytes taken before."""
        self.used -= size


class ReceiveBufferFullError(ApiError, kind=ErrorKind.RECEIVE_BUFFER_FULL):
    """A request whose bytes do not fit in the process's receive budget: retry later."""

    def __init__(self) -> None:
        super().__init__(
            "the server is receiving too many large requests at once "
            "(--max-receive-buffer-mb); retry later"
        )

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"}
