"""The sampling fields of every protocol's body, declared once, as typed msgspec Structs.

Each protocol's sampling fields are one Struct (`BODIES`): a field is its name, its JSON type and
bounds (`msgspec.Meta`) and how it reaches the engine (`Engine`: the `SamplingOptions` field it
fills, and who checks it). Each protocol's typed body (`ChatBody`, ...) extends its sampling
Struct. From those declarations come, per protocol (`SAMPLING`), the body's validation and its
400s (`ProtocolSampling.typed`: msgspec converts the body; a field it refuses gets the field's
own message), the one mapping to the engine's options (`ProtocolSampling.values` and
`ProtocolSampling.options`), and the OpenAPI schemas (`openapi/fields.py`). A new sampling field
is one Struct field (plus the engine's side of its `SamplingOptions` field);
`tests/unit/protocol/test_sampling_fields.py` fails when it reaches neither the engine nor the
OpenAPI document.

DeepInfer 0.1.0's SamplingParams has temperature, top_p and top_k and nothing else that shapes
the distribution: penalties, `min_p`, `min_tokens` and `logit_bias` are accepted only at their
neutral value (what a client library sends by default), anything else is a 400 naming the
parameter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, TypedDict, TypeVar, cast

import msgspec
from deepseek_recipe import InferenceOptions
from msgspec import Meta

from deepinfer_server.errors import BadRequestError, ErrorKind
from deepinfer_server.ipc.messages import SamplingOptions
from deepinfer_server.protocol.core.body import Declared, declarations, read_body

INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1


class Api(StrEnum):
    """The request bodies that carry sampling fields."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    MESSAGES = "messages"
    RESPONSES = "responses"


#: The protocols whose bodies deepseek-recipe converts (and whose sampling fields it may check).
CONVERTED = frozenset({Api.CHAT, Api.MESSAGES, Api.RESPONSES})


def _same(value: float) -> float:
    return value


@dataclass(frozen=True, slots=True)
class Engine:
    """How a declared sampling field reaches the engine (the marker in its annotation)."""

    #: The `SamplingOptions` field it fills; None for a field accepted only at `neutral`.
    option: str | None = None
    #: The one value a field the engine cannot apply is accepted at (it leaves sampling as is).
    neutral: float | None = None
    #: Protocols where deepseek-recipe checks the field (its own 400s) and its InferenceOptions
    #: carries the checked value under `option`'s name.
    recipe_checked: frozenset[Api] = frozenset()
    #: The 400's text for a value out of range (default: "must be a number between ...").
    range_message: str = ""
    #: The engine's value for a checked request value.
    to_engine: Callable[[Any], Any] = _same


def _unsupported(value: float, lacks: str) -> Meta:
    return Meta(
        ge=value, le=value, description=f"Accepted only as {value:g}: the engine has no {lacks}"
    )


_NEUTRAL_ZERO = Engine(neutral=0.0)

# The declarations. A field's JSON type is its annotation's (an int field takes no float, and no
# field takes a bool); `Meta` bounds it and describes it; `Engine` maps it.
PresencePenalty = Annotated[float, _unsupported(0.0, "penalties"), _NEUTRAL_ZERO]
FrequencyPenalty = Annotated[float, _unsupported(0.0, "penalties"), _NEUTRAL_ZERO]
RepetitionPenalty = Annotated[float, _unsupported(1.0, "penalties"), Engine(neutral=1.0)]
MinP = Annotated[float, _unsupported(0.0, "min_p"), _NEUTRAL_ZERO]
# DeepInfer can keep EOS off the first generated token only (`first_n_token_no_eos`), not off
# the first n, and never stop strings: vLLM's min_tokens is refused beyond 0.
MinTokens = Annotated[
    float, _unsupported(0, "minimum length (vLLM's min_tokens)"), Engine(neutral=0)
]
Temperature = Annotated[float, Meta(ge=0, le=2), Engine("temperature", recipe_checked=CONVERTED)]
# deepseek-recipe's range is (0, 1] in 32-bit floats (a 64-bit denormal rounds to 0).
TopP = Annotated[float, Meta(ge=1e-9, le=1), Engine("top_p", recipe_checked=CONVERTED)]
TopK = Annotated[
    int,
    Meta(ge=-1, le=INT32_MAX, description="-1 or 0 disable it (vLLM's extension)"),
    Engine(
        "top_k",
        range_message=f"'top_k' must be -1 or 0 (disabled) or between 1 and {INT32_MAX}",
        # DeepInfer's off is -1 only; vLLM's clients also send 0.
        to_engine=lambda value: -1 if value == 0 else value,
    ),
]
# vLLM's hard reasoning budget (Responses: this server's extension, same name).
ThinkingTokenBudget = Annotated[
    int,
    Meta(
        ge=0,
        le=INT32_MAX,
        description="vLLM's extension: the most reasoning tokens; then `</think>` is forced "
        "and the answer follows",
    ),
    Engine(
        "thinking_budget",
        range_message=f"'thinking_token_budget' must be between 0 and {INT32_MAX}",
    ),
]
# DeepInfer masks a seed to 64 bits, and deepseek-recipe takes [0, 2**63): every protocol takes
# the range both accept, worded by the server (the recipe's Chat check never sees a seed out of it).
Seed = Annotated[
    int,
    Meta(ge=0, le=SEED_MAX),
    Engine("seed", range_message=f"'seed' must be between 0 and {SEED_MAX}"),
]


