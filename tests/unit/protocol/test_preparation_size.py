"""preparation_size: a JSON value's size estimated, the walk stopped once past the bound."""

from __future__ import annotations

import orjson

from deepinfer_server.protocol.core.preparation_size import IMAGE_COST, preparation_size


def test_the_estimate_is_close_to_the_json_size() -> None:
    items = [
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "hé " * 50}],
        },
        {"type": "function_call", "call_id": "c1", "arguments": '{"a": 1}', "n": 3, "ok": True},
    ]
    exact = len(orjson.dumps(items))
    estimate = preparation_size(items, 1 << 20)
    assert exact <= estimate <= exact * 1.5


def test_a_large_string_counts_whole_and_the_walk_stops_past_the_bound() -> None:
    big = "word " * 100_000
    assert len(big) < preparation_size([{"content": big}], 64 * 1024) < len(big) + 100
    many = [{"content": "x"} for _ in range(100_000)]  # about 1.6 MB as JSON
    full = preparation_size(many, 1 << 30)
    assert full > len(orjson.dumps(many))
    assert 64 * 1024 < preparation_size(many, 64 * 1024) < full // 8  # the rest never walked
    assert preparation_size([], 10) == 2
    assert preparation_size(many, -1) == 0  # a bound already passed: nothing is walked


def test_an_image_counts_past_any_bound() -> None:
    part = {"type": "input_image", "image_url": "https://example.com/a.png"}
    assert preparation_size([{"content": [part]}], 1 << 20) >= IMAGE_COST
    assert preparation_size([{"content": "no image here"}], 1 << 20) < 100
