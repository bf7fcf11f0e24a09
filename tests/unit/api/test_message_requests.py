"""A Message Batches create request's body read one request at a time
(`api/batches/message_requests.py`): the same lines and the same refusals as the body decoded
whole (`decode_json`, then `read_requests`), the limit refused at the first request past it."""

from __future__ import annotations

import orjson
import pytest

from deepinfer_server.api.batches import message_requests
from deepinfer_server.api.batches.message_requests import body_lines, read_requests
from deepinfer_server.errors import BadRequestError
from deepinfer_server.protocol.core.validation import decode_json
from deepinfer_server.store.batches import NewLine

NOT_JSON = "the request body is not valid JSON: "


def _whole(raw: bytes, limit: int) -> list[NewLine]:
    return read_requests(decode_json(raw), limit)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


VALID = [
    b'{"requests":[{"custom_id":"a","params":{}}]}',
    b' \r\n{ "requests" : [ { "custom_id" : "a" , "params" : { "x" : [1, 2.5, null, true] } } ,'
    b'\t{"params": {"s": "\\u00e9\\n\\"\xc3\xa9\xf0\x9f\x99\x82"}, "custom_id": "b-2_"} ] } \n',
    b'{"requests":[{"custom_id":"a","params":{"deep":' + _nested(60).encode() + b"}}]}",
    b'{"requests":[{"custom_id":"a","params":{},"custom_id":"b"}]}',  # the last key wins
    b'{"requests":[{"custom_id":"a","params":{"x":123456789012345678901234567890}}]}',
]

REFUSED = [
    b"{}",
    b'{"requests":[]}',
    b'{"requests":{}}',
    b'{"requests":[{"custom_id":"a","params":{}}],"model":"m"}',
    b'{"requests":[{"custom_id":"a b","params":{}}]}',
    b'{"requests":[{"custom_id":"a","params":{}},{"custom_id":"a","params":{}}]}',
    b'{"requests":[{"custom_id":"a"}]}',
    b'{"requests":[1]}',
    b'[{"custom_id":"a","params":{}}]',
    b'{"requests":[{"custom_id":"a","params":{"deep":' + _nested(61).encode() + b"}}]}",
    b'{"requests":[{"custom_id":"a","params":{}}],"x":' + _nested(63).encode() + b"}",
    b'{"requests":[{"custom_id":"a","params":{}}],"x":' + _nested(64).encode() + b"}",
]

NOT_VALID = [
    b"",
    b"{",
    b'{"requests":[{"custom_id":"a","params":{}}]',
    b'{"requests":[{"custom_id":"a","params":{}},]}',
    b'{"requests":[{"custom_id":"a","params":{}}]}x',
    b'{"requests":[{"custom_id":"a","params":{"x":NaN}}]}',
    b'{"requests":[{"custom_id":"a","params":{"x":"\\ud800"}}]}',
    b'{"requests":[{"custom_id":"a","params":{}}] "x":1}',
    b'{"requests":' + _nested(2000).encode() + b"}",
    b"{requests:[]}",
    b'{"requests":[{"custom_id":"\xff","params":{}}]}',
]


@pytest.mark.parametrize("raw", VALID)
def test_a_body_read_a_request_at_a_time_gives_the_lines_of_the_whole(raw: bytes) -> None:
    assert body_lines(raw, 10) == _whole(raw, 10)


@pytest.mark.parametrize("raw", REFUSED)
def test_a_body_refused_whole_is_refused_alike(raw: bytes) -> None:
    with pytest.raises(BadRequestError) as whole:
        _whole(raw, 10)
    with pytest.raises(BadRequestError) as streamed:
        body_lines(raw, 10)
    assert streamed.value.message == whole.value.message
    assert streamed.value.param == whole.value.param


@pytest.mark.parametrize("raw", NOT_VALID)
def test_a_body_that_is_not_valid_json_is_refused_as_such(raw: bytes) -> None:
    with pytest.raises(BadRequestError, match=NOT_JSON):
        _whole(raw, 10)
    with pytest.raises(BadRequestError) as streamed:
        body_lines(raw, 10)
    assert streamed.value.message.startswith(NOT_JSON)


def test_the_first_request_past_the_limit_is_refused_unread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed: list[str] = []
    real = message_requests.request_line

    def counted(index: int, request: object, seen: set[str]) -> NewLine:
        parsed.append(str(index))
        return real(index, request, seen)

    monkeypatch.setattr(message_requests, "request_line", counted)
    requests = [{"custom_id": f"r{i}", "params": {}} for i in range(5)]
    raw = orjson.dumps({"requests": [*requests, "never read"]})
    with pytest.raises(BadRequestError) as refused:
        body_lines(raw, 5)
    assert refused.value.param == "requests"
    assert refused.value.message == (
        "more than 5 requests; a batch has at most 5 (--batch-max-lines)"
    )
    assert parsed == ["0", "1", "2", "3", "4"]
    assert len(body_lines(orjson.dumps({"requests": requests}), 5)) == 5
