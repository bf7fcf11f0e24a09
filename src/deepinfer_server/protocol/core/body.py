"""A request body's server-read fields as one typed msgspec Struct, and each field's own 400.

Each protocol declares the fields the server reads itself as a Struct (deepseek-recipe reads the
rest of the dict body, so unknown fields pass). `read_body` converts the decoded body with
msgspec; when msgspec refuses it, the first refused field in declaration order gets its own 400,
worded from its declaration: its JSON type and `msgspec.Meta` bounds, or its `Said` texts.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from deepinfer_server.errors import BadRequestError
from deepinfer_server.protocol.core.validation import UINT32_MAX

S = TypeVar("S", bound=msgspec.Struct)
M = TypeVar("M")

#: A field's own check of a present value: raises the field's 400 (a BadRequestError).
Check = Callable[[object], object]


@dataclass(frozen=True, slots=True)
class Said:
    """A field's own 400 texts, where the ones worded from its type and bounds do not fit."""

    #: For a value of another JSON type.
    type: str
    #: For a value out of bounds (default: `type`'s text).
    range: str = ""


#: An unsigned 32-bit integer.
UInt32 = Annotated[int, Meta(ge=0, le=UINT32_MAX)]
#: How many alternatives of each token a request may ask for (OpenAI's bound: Chat's
#: `top_logprobs`, Completions' `logprobs`).
MAX_TOP_LOGPROBS = 20
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
#: vLLM's `cache_salt`: requests with different salts never share cached prompt prefixes. A
#: non-empty string when given, as vLLM validates it.
CacheSalt = Annotated[
    str,
    Meta(min_length=1),
    Said("Parameter 'cache_salt' must be a non-empty string if provided."),
]


class StreamOptions(msgspec.Struct, kw_only=True, frozen=True):
    """`stream_options` (chat and completions): what a streamed response reports about usage."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


#: A stream without `stream_options`.
NO_STREAM_OPTIONS = StreamOptions()


def check_stream_options(options: StreamOptions | None, stream: object) -> None:
    """400 for `stream_options` on a request that does not stream."""
    if options is not None and not stream:
        raise BadRequestError("'stream_options' needs 'stream': true", param="stream_options")


@dataclass(frozen=True, slots=True)
class Declared:
    """One Struct field as its annotation declares it (see `declarations`)."""

    name: str
    annotation: Any
    #: bool, int, float, str or a Struct.
    base: Any
    #: What `Annotated` adds to the type: its `Meta`, its `Said`, a caller's own markers.
    marks: tuple[Any, ...]
    #: Whether null is accepted (read as absent).
    nullable: bool

    def mark(self, kind: type[M]) -> M | None:
        """The field's marker of type `kind`, if it has one."""
        return next((mark for mark in self.marks if isinstance(mark, kind)), None)


def read_body(
    body: Mapping[str, Any],
    struct: type[S],
    *,
    checks: Mapping[str, Check] | None = None,
    deferred: frozenset[str] = frozenset(),
) -> S:
    """`body`'s fields typed as `struct` declares them; a 400 naming the first refused field.

    When msgspec refuses the body, each present field is checked in declaration order: by its
    own check in `checks` (which must refuse what its declaration refuses), or else against its
    annotation, and the first refused one gets its 400. A refused field named in `deferred` is
    another layer's to refuse (deepseek-recipe's): it is read as absent.
    """
    try:
        return msgspec.convert(body, struct)
    except msgspec.ValidationError:
        pass
    raise_first_refusal(body, struct, checks or {}, deferred)
    try:
        return msgspec.convert({k: v for k, v in body.items() if k not in deferred}, struct)
    except msgspec.ValidationError as exc:  # a refusal the declared wording missed
        raise BadRequestError(f"invalid request: {exc}") from exc


