"""The OpenAPI schemas of a body's typed fields, generated from the Struct that declares them.

Each protocol's typed body (`ChatBody`, `CompletionBody`, `MessagesBody`, `ResponsesBody`)
declares its fields' JSON types and bounds once; their schemas here are msgspec's JSON Schema of
those declarations (a sampling field's, `fields.sampling_field`, from the same declaration), so
a bound lives in one place. What a declaration cannot say is added by name: a description, or a
bound another layer draws (`recipe_bounds`: deepseek-recipe refuses a Chat `max_tokens` the
typed field would take).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import msgspec

from deepinfer_server.openapi.fields import sampling_field
from deepinfer_server.openapi.schema import Schema
from deepinfer_server.protocol.core.sampling import SAMPLING, Api

_NO_OVERRIDES: Mapping[str, Any] = {}


def typed_fields(
    struct: type[msgspec.Struct],
    api: Api,
    *,
    described: Mapping[str, str] = _NO_OVERRIDES,
    recipe_bounds: Mapping[str, Schema] = _NO_OVERRIDES,
) -> dict[str, Schema]:
    """The schema of each of `struct`'s fields in `api`'s body, by name, in declaration order;
    `described` adds descriptions, `recipe_bounds` replaces a field's schema where the recipe
    draws a narrower bound than its declaration."""
    sampling = {field.name: field for field in SAMPLING[api].fields}
    generated = _struct_properties(struct)
    schemas: dict[str, Schema] = {}
    for name in struct.__struct_fields__:
        if name in recipe_bounds:
            schema = recipe_bounds[name]
        elif name in sampling:
            schema = sampling_field(sampling[name], api)
        else:
            schema = dict(generated[name])
        if name in described:
            schema = {**schema, "description": described[name]}
        schemas[name] = schema
    return schemas


@functools.cache
def _struct_properties(struct: type[msgspec.Struct]) -> dict[str, Schema]:
    """msgspec's JSON Schema of `struct`'s fields, with nested Structs inlined (the document
    names only its own components) and without msgspec's `default` and `title`."""
    document = msgspec.json.schema(struct)
    definitions: dict[str, Schema] = document["$defs"]
    properties: dict[str, Schema] = definitions[struct.__name__]["properties"]
    return {name: _inlined(schema, definitions) for name, schema in properties.items()}


def _inlined(schema: Any, definitions: Mapping[str, Schema]) -> Any:
    if isinstance(schema, list):
        return [_inlined(item, definitions) for item in schema]
    if not isinstance(schema, dict):
        return schema
    reference = schema.get("$ref")
    if isinstance(reference, str):
        return _inlined(definitions[reference.rsplit("/", 1)[1]], definitions)
    return {
        key: _inlined(value, definitions)
        for key, value in schema.items()
        if key not in ("default", "title")
    }
