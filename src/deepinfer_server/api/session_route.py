"""The session of a generation request, as the rank choice takes it (`SessionNames`)."""

from __future__ import annotations

from starlette.requests import Request

from deepinfer_server.coordinator.session_routing import SessionNames
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.session_key import session_key


def session_names(
    request: Request, body: JsonObject, response_id: str | None
) -> SessionNames | None:
    """The names of the session `request` (with this decoded `body`) belongs to, or None for
    none. `response_id`: the ID of a stored response, by which a later request may continue
    it (`previous_response_id`), so its rank is remembered under it too."""
    key = session_key(body, request.headers)
    recorded = tuple(name for name in (key, response_id) if name is not None)
    return SessionNames(key, recorded) if recorded else None