def raise_first_refusal(
    body: Mapping[str, Any],
    struct: type[msgspec.Struct],
    checks: Mapping[str, Check],
    deferred: frozenset[str] = frozenset(),
) -> None:
    """The 400 of the first field of `struct` (in declaration order) that `body` gets wrong."""
    for field in declarations(struct):
        value = body.get(field.name)
        if field.name in deferred or (value is None and field.nullable):
            continue
        check = checks.get(field.name)
        if check is not None:
            check(value)
            continue
        try:
            msgspec.convert(value, field.annotation)
        except msgspec.ValidationError as exc:
            raise _refusal(field, value, exc) from None


def _refusal(field: Declared, value: object, exc: msgspec.ValidationError) -> BadRequestError:
    name, base, said = field.name, field.base, field.mark(Said)
    if _is_struct(base):
        if isinstance(value, dict):
            raise_first_refusal(value, base, {})
            return BadRequestError(f"'{name}': {exc}", param=name)
        return BadRequestError(f"'{name}' must be an object", param=name)
    of_type = _is_json_type(value, base)
    if said is not None:
        return BadRequestError(said.type if not of_type else said.range or said.type, param=name)
    if not of_type:
        return BadRequestError(f"'{name}' must be {_TYPE_WORDS[base]}", param=name)
    bounds = _range_text(name, base, field.mark(Meta))
    return BadRequestError(bounds or f"'{name}' is not valid: {exc}", param=name)


_TYPE_WORDS: dict[Any, str] = {
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
}


def _is_json_type(value: object, base: Any) -> bool:
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if base is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, base)


def _range_text(name: str, base: Any, meta: Meta | None) -> str | None:
    """The wording of a value of the right type out of its declared bounds (None: no wording
    fits; msgspec's own is used)."""
    if meta is None:
        return None
    if base is str:
        if meta.min_length == 1 and meta.max_length is None and meta.pattern is None:
            return f"'{name}' must be a non-empty string"
        return None
    if meta.gt is not None or meta.lt is not None or meta.multiple_of is not None:
        return None
    low, high = meta.ge, meta.le
    if low is not None and high is not None:
        return f"'{name}' must be between {_number(low)} and {_number(high)}"
    if low is not None:
        return f"'{name}' must be at least {_number(low)}"
    if high is not None:
        return f"'{name}' must be at most {_number(high)}"
    return None


def _number(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


@functools.cache
def declarations(struct: type[msgspec.Struct]) -> tuple[Declared, ...]:
    """`struct`'s fields as their annotations declare them, in order: each is `T`, `T | None`,
    or either with `Annotated[T, ...]`, where T is bool, int, float, str or a Struct; a
    TypeError otherwise."""
    hints = typing.get_type_hints(struct, include_extras=True)
    return tuple(_declare(name, hints[name]) for name in struct.__struct_fields__)


def declared_fields(struct: type[msgspec.Struct]) -> tuple[str, ...]:
    """`struct`'s field names, once its declarations and those of the Structs it nests are
    checked (`declarations`)."""
    for field in declarations(struct):
        if _is_struct(field.base):
            declared_fields(field.base)
    return struct.__struct_fields__


def _is_struct(base: Any) -> bool:
    return isinstance(base, type) and issubclass(base, msgspec.Struct)


def _declare(name: str, annotation: Any) -> Declared:
    """One field's declaration (see `declarations`)."""
    inner = annotation
    nullable = False
    if typing.get_origin(inner) in (typing.Union, types.UnionType):
        options = [arg for arg in typing.get_args(inner) if arg is not type(None)]
        nullable = len(options) < len(typing.get_args(inner))
        if len(options) != 1:
            raise TypeError(f"body field {name!r}: one type (or it or null), not {annotation}")
        inner = options[0]
    base: Any = inner
    marks: tuple[Any, ...] = ()
    if typing.get_origin(inner) is Annotated:
        base, *rest = typing.get_args(inner)
        marks = tuple(rest)
    if base not in _TYPE_WORDS and not _is_struct(base):
        raise TypeError(f"body field {name!r}: bool, int, float, str or a Struct, not {base}")
    return Declared(name, annotation, base, marks, nullable)
