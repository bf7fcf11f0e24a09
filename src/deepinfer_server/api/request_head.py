"""A request's head (request line and header lines) counted as its bytes arrive, within bounds.

uvicorn's parsers set no bound of their own on a head: httptools (llhttp) keeps every header
byte until the line ends, h11 keeps 16 KiB unless told otherwise and then answers a plain 400.
`HeadScanner` reads the bytes before the parser does, so a head past `--max-header-line-bytes`
(one line, its line ending included) or `--max-header-bytes` (the whole head) is refused
before the parser holds any byte over the bound. It also notes what the refusal's envelope
depends on: the request target's path, and whether an `anthropic-version` header came first.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer_server.errors import ApiError, ErrorKind

#: Bytes of the request line kept to tell the path (the rest is only counted).
_KEPT_TARGET = 512
#: Bytes of each header line kept to tell its name.
_KEPT_NAME = 32
_ANTHROPIC_VERSION = b"anthropic-version:"


@dataclass(frozen=True)
class HeadLimits:
    """The bounds of one request head, in bytes."""

    max_bytes: int
    max_line_bytes: int


class HeadTooLarge(Exception):
    """A head passed one of its bounds; `error` is what the client is told."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


class HeadScanner:
    """Counts one request head's bytes across the chunks it arrives in."""

    def __init__(self, limits: HeadLimits) -> None:
        self.limits = limits
        #: Bytes of the head so far.
        self.size = 0
        self._line = 0
        self._lines = 0
        self._start = bytearray()
        self._request_line = bytearray()
        self.anthropic_version = False

    @property
    def path(self) -> str:
        """The request target's path as far as it arrived ("" before it)."""
        parts = bytes(self._request_line).split(b" ", 2)
        target = parts[1] if len(parts) > 1 else b""
        return target.split(b"?", 1)[0].decode("latin-1")

    def feed(self, data: bytes) -> int | None:
        """Count `data`: the offset just past the head's blank line when the head ends in it,
        None while it goes on. Raises HeadTooLarge as soon as a bound is passed."""
        limits = self.limits
        position, length = 0, len(data)
        while position < length:
            newline = data.find(b"\n", position)
            end = length if newline < 0 else newline + 1
            self._line += end - position
            self.size += end - position
            if len(self._start) < _KEPT_NAME:
                self._start += data[position : min(end, position + _KEPT_NAME)]
            if self._lines == 0 and len(self._request_line) < _KEPT_TARGET:
                self._request_line += data[position : min(end, position + _KEPT_TARGET)]
            if self._line > limits.max_line_bytes:
                raise HeadTooLarge(self._line_error())
            if self.size > limits.max_bytes:
                raise HeadTooLarge(
                    ApiError(
                        f"the request's headers are larger than {limits.max_bytes} bytes",
                        kind=ErrorKind.HEADERS_TOO_LARGE,
                    )
                )
            if newline < 0:
                return None
            position = end
            if self._end_line():
                return end
        return None

    def _end_line(self) -> bool:
        """Close the current line; True when it was the blank line that ends the head."""
        start = bytes(self._start[:_KEPT_NAME])
        blank = self._line <= 2 and start in (b"\r\n", b"\n")
        self._line = 0
        self._start.clear()
        if blank:
            # A blank line before the request line is tolerated (RFC 9112, 2.2).
            return self._lines > 0
        if self._lines == 0:
            self._request_line = self._request_line.rstrip(b"\r\n")
        elif start.lower().startswith(_ANTHROPIC_VERSION):
            self.anthropic_version = True
        self._lines += 1
        return False

    def _line_error(self) -> ApiError:
        limit = self.limits.max_line_bytes
        if self._lines == 0:
            return ApiError(
                f"the request line is longer than {limit} bytes", kind=ErrorKind.URI_TOO_LONG
            )
        return ApiError(
            f"a request header line is longer than {limit} bytes",
            kind=ErrorKind.HEADERS_TOO_LARGE,
        )
