"""ReasoningSeal: blobs open only under the key that sealed them."""

from __future__ import annotations

import pytest

from deepinfer_server.protocol.reasoning_seal import ReasoningSeal


def test_round_trip_and_unicode() -> None:
    seal = ReasoningSeal.from_secret("s")
    for text in ("", "plain", "多语言 reasoning ✓\n<think>"):
        assert seal.open(seal.seal(text)) == text


@pytest.mark.parametrize("blob", ["", "!!!", "AAAA", None, 42, "A" * 200])
def test_junk_does_not_open(blob: object) -> None:
    assert ReasoningSeal.from_secret("s").open(blob) is None


def test_other_keys_and_altered_blobs_do_not_open() -> None:
    blob = ReasoningSeal.from_secret("s").seal("reasoning")
    assert ReasoningSeal.from_secret("t").open(blob) is None
    assert ReasoningSeal.from_secret(None).open(blob) is None  # a random key per process
    flipped = blob[:3] + ("B" if blob[3] != "B" else "C") + blob[4:]
    assert ReasoningSeal.from_secret("s").open(flipped) is None
    assert ReasoningSeal.from_secret("s").open(blob) == "reasoning"
