"""The session a generation request names, for session-affine routing across DP ranks
(`coordinator/session_routing.py`).

A request may name its session in several places; the first present, in this order, is its
session key:

1. `prompt_cache_key` (Chat Completions, Completions, Responses): OpenAI's own field for this.
2. `conversation` (Responses, a conversation ID or `{"id": ...}`).
3. `previous_response_id` (Responses): the response it continues, whose rank the API process
   remembers as it remembers a session's.
4. The `x-session-id` header (set by proxies and agent frameworks, and hashed on by the
   routers' consistent-hash policies).
5. The `x-claude-code-session-id` header (Claude Code's).
6. `metadata.user_id` (Messages): last, because it names the end user, who may run several
   sessions at once (Claude Code's value also carries its session).

Explicit names come before the headers a client or proxy adds to every request, and the
headers before a user's ID. Only non-empty strings count; a field of the wrong type is refused
by the preparation of the API that defines it, and ignored here for the others.
"""

from __future__ import annotations

from collections.abc import Mapping

from deepinfer_server.protocol.core.json_types import JsonObject

#: Headers that name a session, in their order of precedence (after the body's fields).
SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id")


def session_key(body: JsonObject, headers: Mapping[str, str]) -> str | None:
    """The session key of a request with this decoded `body` and these `headers` (a mapping
    whose lookups ignore case, as Starlette's), or None when it names no session."""
    for candidate in (
        body.get("prompt_cache_key"),
        _conversation_id(body.get("conversation")),
        body.get("previous_response_id"),
        *(headers.get(name) for name in SESSION_HEADERS),
        _user_id(body.get("metadata")),
    ):
        if isinstance(candidate, str) and candidate:
            return candidate
    return None


def _conversation_id(value: object) -> object:
    """A Responses `conversation`'s ID (it is the ID, or an object holding it)."""
    return value.get("id") if isinstance(value, dict) else value


def _user_id(metadata: object) -> object:
    """Messages' `metadata.user_id`."""
    return metadata.get("user_id") if isinstance(metadata, dict) else None
