"""ReasoningSeal: blobs open only under the key that sealed them, after the same conversation."""

from __future__ import annotations

import pytest

from deepinfer_server.protocol.core.reasoning_seal import ReasoningSeal
from deepinfer_server.protocol.responses.reasoning import conversation_digest

HERE = conversation_digest([{"role": "user", "content": "hi"}])


def test_round_trip_and_unicode() -> None:
    seal = ReasoningSeal.from_secret("s")
    for text in ("", "plain", "多语言 reasoning ✓\n<think>"):
        assert seal.open(seal.seal(text, HERE), HERE) == text


@pytest.mark.parametrize("blob", ["", "!!!", "AAAA", None, 42, "A" * 200])
def test_junk_does_not_open(blob: object) -> None:
    assert ReasoningSeal.from_secret("s").open(blob, HERE) is None


def test_other_keys_and_altered_blobs_do_not_open() -> None:
    blob = ReasoningSeal.from_secret("s").seal("reasoning", HERE)
    assert ReasoningSeal.from_secret("t").open(blob, HERE) is None
    assert ReasoningSeal.from_secret(None).open(blob, HERE) is None  # a random key
    flipped = blob[:3] + ("B" if blob[3] != "B" else "C") + blob[4:]
    assert ReasoningSeal.from_secret("s").open(flipped, HERE) is None
    assert ReasoningSeal.from_secret("s").open(blob, HERE) == "reasoning"


def test_a_blob_opens_only_after_the_conversation_it_was_sealed_after() -> None:
    seal = ReasoningSeal.from_secret("s")
    blob = seal.seal("reasoning", HERE)
    elsewhere = conversation_digest([{"role": "user", "content": "something else"}])
    assert seal.open(blob, elsewhere) is None
    # The same conversation as a client re-serialises it: typed parts, ids, statuses.
    same = conversation_digest(
        [
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "role": "user",
                "content": [{"type": "input_text", "text": "hi"}],
            }
        ]
    )
    assert seal.open(blob, same) == "reasoning"
    assert conversation_digest("hi") == HERE
