"""Anthropic Messages API output: engine tokens in, Messages events (or one JSON body) out."""

from __future__ import annotations

from deepseek_recipe import MessagesRequest, MessagesResponse

from deepinfer_server.protocol.core.named_events import NamedEventOutput
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.protocol.messages.request import PreparedMessages


def messages_output(
    prepared: PreparedMessages, message_id: str, recipe: RecipeContext
) -> NamedEventOutput:
    """The output of one Messages request."""
    generator = MessagesRequest.chunk_generator(prepared.request, message_id, recipe.model_name)
    return NamedEventOutput(generator, MessagesResponse, message_id, prepared, recipe)
