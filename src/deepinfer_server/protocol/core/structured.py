"""Structured outputs and forced tool calls: request options → the engine's grammar (so_args).

Reading what a request asks (`Constraint`) is cheap and done while preparing it; compiling it
is `structured_outputs.py`'s (`StructuredOutputs.compile`, in the fair queue in front of the
compile workers). xgrammar is the optional [grammar] extra: without it an answer format or a
forced tool call in thinking mode is a 400 that says so, while `strict` tools and forced tool
calls outside thinking mode are served as deepseek-recipe renders them, unconstrained (logged
once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from deepinfer_server.errors import (
    BadRequestError,
    ErrorKind,
    GrammarCapacityError,
    OverloadedError,
)
from deepinfer_server.grammar import (
    Constraint,
    GrammarError,
    GrammarUnavailable,
    chat_constraint,
    messages_constraint,
    responses_constraint,
)
from deepinfer_server.grammar.errors import CompileRefused
from deepinfer_server.protocol.core.field_errors import (
    BodyShape,
    is_shape_refusal,
    name_refused_field,
)
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.recipe import recipe_errors

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: How each protocol's body names its structured-output options.
ConstraintReader = Callable[[Mapping[str, Any]], Constraint | None]
CHAT_CONSTRAINT: ConstraintReader = chat_constraint
RESPONSES_CONSTRAINT: ConstraintReader = responses_constraint
MESSAGES_CONSTRAINT: ConstraintReader = messages_constraint

_FORCED_TOOL_CHOICES = ("required", "named")


def _without_strict(tools: Any) -> Any:
    """The tools with their `strict` flags removed (the grammar enforces their schemas)."""
    if not isinstance(tools, list):
        return tools
    relaxed = []
    for tool in tools:
        if isinstance(tool, dict):
            tool = {k: v for k, v in tool.items() if k != "strict"}
            function = tool.get("function")
            if isinstance(function, dict):
                tool["function"] = {k: v for k, v in function.items() if k != "strict"}
        relaxed.append(tool)
    return relaxed


#: `json_object` as the JSON schema it stands for, in the grammar and in the prompt alike.
_ANY_OBJECT_SCHEMA = {"type": "object"}


def _json_object_as_schema(body: JsonObject, where: str) -> JsonObject:
    """`json_object` without the word "json" in the messages: OpenAI's rule, which the recipe
    keeps and vLLM and Ollama do not (the AI SDK's `createOpenAICompatible` sends exactly this
    for `generateObject`). The grammar enforces JSON anyway: the request is converted with the
    equivalent schema, which the prompt states as the recipe states json_object's."""
    global _warned_json_object
    log = logger.debug if _warned_json_object else logger.warning
    _warned_json_object = True
    log(
        "%s json_object without the word 'json' in the messages (OpenAI refuses it): accepted, "
        "the grammar enforces JSON (logged once at warning level)",
        where,
    )
    if where == "response_format":
        schema = {"name": "json_object", "schema": _ANY_OBJECT_SCHEMA}
        return {**body, "response_format": {"type": "json_schema", "json_schema": schema}}
    given = body.get("text")
    text: JsonObject = given if isinstance(given, dict) else {}
    as_schema = {"type": "json_schema", "name": "json_object", "schema": _ANY_OBJECT_SCHEMA}
    return {**body, "text": {**text, "format": as_schema}}


_warned_json_object = False

#: What deepseek-recipe refuses that the grammar honours, and how to convert the request instead:
#: a forced tool_choice in thinking mode (DeepSeek's hosted API refuses it too) is converted as
#: `auto` and the grammar forces the call after `</think>`; strict tools with an answer format
#: are converted without `strict` and one grammar allows a valid call or valid JSON; json_object
#: without the word "json" is converted as the schema `{"type": "object"}` (the grammar reads
#: json_object from the body as given, the same schema).
_RELAXATIONS: dict[str, Callable[[JsonObject, object], JsonObject]] = {
    "to use 'response_format' of type 'json_object'": lambda body, auto: _json_object_as_schema(
        body, "response_format"
    ),
    "to use 'text.format' of type 'json_object'": lambda body, auto: _json_object_as_schema(
        body, "text.format"
    ),
    "Thinking mode does not support this tool_choice": lambda body, auto: {
        **body,
        "tool_choice": auto,
    },
    "response_format should not be used with tools": lambda body, auto: {
        **body,
        "tools": _without_strict(body.get("tools")),
    },
}


_INVALID_SCHEMA = "Invalid json schema"


def convert_honouring_tool_choice(
    convert: Callable[[JsonObject], T],
    body: JsonObject,
    auto_choice: object,
    format_param: str,
    *,
    shape: BodyShape,
) -> T:
    """Convert a request with the recipe, relaxing what the recipe refuses but the grammar
    (read from the original body) enforces; `auto_choice` is the protocol's `auto` tool_choice
    and `format_param` the field that holds its answer format (named when the recipe rejects a
    schema without saying where); `shape` finds the field of a refusal of the body's shape
    (`field_errors`)."""
    relaxed = body
    for _ in range(len(_RELAXATIONS) + 1):
        try:
            with recipe_errors():
                return convert(relaxed)
        except BadRequestError as exc:
            if exc.message.startswith(_INVALID_SCHEMA) and exc.param is None:
                exc.param = format_param
                raise
            if is_shape_refusal(exc):
                raise name_refused_field(exc, relaxed, shape) from exc
            relax = next((f for m, f in _RELAXATIONS.items() if m in exc.message), None)
            if relax is None:
                raise
            relaxed = relax(relaxed, auto_choice)
    with recipe_errors():
        return convert(relaxed)


class _GrammarErrors:
    """GrammarError → 400 naming the field; a missing xgrammar → 400 saying how to install it;
    a compile refused for want of capacity → 429 (the key's own backlog) or 503, Retry-After.

    A class rather than a generator-based context manager: every request enters it, and this
    costs a fifth as much."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, trace: object) -> None:
        if isinstance(exc, CompileRefused):
            if exc.per_key:
                raise OverloadedError(exc.message, retry_after_seconds=exc.retry_after) from exc
            raise GrammarCapacityError(exc.message, retry_after_seconds=exc.retry_after) from exc
        if isinstance(exc, GrammarUnavailable):
            raise BadRequestError(exc.message, param=exc.param, kind=ErrorKind.UNSUPPORTED) from exc
        if isinstance(exc, GrammarError):
            raise BadRequestError(exc.message, param=exc.param) from exc


_GRAMMAR_ERRORS = _GrammarErrors()


def grammar_errors() -> _GrammarErrors:
    """A context that turns the grammar layer's errors into the server's ApiErrors."""
    return _GRAMMAR_ERRORS


def read_constraint(reader: ConstraintReader, body: Mapping[str, Any]) -> Constraint | None:
    """What the request asks to constrain (no compilation); 400 for malformed options.

    Read before the recipe converts the request, so that malformed options are a 400 naming
    their field rather than the recipe's unnamed one; the thinking mode is not known yet
    (`in_thinking_mode` sets it once the recipe has converted the request).
    """
    with grammar_errors():
        return reader(body)


def is_forced_tool_call(constraint: Constraint | None) -> bool:
    """True when the whole answer must be a tool call (tool_choice required or named)."""
    return (
        constraint is not None
        and constraint.tools is not None
        and constraint.tools.mode in _FORCED_TOOL_CHOICES
    )
