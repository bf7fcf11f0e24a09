"""Responses reasoning items: summaries, `encrypted_content` out, sealed reasoning back in.

deepseek-recipe reports reasoning as `reasoning_text` content only. When the request asks
`reasoning.summary` ("auto", "concise", "detailed"), the item's `summary` carries the reasoning
text too (the model writes no separate summary), streamed as the `reasoning_summary_*` events
clients such as Codex and the AI SDK show. When the request includes
`reasoning.encrypted_content`, the finished item carries the reasoning sealed by the server's
`ReasoningSeal`; otherwise `encrypted_content` is null. On the way in, a replayed reasoning item
whose blob verifies gets that reasoning as its content, which the recipe renders where the V4.1
encoding keeps prior reasoning (the current turn's reasoning before its tool calls).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from deepinfer_server.protocol.reasoning_seal import ReasoningSeal

logger = logging.getLogger(__name__)

ENCRYPTED_CONTENT = "reasoning.encrypted_content"
_SUMMARY_SETTINGS = frozenset({"auto", "concise", "detailed"})
#: Events that carry whole output items or the whole response, and so reasoning items.
_ITEM_EVENTS = frozenset({"response.output_item.added", "response.output_item.done"})
_RESPONSE_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


@dataclass(frozen=True)
class ReasoningRequest:
    """What the request asks of its reasoning items."""

    summary: bool = False
    encrypted: bool = False

    @classmethod
    def of(cls, body: dict[str, Any]) -> ReasoningRequest:
        reasoning = body.get("reasoning")
        summary = isinstance(reasoning, dict) and reasoning.get("summary") in _SUMMARY_SETTINGS
        include = body.get("include")
        encrypted = isinstance(include, list) and ENCRYPTED_CONTENT in include
        return cls(summary=summary, encrypted=encrypted)


def _restored(item: dict[str, Any], seal: ReasoningSeal) -> dict[str, Any]:
    blob = item.get("encrypted_content")
    plain = {key: value for key, value in item.items() if key != "encrypted_content"}
    if blob is None:
        return plain
    text = seal.open(blob)
    if text is None:
        logger.warning("a replayed reasoning item's encrypted_content does not verify: ignored")
        return plain
    return {**plain, "content": [{"type": "reasoning_text", "text": text}]}


def restore_reasoning(body: dict[str, Any], seal: ReasoningSeal) -> dict[str, Any]:
    """The body with each replayed reasoning item's sealed reasoning as its content.

    A blob this server did not seal is ignored (logged): the item keeps the content it came with.
    """
    items = body.get("input")
    if not isinstance(items, list):
        return body
    restored = [
        _restored(item, seal)
        if isinstance(item, dict) and item.get("type") == "reasoning"
        else item
        for item in items
    ]
    return {**body, "input": restored}


def _reasoning_text(item: dict[str, Any]) -> str:
    parts = item.get("content") or []
    return "".join(p.get("text", "") for p in parts if p.get("type") == "reasoning_text")


class ReasoningItems:
    """Rewrites one response's reasoning items (events or the whole body) as asked."""

    def __init__(self, asked: ReasoningRequest, seal: ReasoningSeal) -> None:
        self._asked = asked
        self._seal = seal
        self._inserted = 0  # events added so far: later sequence numbers shift by this much

    def _finished_item(self, item: dict[str, Any]) -> dict[str, Any]:
        if item.get("type") != "reasoning":
            return item
        text = _reasoning_text(item)
        item = dict(item)
        if self._asked.summary and text:
            item["summary"] = [{"type": "summary_text", "text": text}]
        item["encrypted_content"] = self._seal.seal(text) if self._asked.encrypted else None
        return item

    def response(self, response: dict[str, Any]) -> dict[str, Any]:
        """A response object with its reasoning items finished."""
        output = response.get("output")
        if not isinstance(output, list):
            return response
        return {**response, "output": [self._finished_item(item) for item in output]}

    def wants_event(self, name: str | None) -> bool:
        """Whether the event must be rewritten (every event, once sequence numbers shift)."""
        return self._asked.summary or name in _ITEM_EVENTS or name in _RESPONSE_EVENTS

    def event(self, name: str, event: dict[str, Any]) -> list[dict[str, Any]]:
        """The events that replace one stream event."""
        events = [event]
        if name == "response.output_item.added" and event["item"].get("type") == "reasoning":
            event["item"] = {**event["item"], "encrypted_content": None}
        elif name == "response.output_item.done":
            event["item"] = self._finished_item(event["item"])
            if self._asked.summary:
                events = [*self._summary_events(event), event]
        elif name in _RESPONSE_EVENTS:
            event["response"] = self.response(event["response"])
        first = event["sequence_number"] + self._inserted
        self._inserted += len(events) - 1
        for offset, each in enumerate(events):
            each["sequence_number"] = first + offset
        return events

    @staticmethod
    def _summary_events(done: dict[str, Any]) -> list[dict[str, Any]]:
        item = done["item"]
        if item.get("type") != "reasoning" or not item.get("summary"):
            return []
        text = item["summary"][0]["text"]
        where = {"item_id": item["id"], "output_index": done["output_index"], "summary_index": 0}
        return [
            {
                "type": "response.reasoning_summary_part.added",
                **where,
                "part": {"type": "summary_text", "text": ""},
            },
            {"type": "response.reasoning_summary_text.delta", **where, "delta": text},
            {"type": "response.reasoning_summary_text.done", **where, "text": text},
            {
                "type": "response.reasoning_summary_part.done",
                **where,
                "part": {"type": "summary_text", "text": text},
            },
        ]
