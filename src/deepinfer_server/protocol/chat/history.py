"""Chat Completions history that deepseek-recipe refuses but OpenAI-compatible servers accept.

Some clients split one assistant turn over consecutive assistant messages (Codex 0.80 on the
chat wire sends the tool call, then the text, then the tool result). The recipe requires tool
results right after the message with the calls; vLLM tolerates the split. Consecutive assistant
messages are merged into one: contents joined in order, tool calls and reasoning concatenated.
`developer` messages become `system` messages, as OpenAI treats them for these models.
"""

from __future__ import annotations

from typing import Any

from deepinfer_server.protocol.core.json_types import JsonObject


def _parts(content: Any) -> list[Any]:
    if content is None or content == "":
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content) if isinstance(content, list) else [content]


def _merged_content(contents: list[Any]) -> Any:
    present = [c for c in contents if c is not None and c != "" and c != []]
    if not present:
        return contents[0]
    if all(isinstance(c, str) for c in present):
        return "\n".join(present)
    return [part for c in present for part in _parts(c)]


def _merge(run: list[JsonObject]) -> JsonObject:
    merged = {k: v for m in run for k, v in m.items()}  # later scalar fields win (e.g. prefix)
    merged["content"] = _merged_content([m.get("content") for m in run])
    calls = [call for m in run for call in (m.get("tool_calls") or [])]
    merged.pop("tool_calls", None)
    if calls:
        merged["tool_calls"] = calls
    reasoning = [m["reasoning_content"] for m in run if m.get("reasoning_content")]
    merged.pop("reasoning_content", None)
    if reasoning:
        merged["reasoning_content"] = "\n".join(reasoning)
    return merged


def merge_assistant_runs(messages: list[Any]) -> list[Any]:
    """The messages with each run of consecutive assistant messages merged into one.

    The messages must have passed `check_chat_fields`, which checks that each assistant
    `reasoning_content` the merge joins is a string and its `tool_calls` an array."""
    merged: list[Any] = []
    run: list[JsonObject] = []
    for message in [*messages, None]:
        if isinstance(message, dict) and message.get("role") == "assistant":
            run.append(message)
            continue
        if run:
            merged.append(run[0] if len(run) == 1 else _merge(run))
            run = []
        if message is not None:
            merged.append(message)
    return merged


def recipe_messages(messages: list[Any]) -> list[Any]:
    """The checked messages as deepseek-recipe takes them: developer messages as system
    messages and assistant runs merged; new lists and dicts, the client's left as sent."""
    renamed = [
        {**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
        for m in messages
    ]
    return merge_assistant_runs(renamed)
