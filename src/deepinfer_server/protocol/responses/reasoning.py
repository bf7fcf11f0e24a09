"""Responses reasoning items: summaries, `encrypted_content` out, sealed reasoning back in.

deepseek-recipe reports reasoning as `reasoning_text` content only. When the request asks
`reasoning.summary` ("auto", "concise", "detailed"), the item's `summary` carries the reasoning
text too (the model writes no separate summary), streamed as the `reasoning_summary_*` events
clients such as Codex and the AI SDK show. When the request includes
`reasoning.encrypted_content`, the finished item carries the reasoning sealed by the server's
`ReasoningSeal`, bound to the conversation before it (`ConversationDigest`: the request's input
and the response's earlier output items); otherwise `encrypted_content` is null.

On the way in, reasoning reaches the prompt only from a blob that verifies after the items
that precede it in `input`: that item gets the sealed reasoning as its content, which the recipe
renders where the V4.1 encoding keeps prior reasoning (the current turn's reasoning before its
tool calls). Any other reasoning item (no blob, or one that does not verify) keeps no text: its
`content` and `summary` are dropped, so a client cannot place its own text in the reasoning.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import orjson

from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.reasoning_seal import ReasoningSeal

logger = logging.getLogger(__name__)

ENCRYPTED_CONTENT = "reasoning.encrypted_content"
_SUMMARY_SETTINGS = frozenset({"auto", "concise", "detailed"})
#: Events that carry whole output items or the whole response, and so reasoning items.
_ITEM_EVENTS = frozenset({"response.output_item.added", "response.output_item.done"})
_RESPONSE_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


#: The digest of an empty conversation.
CONVERSATION_START = hashlib.sha256(b"deepinfer-server conversation v1").digest()
#: Part fields whose text identifies a content part (text, refusals, image and file references).
_PART_TEXT = ("text", "refusal", "image_url", "file_id", "file_url")
_ITEM_STRINGS = ("role", "call_id", "name", "arguments", "input")


def _text_of(value: Any) -> str:
    """The text a `content` or `output` holds: the string, or its parts' texts."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        return ""
    texts: list[str] = []
    for part in value:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict):
            texts.extend(part[key] for key in _PART_TEXT if isinstance(part.get(key), str))
    return "\x1f".join(texts)


def _canonical(item: Any) -> bytes:
    """What of an input item the seal binds: its kind, role, call fields and text, in a form
    that survives clients re-serialising the item (ids, statuses and part types left out).
    A reasoning item counts by its blob, which stands for its reasoning."""
    if isinstance(item, str):
        item = {"role": "user", "content": item}
    if not isinstance(item, dict):
        return b"null"
    kind = item.get("type") or "message"
    if kind == "reasoning":
        blob = item.get("encrypted_content")
        return orjson.dumps([kind, blob if isinstance(blob, str) else ""])
    strings = [item.get(key) for key in _ITEM_STRINGS]
    return orjson.dumps(
        [
            kind,
            *[value if isinstance(value, str) else "" for value in strings],
            _text_of(item.get("content")),
            _text_of(item.get("output")),
        ]
    )


class ConversationDigest:
    """A running digest of a Responses conversation, item by item: what a reasoning item is
    sealed after and verified against."""

    def __init__(self, digest: bytes = CONVERSATION_START) -> None:
        self.digest = digest

    def add(self, item: Any) -> None:
        self.digest = hashlib.sha256(self.digest + _canonical(item)).digest()


def conversation_digest(items: list[Any] | str | None) -> bytes:
    """The digest a reasoning item written after `items` (a Responses `input`, and any output
    items before it) is sealed with."""
    conversation = ConversationDigest()
    for item in items if isinstance(items, list) else [items]:
        conversation.add(item)
    return conversation.digest


