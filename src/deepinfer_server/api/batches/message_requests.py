"""A Message Batches create request's body (`{"requests": [{custom_id, params}, ...]}`) read
into lines one request at a time, in the worker thread that calls `body_lines`.

The body may be as large as --batch-max-file-mb. Decoding it whole would hold the interpreter
for the whole decode (orjson never lets it go), stalling the event loop's thread, and would
build every request before they are counted. Instead the body is walked value by value: the
standard library's scanner finds where each value ends, orjson parses it (the same values
and refusals as `decode_json`: no NaN, no lone surrogate, the same depth limit), and the
requests are counted as they come, the first past --batch-max-lines refused before it is
parsed. Errors are found in the body's order: a request's, or the limit, before anything
after it. A body that is not an object is decoded whole, as any other request body.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from typing import Any

import orjson

from deepinfer_server.api.batches.input_file import decode_utf8
from deepinfer_server.errors import BadRequestError
from deepinfer_server.protocol.core.validation import MAX_JSON_DEPTH, check_depth, decode_json
from deepinfer_server.store.batches import NewLine

#: Anthropic's form of a `custom_id`.
_CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
#: JSON's white space.
_SPACE = re.compile(r"[ \t\n\r]*")
#: Finds where a value ends (what it builds is dropped: orjson parses the value).
_SCANNER = json.JSONDecoder()
#: Requests read between two moments the reading thread lets the event loop's thread run.
_YIELD_EVERY = 64


def body_lines(raw: bytes, limit: int) -> list[NewLine]:
    """A create request's body `raw` as lines: 400 for a body that is not valid JSON or not
    `{"requests": [...]}`, for more than `limit` requests, or for a request `request_line`
    refuses."""
    text = decode_utf8(raw)
    if text is None:
        return read_requests(decode_json(raw), limit)  # decode_json's 400 for it
    start = _SPACE.match(text).end()  # type: ignore[union-attr]
    if not text.startswith("{", start):
        return read_requests(decode_json(raw), limit)
    return _BodyReader(text, limit).read(start)


def read_requests(body: Mapping[str, Any], limit: int) -> list[NewLine]:
    """A decoded body's `requests` as lines (the checks of `body_lines`)."""
    requests = _checked(body)
    if len(requests) > limit:
        raise too_many(limit)
    seen: set[str] = set()
    return [request_line(index, request, seen) for index, request in enumerate(requests)]


def _checked(body: Mapping[str, Any]) -> list[Any]:
    """The body's `requests`: 400 unless a non-empty array, or for another field."""
    requests = body.get("requests")
    if not isinstance(requests, list) or not requests:
        raise BadRequestError("'requests' must be a non-empty array", param="requests")
    extra = sorted(set(body) - {"requests"})
    if extra:
        raise BadRequestError(f"{extra[0]}: Extra inputs are not permitted", param=extra[0])
    return requests


def too_many(limit: int) -> BadRequestError:
    """The 400 of a body of more than `limit` requests."""
    return BadRequestError(
        f"more than {limit} requests; a batch has at most {limit} (--batch-max-lines)",
        param="requests",
    )


def request_line(index: int, request: Any, seen: set[str]) -> NewLine:
    """The `index`th request as a line (400 for one without a well-formed `custom_id` unique
    in `seen`, or without `params`: its results could not be told apart). The `params` are
    checked when the request runs; a bad one is an `errored` result."""
    where = f"requests.{index}"
    if not isinstance(request, dict):
        raise BadRequestError(f"{where}: must be an object", param=where)
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not _CUSTOM_ID.fullmatch(custom_id):
        raise BadRequestError(
            f"{where}.custom_id: 1 to 64 letters, digits, '-' or '_'",
            param=f"{where}.custom_id",
        )
    if custom_id in seen:
        raise BadRequestError(
            f"{where}.custom_id: {custom_id!r} is used by an earlier request",
            param=f"{where}.custom_id",
        )
    seen.add(custom_id)
    params = request.get("params")
    if not isinstance(params, dict):
        raise BadRequestError(f"{where}.params: must be an object", param=f"{where}.params")
    return NewLine(custom_id, params)


class _BodyReader:
    """A body that starts as an object, walked value by value (module docstring)."""

    def __init__(self, text: str, limit: int) -> None:
        self.text = text
        self.limit = limit

    def read(self, start: int) -> list[NewLine]:
        """The lines of the object at `start`."""
        body: dict[str, Any] = {}
        lines: list[NewLine] | None = None
        pos = self._space(start + 1)
        if self.text.startswith("}", pos):
            pos += 1
        else:
            while True:
                key, pos = self._value(self._space(pos), 1)
                if not isinstance(key, str):
                    raise self._invalid("key must be a string", pos)
                pos = self._expect(":", self._space(pos))
                pos = self._space(pos)
                if key == "requests" and self.text.startswith("[", pos):
                    lines, pos = self._requests(pos)
                    body[key] = lines
                else:
                    body[key], pos = self._value(pos, 1)
                pos = self._space(pos)
                if not self.text.startswith(",", pos):
                    pos = self._expect("}", pos)
                    break
                pos = self._space(pos + 1)
        if self._space(pos) != len(self.text):
            raise self._invalid("trailing characters", self._space(pos))
        _checked(body)
        assert lines is not None  # `_checked` took `requests` as a non-empty array
        return lines

    def _requests(self, pos: int) -> tuple[list[NewLine], int]:
        """The lines of the `requests` array at `pos`, and where it ends."""
        lines: list[NewLine] = []
        seen: set[str] = set()
        pos = self._space(pos + 1)
        if self.text.startswith("]", pos):
            return lines, pos + 1
        while True:
            if len(lines) == self.limit:
                raise too_many(self.limit)
            if not len(lines) % _YIELD_EVERY:
                time.sleep(0)  # lets the loop's thread take the interpreter
            request, pos = self._value(pos, 2)
            lines.append(request_line(len(lines), request, seen))
            pos = self._space(pos)
            if not self.text.startswith(",", pos):
                return lines, self._expect("]", pos)
            pos = self._space(pos + 1)

    def _value(self, pos: int, depth: int) -> tuple[Any, int]:
        """The value at `pos` (nested `depth` levels in the body), and where it ends."""
        try:
            _, end = _SCANNER.raw_decode(self.text, pos)
        except json.JSONDecodeError as error:
            raise self._invalid(error.msg, error.pos) from None
        except RecursionError:
            raise self._invalid("depth limit exceeded", pos) from None
        try:
            value = orjson.loads(self.text[pos:end])
        except orjson.JSONDecodeError as error:
            raise self._invalid(error.msg, pos + error.pos) from None
        try:
            check_depth(value, MAX_JSON_DEPTH - depth)
        except BadRequestError:
            raise _too_deep() from None
        return value, end

    def _space(self, pos: int) -> int:
        return _SPACE.match(self.text, pos).end()  # type: ignore[union-attr]

    def _expect(self, what: str, pos: int) -> int:
        if not self.text.startswith(what, pos):
            raise self._invalid(f"expected {what!r}", pos)
        return pos + 1

    def _invalid(self, message: str, pos: int) -> BadRequestError:
        """`decode_json`'s 400 for a body that is not valid JSON, at `pos`."""
        where = json.JSONDecodeError(message, self.text, pos)
        return BadRequestError(f"the request body is not valid JSON: {where}")


def _too_deep() -> BadRequestError:
    return BadRequestError(
        f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep"
    )
