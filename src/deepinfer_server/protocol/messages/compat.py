"""What Anthropic's API accepts and deepseek-recipe does not, made acceptable before conversion.

- Tools of type `custom` are Anthropic's ordinary client tools (LiteLLM's `anthropic/` route
  always sends the type): the type is dropped, leaving the plain tool definition.
- Anthropic's client-executed tools, `bash_*` and `text_editor_*`, are declared by type and
  name only; they become ordinary tools with the input schemas Anthropic documents for them.
  Real server tools (web search, code execution, ...) are left to the recipe, which rejects them.
- `redacted_thinking` blocks (history carried over from Anthropic's API) hold reasoning
  encrypted by Anthropic, unreadable here: they are dropped.
- Context overflow is reported in Anthropic's words, which Claude Code recognises and recovers
  from by retrying with a smaller `max_tokens`.
- Message threads (`thread`: the server keeps the conversation between turns) are not kept
  here: any `thread` is refused with the `error.details.error_code` on which the anthropic SDK
  (its tool runner threads by default) sends the whole conversation without one.
"""

from __future__ import annotations

from typing import Any

from deepinfer_server.errors import ContextLengthError, ErrorKind
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.validation import refuse_given

_BASH_SCHEMA: JsonObject = {
    "type": "object",
    "properties": {
        "command": {"type": "string", "description": "The bash command to run."},
        "restart": {"type": "boolean", "description": "Restart the bash session."},
    },
}

_TEXT_EDITOR_SCHEMA: JsonObject = {
    "type": "object",
    "properties": {
        "command": {
            "type": "string",
            "enum": ["view", "create", "str_replace", "insert", "undo_edit"],
            "description": "The operation to perform.",
        },
        "path": {"type": "string", "description": "Absolute path to the file or directory."},
        "file_text": {"type": "string", "description": "Content of the file to create."},
        "old_str": {"type": "string", "description": "The text to replace (exact match)."},
        "new_str": {"type": "string", "description": "The replacement or inserted text."},
        "insert_line": {"type": "integer", "description": "Insert after this line number."},
        "view_range": {
            "type": "array",
            "items": {"type": "integer"},
            "description": "The first and last line to view.",
        },
    },
    "required": ["command", "path"],
}

#: Type prefix of Anthropic's client-executed tools → (description, input schema).
_CLIENT_TOOLS: dict[str, tuple[str, JsonObject]] = {
    "bash_": ("Run a command in a persistent bash shell.", _BASH_SCHEMA),
    "text_editor_": ("View, create and edit text files.", _TEXT_EDITOR_SCHEMA),
}


def _client_tool(tool: JsonObject) -> JsonObject:
    kind = tool.get("type")
    if not isinstance(kind, str):
        return tool
    known = next((v for prefix, v in _CLIENT_TOOLS.items() if kind.startswith(prefix)), None)
    if kind != "custom" and known is None:
        return tool  # a server tool: the recipe refuses it
    plain = {key: value for key, value in tool.items() if key != "type"}
    if known is not None:
        description, schema = known
        plain.setdefault("description", description)
        plain.setdefault("input_schema", schema)
    return plain


def _without_redacted_thinking(message: Any) -> Any:
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    content = [
        block
        for block in message["content"]
        if not (isinstance(block, dict) and block.get("type") == "redacted_thinking")
    ]
    if len(content) == len(message["content"]):
        return message
    # A turn that held only redacted reasoning stays a turn, as an empty answer.
    return {**message, "content": content or [{"type": "text", "text": ""}]}


def normalize_messages_body(body: JsonObject) -> JsonObject:
    """The body with client tool types made plain and `redacted_thinking` blocks dropped."""
    normalized = dict(body)
    tools = body.get("tools")
    if isinstance(tools, list):
        normalized["tools"] = [_client_tool(t) if isinstance(t, dict) else t for t in tools]
    messages = body.get("messages")
    if isinstance(messages, list):
        normalized["messages"] = [_without_redacted_thinking(m) for m in messages]
    return normalized


def reject_thread(body: JsonObject) -> None:
    """A 400 `thread_unsupported_request` for a body with a `thread` (null is no thread)."""
    refuse_given(
        body,
        "thread",
        "message threads are not supported by this server: send the whole conversation "
        "without `thread`",
        kind=ErrorKind.THREAD_UNSUPPORTED,
    )


def anthropic_context_error(
    prompt_tokens: int, max_tokens: int | None, context_limit: int
) -> ContextLengthError:
    """Context overflow in the words of Anthropic's API."""
    if max_tokens is None or prompt_tokens >= context_limit:
        message = f"prompt is too long: {prompt_tokens} tokens > {context_limit} maximum"
    else:
        message = (
            f"input length and `max_tokens` exceed context limit: {prompt_tokens} + "
            f"{max_tokens} > {context_limit}, decrease input length or `max_tokens` and try again"
        )
    return ContextLengthError(message, param="max_tokens")
