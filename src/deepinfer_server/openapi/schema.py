"""Small builders of JSON Schema (2020-12, OpenAPI 3.1's dialect) fragments."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def obj(
    properties: dict[str, Schema], required: tuple[str, ...] = (), description: str | None = None
) -> Schema:
    """An object with these properties; other properties are allowed (the server ignores or
    passes on fields it does not read, as OpenAI-compatible servers do)."""
    schema: Schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = list(required)
    if description:
        schema["description"] = description
    return schema


def integer(
    minimum: int | None = None, maximum: int | None = None, description: str = ""
) -> Schema:
    """An integer in [minimum, maximum] (JSON booleans are not integers here)."""
    return _bounded("integer", minimum, maximum, description)


def number(
    minimum: float | None = None, maximum: float | None = None, description: str = ""
) -> Schema:
    """A JSON number in [minimum, maximum]."""
    return _bounded("number", minimum, maximum, description)


def _bounded(kind: str, minimum: float | None, maximum: float | None, description: str) -> Schema:
    schema: Schema = {"type": kind}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    if description:
        schema["description"] = description
    return schema


def string(description: str = "", **extra: Any) -> Schema:
    """A string, with extra keywords (`enum`, `minLength`, ...)."""
    schema: Schema = {"type": "string", **extra}
    if description:
        schema["description"] = description
    return schema


def boolean(description: str = "") -> Schema:
    """A JSON boolean."""
    schema: Schema = {"type": "boolean"}
    if description:
        schema["description"] = description
    return schema


def boolean_false(why: str) -> Schema:
    """A boolean accepted only as false (true is a 400 saying `why`)."""
    return {"type": "boolean", "const": False, "description": f"Only false: {why}"}


def array(items: Schema, min_items: int = 0, max_items: int | None = None) -> Schema:
    """An array of `items`, with min_items to max_items of them."""
    schema: Schema = {"type": "array", "items": items}
    if min_items:
        schema["minItems"] = min_items
    if max_items is not None:
        schema["maxItems"] = max_items
    return schema


def nullable(schema: Schema) -> Schema:
    """`schema` or JSON null (the server reads null as absent)."""
    return {"anyOf": [schema, {"type": "null"}]}


def one_of(*schemas: Schema, description: str = "") -> Schema:
    """Any of `schemas` (anyOf: the alternatives may overlap)."""
    schema: Schema = {"anyOf": list(schemas)}
    if description:
        schema["description"] = description
    return schema


def neutral(value: float, description: str, kind: str = "number") -> Schema:
    """A parameter the engine cannot apply: accepted only at its neutral value."""
    return {"type": kind, "const": value, "description": description}


def ref(name: str) -> Schema:
    """A reference to `#/components/schemas/NAME`."""
    return {"$ref": f"#/components/schemas/{name}"}
