"""A field named in deepseek-recipe's refusals of a body's shape.

The recipe parses a body with serde, whose refusal of a field's JSON type or range ("invalid
request body: invalid value: integer `-1`, expected u32") does not say which field it is. The
field is found by parsing each top-level field alone, in a protocol's smallest valid body (its
`BodyShape`): each field's value is parsed once, so finding it costs about one more parse of the
body, and only for a body that was refused. The 400 then names it in every protocol's shape: as
`param`, and first in the message (`max_tokens: invalid value: ...`), where Anthropic's error
shape, which has no `param`, says it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from deepinfer_server.errors import BadRequestError
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.recipe import recipe_errors

_SHAPE_REFUSAL = "invalid request body: "


def is_shape_refusal(error: BadRequestError) -> bool:
    """Whether `error` is the recipe's refusal of a body's shape, without a field."""
    return error.param is None and error.message.startswith(_SHAPE_REFUSAL)


@dataclass(frozen=True, slots=True)
class BodyShape:
    """How deepseek-recipe parses one protocol's body, and the smallest body it takes."""

    #: The recipe's request class (its constructor parses the body).
    parse: Callable[[JsonObject], object]
    skeleton: JsonObject


def name_refused_field(
    error: BadRequestError, body: JsonObject, shape: BodyShape
) -> BadRequestError:
    """`error` (the recipe's refusal of `body`'s shape) naming the first top-level field the
    recipe refuses alone in `shape`'s skeleton; `error` itself when no field is refused alone."""
    for name, value in body.items():
        try:
            with recipe_errors():
                shape.parse({**shape.skeleton, name: value})
        except BadRequestError as alone:
            if is_shape_refusal(alone):
                words = alone.message.removeprefix(_SHAPE_REFUSAL)
                return BadRequestError(f"{name}: {words}", param=name)
    return error
