"""Server-sent events framing for the OpenAI streaming format."""

from __future__ import annotations

from collections.abc import Iterable

DONE_FRAME = b"data: [DONE]\n\n"


def data_frames(payloads: Iterable[str]) -> bytes:
    """`data: {json}\\n\\n` for each payload, as one write."""
    return b"".join(b"data: " + payload.encode() + b"\n\n" for payload in payloads)
