"""Helpers for the agent-client tests: prompt text as the engine received it, stream events."""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from tokenizers import Tokenizer

from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from tests.http.harness import FakeCoordinator


@cache
def _tokenizer() -> Tokenizer:
    return Tokenizer.from_str(embedded_tokenizer_json())


def last_prompt(coordinator: FakeCoordinator) -> str:
    """The text of the last prompt submitted to the (fake) engine."""
    _, prompt_token_ids, _ = coordinator.submitted[-1]
    return str(_tokenizer().decode(prompt_token_ids, skip_special_tokens=False))


def events(text: str) -> list[dict[str, Any]]:
    """The JSON data of each message of an SSE stream."""
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