class EngineValues(TypedDict, total=False):
    """The engine's values of a body's sampling fields the server checks, by `SamplingOptions`
    field name (each present only when the body gave it)."""

    temperature: float
    top_p: float
    top_k: int
    thinking_budget: int
    seed: int


class SamplingBody(msgspec.Struct, kw_only=True, frozen=True):
    """The sampling fields of every protocol's body (null is absent)."""

    temperature: Temperature | None = None
    top_p: TopP | None = None


class ResponsesSampling(SamplingBody, kw_only=True, frozen=True):
    """The Responses API's sampling fields."""

    thinking_token_budget: ThinkingTokenBudget | None = None


class MessagesSampling(SamplingBody, kw_only=True, frozen=True):
    """Anthropic's Messages API's sampling fields."""

    top_k: TopK | None = None


class OpenAISampling(SamplingBody, kw_only=True, frozen=True):
    """Chat Completions' and Completions' sampling fields (OpenAI's and vLLM's)."""

    presence_penalty: PresencePenalty | None = None
    frequency_penalty: FrequencyPenalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_p: MinP | None = None
    min_tokens: MinTokens | None = None
    top_k: TopK | None = None
    thinking_token_budget: ThinkingTokenBudget | None = None
    seed: Seed | None = None


B = TypeVar("B", bound=SamplingBody)

#: Each protocol's sampling fields.
BODIES: dict[Api, type[SamplingBody]] = {
    Api.CHAT: OpenAISampling,
    Api.COMPLETIONS: OpenAISampling,
    Api.MESSAGES: MessagesSampling,
    Api.RESPONSES: ResponsesSampling,
}


