"""A batch input file read into its requests a chunk at a time, in a worker thread.

The file's content (as the store keeps it: at most --batch-max-file-mb) is split into lines
and parsed `CHUNK_CHARS` characters at a time, and the reading stops as soon as the file has
more requests than a batch may (`--batch-max-lines`). Besides the content, what is held is
one chunk's lines, the line that spans two chunks, and the requests kept, which the limit
bounds: never every line of the file. A chunk's lines are counted before they are parsed, so
a file of millions of short lines is refused at its first chunk, without growing the process
by the size of its parsed lines; while a chunk is parsed, the thread lets the loop's thread
run every `_YIELD_EVERY` requests.

(The content is read from the store whole: a part of a value read by `substr` costs the
database the whole value on SQLite and PostgreSQL alike, so reading it in parts took time
quadratic in its size.)
"""

from __future__ import annotations

import codecs
import time

import orjson

from deepinfer_server.errors import BadRequestError
from deepinfer_server.store.batches import NewLine

#: Characters of the file split and parsed at a time.
CHUNK_CHARS = 256 * 1024
#: Bytes decoded from UTF-8 at a time.
_DECODED_BYTES = 1024 * 1024
#: Requests parsed between two moments the parsing thread lets the event loop's thread take
#: the interpreter: without them the loop waits for it a switch interval at every step.
_YIELD_EVERY = 64


def decode_utf8(data: bytes) -> str | None:
    """`data` decoded from UTF-8 a part at a time, or None when it is not UTF-8: called in a
    worker thread (an upload, a Message Batches body), which lets the event loop's thread run
    between parts, where decoding it in one call would hold the interpreter for all of it."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(data)
    parts: list[str] = []
    try:
        for start in range(0, len(data), _DECODED_BYTES):
            parts.append(decoder.decode(view[start : start + _DECODED_BYTES]))
        parts.append(decoder.decode(b"", final=True))
    except UnicodeDecodeError:
        return None
    return "".join(parts)


class LineSplitter:
    """`str.splitlines` over a text given in chunks: the same lines, whatever the chunks' ends
    (a line cut in two or in many, a `\r\n` cut between its two characters). A line longer
    than a chunk is kept in pieces, joined once it ends, never copied at every chunk."""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._after_cr = False

    def feed(self, chunk: str) -> list[str]:
        """The lines that `chunk` completes, without their line breaks."""
        if self._after_cr and chunk.startswith("\n"):
            chunk = chunk[1:]  # the second half of a `\r\n` the last chunk ended with
            self._after_cr = False
        if not chunk:
            return []
        self._after_cr = chunk.endswith("\r")
        lines = chunk.splitlines()
        if len(lines) == 1 and len(lines[0]) == len(chunk):
            self._pieces.append(chunk)  # no line break in it
            return []
        if self._pieces:
            lines[0] = "".join(self._pieces) + lines[0]
            self._pieces = []
        if chunk[-1] not in _BREAKS:
            self._pieces.append(lines.pop())
        return lines

    def finish(self) -> list[str]:
        """The last line, when the text does not end with a line break."""
        last, self._pieces = "".join(self._pieces), []
        return [last] if last else []


#: The characters `str.splitlines` ends a line at (`\r\n` is one break of two).
_BREAKS = frozenset("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")


class TooManyLines(Exception):
    """The file has more requests than a batch may."""


class InputLines:
    """A batch input file's requests, one per non-empty line, as they are read; a malformed line
    (not a JSON object, no string `custom_id`, one already used, `method` not POST, `url` not
    the batch's endpoint, `body` not an object) is kept with its error, for the error file."""

    def __init__(self, endpoint: str, limit: int) -> None:
        self.endpoint = endpoint
        self.limit = limit
        self.lines: list[NewLine] = []
        self._splitter = LineSplitter()
        self._seen: set[str] = set()
        self._number = 0

    def feed(self, chunk: str) -> None:
        """Read the lines `chunk` completes; TooManyLines past the limit."""
        self._read(self._splitter.feed(chunk))

    def finish(self) -> list[NewLine]:
        """Read the last line; every request read (TooManyLines past the limit)."""
        self._read(self._splitter.finish())
        return self.lines

    def _read(self, texts: list[str]) -> None:
        # Counted before any is parsed: a chunk that passes the limit is refused unread (the
        # blank lines counted exactly only when the quick count, less empty lines, passes it).
        kept = len(self.lines)
        if kept + len(texts) - texts.count("") > self.limit and (
            kept + sum(1 for text in texts if text.strip()) > self.limit
        ):
            raise TooManyLines
        for text in texts:
            self._number += 1
            if not text.strip():
                continue
            if not len(self.lines) % _YIELD_EVERY:
                time.sleep(0)
            self.lines.append(self._line(self._number, text))

    def _line(self, number: int, text: str) -> NewLine:
        try:
            record = orjson.loads(text)
        except orjson.JSONDecodeError:
            return _malformed(number, None, "not valid JSON")
        if not isinstance(record, dict):
            return _malformed(number, None, "not a JSON object")
        custom_id = record.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            return _malformed(number, None, "`custom_id` must be a non-empty string")
        if custom_id in self._seen:
            return _malformed(number, custom_id, "this `custom_id` is used by an earlier line")
        self._seen.add(custom_id)
        if record.get("method") != "POST":
            return _malformed(number, custom_id, "`method` must be 'POST'")
        if record.get("url") != self.endpoint:
            message = f"`url` must be the batch's endpoint {self.endpoint!r}"
            return _malformed(number, custom_id, message)
        if not isinstance(record.get("body"), dict):
            return _malformed(number, custom_id, "`body` must be a JSON object")
        return NewLine(custom_id, record["body"])


def _malformed(number: int, custom_id: str | None, message: str) -> NewLine:
    return NewLine(
        custom_id if custom_id is not None else f"line-{number}",
        None,
        "errored",
        {"error": {"code": "invalid_request", "message": f"line {number}: {message}"}},
    )


def input_lines(content: str, endpoint: str, limit: int) -> list[NewLine]:
    """The requests of an input file's `content` for a batch calling `endpoint`, read a chunk
    at a time where it is called (a worker thread); a 400 naming `--batch-max-lines` once it
    has more than `limit` requests."""
    lines = InputLines(endpoint, limit)
    try:
        for start in range(0, len(content), CHUNK_CHARS):
            lines.feed(content[start : start + CHUNK_CHARS])
        return lines.finish()
    except TooManyLines:
        raise BadRequestError(
            f"the input file has more than {limit} requests; a batch has at most {limit} "
            "(--batch-max-lines)",
            param="input_file_id",
        ) from None
