"""What a stored `POST /v1/responses` continues: its input expanded from the Responses store.

A session (`services/responses_session.py`) reads, on the event loop and before preparation,
what the request continues: its conversation's items (`conversation`), or the chain of
`previous_response_id`, and the stored items its input names by reference (`read_expansion`).
The expansion itself (`expand_input`: the stored items before the request's own, reasoning that
came from the store sealed for its place, then every reasoning item restored) runs later, as the
first step of the preparation, off the event loop when what the store adds is large.

Only items that came from the store are trusted: a client's own reasoning items are verified
against their `encrypted_content`, never sealed on their word.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.reasoning_seal import ReasoningSeal
from deepinfer_server.protocol.responses.conversations import conversation_not_found
from deepinfer_server.protocol.responses.reasoning import restore_reasoning
from deepinfer_server.protocol.responses.stored import (
    input_list,
    previous_not_found,
    referenced_ids,
    resolve_references,
    seal_stored_reasoning,
    with_id,
)
from deepinfer_server.store import BrokenHistory, ResponseStore
from deepinfer_server.store.conversations import ConversationStore


class Expansion(NamedTuple):
    """What a request continues, as read from the store, before it is expanded."""

    history: list[Any]
    #: The request's own input items, references resolved.
    own: list[Any]
    #: Positions (in history, then own) of the items that came from the store.
    trusted: set[int]
    #: The stored items the request's input names, as read.
    referenced: list[Any]


async def read_expansion(
    store: ResponseStore,
    conversations: ConversationStore,
    scope: str,
    conversation: str | None,
    previous: str | None,
    body: JsonObject,
) -> Expansion:
    """Read what the request continues from the store (the conversation, the
    `previous_response_id` chain, the items it names); a 404 of the missing one."""
    history: list[Any] = []
    trusted_history: set[int] | None = None  # all of it
    if conversation is not None:
        page = await conversations.items(scope, conversation, limit=None, order="asc")
        if page is None:
            raise conversation_not_found(conversation)
        history, trusted_history = page.items, set(page.trusted)
    elif previous is not None:
        try:
            found = await store.history(scope, previous)
        except BrokenHistory as broken:
            raise previous_not_found(broken.missing) from None
        if found is None:
            raise previous_not_found(previous)
        history = found
    own = [with_id(item) for item in input_list(body)]
    wanted = referenced_ids(own)
    found_items = await store.items(scope, wanted) if wanted else {}
    own, from_store = resolve_references(own, found_items)
    trusted = set(range(len(history))) if trusted_history is None else trusted_history
    trusted |= {len(history) + index for index in from_store}
    return Expansion(history, own, trusted, list(found_items.values()))


def expand_input(expansion: Expansion, seal: ReasoningSeal) -> tuple[list[Any], list[Any]]:
    """The input to prepare (the stored items before the request's own, stored reasoning
    sealed) and the request's own input items as they will be stored."""
    history, own, trusted, _ = expansion
    expanded = seal_stored_reasoning([*history, *own], trusted, seal)
    restored, _ = restore_reasoning({"input": expanded}, seal)
    return expanded, restored["input"][len(history) :]