@dataclass(frozen=True, slots=True)
class SamplingField:
    """One declared sampling field, as its Struct annotation declares it."""

    name: str
    #: `int` or `float`: what JSON value the field takes (a boolean is neither).
    kind: type[int] | type[float]
    minimum: float
    maximum: float
    engine: Engine
    #: The protocols whose body takes it.
    apis: frozenset[Api]
    #: The OpenAPI description.
    description: str = ""
    #: The JSON value types it takes (an exact int, or any number); a bool is never one.
    _types: type | tuple[type, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        exact_int = self.kind is int and self.neutral is None
        object.__setattr__(self, "_types", int if exact_int else (int, float))

    @property
    def option(self) -> str | None:
        """The `SamplingOptions` field it fills (None: accepted only at `neutral`)."""
        return self.engine.option

    @property
    def neutral(self) -> float | None:
        """The one value it is accepted at, when the engine cannot apply it."""
        return self.engine.neutral

    @property
    def recipe_checked(self) -> frozenset[Api]:
        """The protocols where deepseek-recipe checks it."""
        return self.engine.recipe_checked

    def to_engine(self, value: Any) -> Any:
        """The engine's value for a checked request value."""
        return self.engine.to_engine(value)

    def check(self, raw: object) -> Any:
        """The engine's value for a present request value, or a 400 naming the field."""
        if raw.__class__ is bool or not isinstance(raw, self._types):
            raise BadRequestError(self._type_message(), param=self.name)
        value: float = raw  # type: ignore[assignment]  # an int or a float, checked above
        if self.neutral is not None:
            if value != self.neutral:
                raise BadRequestError(
                    f"'{self.name}' is not supported: the DeepInfer engine cannot apply it; "
                    f"omit it or send {self.neutral:g}",
                    param=self.name,
                    kind=ErrorKind.UNSUPPORTED,
                )
            return value
        if not self.minimum <= value <= self.maximum:
            raise BadRequestError(
                self.engine.range_message or self._type_message(), param=self.name
            )
        if self.kind is float:
            value = float(value)
        return self.to_engine(value)

    def _type_message(self) -> str:
        if self.neutral is not None:
            return f"'{self.name}' must be a number"
        if self.kind is int:
            return f"'{self.name}' must be an integer"
        return f"'{self.name}' must be a number between {self.minimum:g} and {self.maximum:g}"


def _sampling_field(field: Declared, apis: frozenset[Api]) -> SamplingField:
    """A sampling field's declaration: `Annotated[int | float, Meta(...), Engine(...)] | None`."""
    name, kind = field.name, field.base
    meta, engine = field.mark(Meta), field.mark(Engine)
    if not field.nullable or kind not in (int, float) or meta is None or engine is None:
        raise TypeError(
            f"sampling field {name!r} must be Annotated[int or float, Meta, Engine] | None"
        )
    if meta.ge is None or meta.le is None:
        raise TypeError(f"sampling field {name!r} needs both bounds (ge and le)")
    if engine.neutral is not None and not meta.ge == meta.le == engine.neutral:
        # msgspec would accept what the field's own check refuses.
        raise TypeError(f"sampling field {name!r}: a neutral-only field's bounds are its value")
    return SamplingField(name, kind, meta.ge, meta.le, engine, apis, meta.description or "")


def sampling_fields_of(
    body: type[msgspec.Struct], apis_of: Mapping[str, frozenset[Api]]
) -> tuple[SamplingField, ...]:
    """The declarations of `body`'s fields, in order (the order the server checks them);
    `apis_of` names the protocols that take each. A TypeError for a field declared without
    its bounds or its engine mapping."""
    return tuple(_sampling_field(field, apis_of[field.name]) for field in declarations(body))


def _fields() -> dict[Api, tuple[SamplingField, ...]]:
    """Each protocol's declared fields (a field shared by several is one declaration)."""
    apis_of: dict[str, set[Api]] = {}
    for api, body in BODIES.items():
        for name in body.__struct_fields__:
            apis_of.setdefault(name, set()).add(api)
    frozen = {name: frozenset(apis) for name, apis in apis_of.items()}
    declared = {
        field.name: field
        for body in dict.fromkeys(BODIES.values())
        for field in sampling_fields_of(body, frozen)
    }
    return {
        api: tuple(declared[name] for name in body.__struct_fields__)
        for api, body in BODIES.items()
    }


_BY_API = _fields()
#: Every declared sampling field, once each.
SAMPLING_FIELDS: tuple[SamplingField, ...] = tuple(
    {field.name: field for fields in _BY_API.values() for field in fields}.values()
)


class ProtocolSampling:
    """One protocol's sampling fields: the server's checks of its body, and its engine options."""

    __slots__ = ("_checked", "_checks", "_deferred", "_from_recipe", "api", "body", "fields")

    def __init__(self, api: Api) -> None:
        self.api = api
        #: The Struct that declares `api`'s sampling fields.
        self.body = BODIES[api]
        #: The fields `api`'s body takes, in declaration order.
        self.fields = _BY_API[api]
        # The fields the server checks itself (deepseek-recipe checks the others), and the
        # SamplingOptions fields deepseek-recipe's InferenceOptions fills.
        self._checked = tuple(field for field in self.fields if api not in field.recipe_checked)
        self._checks = {field.name: field.check for field in self._checked}
        self._deferred = frozenset(
            field.name for field in self.fields if api in field.recipe_checked
        )
        self._from_recipe = tuple(
            field.option
            for field in self.fields
            if api in field.recipe_checked and field.option is not None
        )

    def read(self, body: Mapping[str, Any]) -> EngineValues:
        """The engine's values of the present fields the server checks, by `SamplingOptions`
        field name; a 400 naming the first field (in declaration order) its Struct refuses."""
        return self.values(self.typed(body, self.body))

    def typed(self, body: Mapping[str, Any], struct: type[B]) -> B:
        """`body` typed as `struct` (this protocol's sampling Struct, or a body Struct that
        extends it); a sampling field's 400 is its own, and a field deepseek-recipe checks is
        left to the recipe's 400 (read as absent)."""
        return read_body(body, struct, checks=self._checks, deferred=self._deferred)

    def values(self, typed: SamplingBody) -> EngineValues:
        """The engine's values of `typed`'s present fields that the server checks, by
        `SamplingOptions` field name."""
        values: dict[str, float] = {}
        for field in self._checked:
            value = getattr(typed, field.name)
            if value is not None and field.option is not None:
                values[field.option] = field.to_engine(value)
        # Every option named is a SamplingOptions field (test_sampling_fields walks them all).
        return cast(EngineValues, values)

    def options(
        self, read: EngineValues, inference: InferenceOptions | None = None, **rest: Any
    ) -> SamplingOptions:
        """The engine's options: the fields `read` read, those deepseek-recipe checked (from
        its `inference` options), and the ones the caller resolves (`rest`: max_tokens...)."""
        if inference is not None:
            for name in self._from_recipe:
                rest[name] = getattr(inference, name)
        return SamplingOptions(**read, **rest) if read else SamplingOptions(**rest)


#: Each protocol's sampling fields.
SAMPLING: dict[Api, ProtocolSampling] = {api: ProtocolSampling(api) for api in Api}


def reject_logit_bias(body: Mapping[str, Any]) -> None:
    """`logit_bias` only empty or all 0: the engine has no logit bias."""
    logit_bias = body.get("logit_bias")
    if logit_bias is None:
        return
    if not isinstance(logit_bias, dict):
        raise BadRequestError("'logit_bias' must be an object", param="logit_bias")
    if any(bias != 0 for bias in logit_bias.values()):
        raise BadRequestError(
            "'logit_bias' is not supported: the DeepInfer engine cannot apply it; omit it or "
            "send {} (or all biases 0)",
            param="logit_bias",
            kind=ErrorKind.UNSUPPORTED,
        )
