"""The one name for JSON the server does not read field by field.

A request body is decoded once into a `JsonObject` and never changed afterwards: the fields the
server reads are typed by each protocol's body Struct; the rest (messages, tools, input items,
response formats...) is deepseek-recipe's to convert, or is stored and echoed as sent. What the
server answers (response objects, stream events, error envelopes, stored items) is JSON built
for a client in the client's protocol and serialised as is. Both are opaque here by design:
typing them would duplicate the recipe's and the protocols' own schemas.
"""

from __future__ import annotations

from typing import Any, TypeAlias

#: A decoded JSON object the server hands on (to deepseek-recipe, a store, a client) as is.
JsonObject: TypeAlias = dict[str, Any]
