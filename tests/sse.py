"""Reading OpenAI-style SSE streams in tests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any] | str]:
    """Each `data:` payload of a stream: decoded JSON, or the string "[DONE]"."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[6:]
            yield payload if payload == "[DONE]" else json.loads(payload)
