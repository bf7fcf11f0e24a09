"""A batch input file read a chunk at a time (`api/batches/input_file.py`): the same lines as
`str.splitlines` of the whole file whatever the chunks' ends, malformed lines kept with their
errors and line numbers, and the reading stopped once the file has more requests than allowed."""

from __future__ import annotations

import random

import orjson
import pytest

from deepinfer_server.api.batches.input_file import (
    InputLines,
    LineSplitter,
    TooManyLines,
    decode_utf8,
    input_lines,
)
from deepinfer_server.errors import BadRequestError
from deepinfer_server.store.batches import NewLine

CHAT = "/v1/chat/completions"
#: Every line break `str.splitlines` knows, `\r\n` among them, blank lines and no final break.
TRICKY = "a\r\nb\rc\n\nd\x0be\x0cf\x1cg\x1dh\x1ei\x85j\u2028k\u2029l\r\r\n\n\r\nlast"


def _line(custom_id: str, url: str = CHAT) -> str:
    body = {"model": "m", "messages": []}
    return orjson.dumps(
        {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
    ).decode()


@pytest.mark.parametrize("size", [1, 2, 3, 5, len(TRICKY)])
def test_the_lines_of_chunks_are_the_lines_of_the_whole_text(size: int) -> None:
    for text in (TRICKY, TRICKY + "\r", TRICKY + "\n", "", "\r\n\n", "\r\r\n\r", "x" * 50):
        splitter = LineSplitter()
        lines = []
        for start in range(0, len(text), size):
            lines += splitter.feed(text[start : start + size])
        lines += splitter.finish()
        assert lines == text.splitlines()


def test_random_texts_in_random_chunks_split_as_the_whole_does() -> None:
    chance = random.Random(7)
    for _ in range(2000):
        text = "".join(chance.choice("ab\r\n\x0b\u2028 ") for _ in range(chance.randint(0, 30)))
        splitter = LineSplitter()
        lines: list[str] = []
        start = 0
        while start < len(text):
            size = chance.randint(0, 5)
            lines += splitter.feed(text[start : start + size])
            start += size
        lines += splitter.finish()
        assert lines == text.splitlines(), repr(text)


def test_malformed_lines_are_kept_with_their_errors_and_line_numbers() -> None:
    reader = InputLines(CHAT, 10)
    text = "\n".join(
        [_line("ok"), "{not json", "", "[1]", _line("ok"), _line("elsewhere", "/v1/completions")]
    )
    reader.feed(text[:17])
    reader.feed(text[17:])
    lines = reader.finish()
    assert [line.custom_id for line in lines] == ["ok", "line-2", "line-4", "ok", "elsewhere"]
    assert lines[0] == NewLine("ok", {"model": "m", "messages": []})
    errors = [line.result["error"]["message"] for line in lines[1:] if line.result]
    assert errors == [
        "line 2: not valid JSON",
        "line 4: not a JSON object",
        "line 5: this `custom_id` is used by an earlier line",
        "line 6: `url` must be the batch's endpoint '/v1/chat/completions'",
    ]
    assert all(line.status == "errored" and line.body is None for line in lines[1:])


def test_a_chunk_past_the_limit_is_refused_before_any_of_its_lines_is_read() -> None:
    reader = InputLines(CHAT, 3)
    reader.feed("x\n \n\t\nx\n\nx\n")  # blank lines are not requests
    assert len(reader.lines) == 3
    reader.feed("\n  \n")
    with pytest.raises(TooManyLines):
        reader.feed("\n" + "never read\n" * 100_000)
    assert len(reader.lines) == 3


def test_the_last_line_without_a_break_counts_against_the_limit() -> None:
    reader = InputLines(CHAT, 2)
    reader.feed("x\ny\nz")
    assert len(reader.lines) == 2
    with pytest.raises(TooManyLines):
        reader.finish()


def test_a_file_past_the_limit_is_a_400_without_its_later_chunks_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("deepinfer_server.api.batches.input_file.CHUNK_CHARS", 8)
    fed: list[str] = []
    feed = InputLines.feed

    def counted(self: InputLines, chunk: str) -> None:
        fed.append(chunk)
        feed(self, chunk)

    monkeypatch.setattr(InputLines, "feed", counted)
    with pytest.raises(BadRequestError) as refused:
        input_lines("x\n" * 1000, CHAT, 5)
    assert refused.value.param == "input_file_id"
    assert refused.value.message == (
        "the input file has more than 5 requests; a batch has at most 5 (--batch-max-lines)"
    )
    assert fed == ["x\nx\nx\nx\n"] * 2  # 4 lines a chunk: the second passes the limit


def test_a_file_is_read_whole_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("deepinfer_server.api.batches.input_file.CHUNK_CHARS", 7)
    content = "\r\n".join(_line(f"n{i}") for i in range(4))
    lines = input_lines(content, CHAT, 4)
    assert [line.custom_id for line in lines] == ["n0", "n1", "n2", "n3"]
    assert input_lines("", CHAT, 4) == []
    assert input_lines("\n \n", CHAT, 4) == []


def test_utf8_is_decoded_in_parts_whatever_their_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("deepinfer_server.api.batches.input_file._DECODED_BYTES", 3)
    text = "aé🙂\u2028b" * 5
    assert decode_utf8(text.encode()) == text
    assert decode_utf8(b"") == ""
    for bad in (b"\xff", "é".encode()[:1], b"ab\xed\xa0\x80"):
        assert decode_utf8(bad) is None
