"""Anthropic's thinking semantics on `/v1/messages`.

Anthropic's API thinks only when the request says so (`thinking: {"type": "enabled", ...}` or
`{"type": "adaptive"}`); deepseek-recipe would apply the server's `--default-thinking` to a
request without `thinking`. A Messages request without it is therefore converted with thinking
disabled: the model answers from the non-thinking prompt (it ends in `</think>`), no thinking
block is produced and `content[0]` is the answer, as Anthropic's quickstart expects.

`thinking.budget_tokens` is a hard budget here (Anthropic's is a target): reasoning ends after
that many tokens (`protocol/core/thinking_budget.py`). Values below Anthropic's minimum of 1024
are accepted.
"""

from __future__ import annotations

from deepinfer_server.protocol.core.effort import check_effort_agrees, read_effort
from deepinfer_server.protocol.core.json_types import JsonObject

_EFFORT_PARAM = "output_config.effort"
_ENABLE = 'send `thinking: {"type": "adaptive"}` (or `enabled`)'


def with_explicit_thinking(body: JsonObject) -> JsonObject:
    """The body with thinking disabled when it does not enable it (no `thinking`, or null)."""
    if body.get("thinking") is not None:
        return body
    return {**body, "thinking": {"type": "disabled"}}


def read_messages_effort(body: JsonObject) -> str | None:
    """`output_config.effort`, checked against the effort table (null: unset)."""
    config = body.get("output_config")
    return read_effort(config.get("effort") if isinstance(config, dict) else None, _EFFORT_PARAM)


def check_messages_effort(effort: str | None, thinking_mode: bool) -> None:
    """A 400 when `output_config.effort` contradicts the request's thinking."""
    check_effort_agrees(effort, thinking_mode, _EFFORT_PARAM, _ENABLE)