@dataclass(frozen=True)
class ReasoningRequest:
    """What the request asks of its reasoning items, and the conversation they follow."""

    summary: bool = False
    encrypted: bool = False
    #: The digest of the request's whole `input` (`restore_reasoning`).
    conversation: bytes = field(default=CONVERSATION_START, repr=False)

    @classmethod
    def of(cls, body: JsonObject, conversation: bytes = CONVERSATION_START) -> ReasoningRequest:
        reasoning = body.get("reasoning")
        summary = isinstance(reasoning, dict) and reasoning.get("summary") in _SUMMARY_SETTINGS
        include = body.get("include")
        encrypted = isinstance(include, list) and ENCRYPTED_CONTENT in include
        return cls(summary=summary, encrypted=encrypted, conversation=conversation)


def _restored(item: JsonObject, seal: ReasoningSeal, context: bytes) -> JsonObject:
    blob = item.get("encrypted_content")
    plain = {k: v for k, v in item.items() if k not in ("encrypted_content", "content")}
    if "summary" in plain:
        plain["summary"] = []
    text = None if blob is None else seal.open(blob, context)
    if text is None:
        if blob is not None:
            logger.warning(
                "a replayed reasoning item's encrypted_content does not verify for this "
                "conversation: its reasoning is ignored"
            )
        return plain
    return {**plain, "content": [{"type": "reasoning_text", "text": text}]}


def restore_reasoning(body: JsonObject, seal: ReasoningSeal) -> tuple[JsonObject, bytes]:
    """The body with each replayed reasoning item's text taken from its blob only (verified
    against the items before it; no text when it does not verify), and the digest of the
    whole input, which this request's own reasoning is sealed after."""
    items = body.get("input")
    conversation = ConversationDigest()
    if not isinstance(items, list):
        conversation.add(items)
        return body, conversation.digest
    restored = []
    for item in items:
        if isinstance(item, dict) and item.get("type") == "reasoning":
            restored.append(_restored(item, seal, conversation.digest))
        else:
            restored.append(item)
        conversation.add(item)
    return {**body, "input": restored}, conversation.digest


def reasoning_text(item: JsonObject) -> str:
    """The text of a reasoning item's `reasoning_text` parts."""
    parts = item.get("content") or []
    return "".join(p.get("text", "") for p in parts if p.get("type") == "reasoning_text")


class ReasoningItems:
    """Rewrites one response's reasoning items (events or the whole body) as asked."""

    def __init__(self, asked: ReasoningRequest, seal: ReasoningSeal) -> None:
        self._asked = asked
        self._seal = seal
        self._inserted = 0  # events added so far: later sequence numbers shift by this much
        #: The conversation up to the next output item of the stream.
        self._streamed = ConversationDigest(asked.conversation)

    def _finished_item(self, item: JsonObject, conversation: ConversationDigest) -> JsonObject:
        """The item as sent (reasoning sealed after `conversation`), which it then joins."""
        if item.get("type") == "reasoning":
            text = reasoning_text(item)
            item = dict(item)
            if self._asked.summary and text:
                item["summary"] = [{"type": "summary_text", "text": text}]
            item["encrypted_content"] = (
                self._seal.seal(text, conversation.digest) if self._asked.encrypted else None
            )
        conversation.add(item)
        return item

    def response(self, response: JsonObject) -> JsonObject:
        """A response object with its reasoning items finished."""
        output = response.get("output")
        if not isinstance(output, list):
            return response
        conversation = ConversationDigest(self._asked.conversation)
        return {**response, "output": [self._finished_item(i, conversation) for i in output]}

    def wants_event(self, name: str | None) -> bool:
        """Whether the event must be rewritten (every event, once sequence numbers shift)."""
        return self._asked.summary or name in _ITEM_EVENTS or name in _RESPONSE_EVENTS

    def event(self, name: str | None, event: JsonObject) -> list[JsonObject]:
        """The events that replace one stream event."""
        events = [event]
        if name == "response.output_item.added" and event["item"].get("type") == "reasoning":
            event["item"] = {**event["item"], "encrypted_content": None}
        elif name == "response.output_item.done":
            event["item"] = self._finished_item(event["item"], self._streamed)
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
    def _summary_events(done: JsonObject) -> list[JsonObject]:
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
