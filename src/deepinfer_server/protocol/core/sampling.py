"""The sampling fields of every protocol, declared once.

Each `SamplingField` says which protocols take the field, its bounds, who checks it and which
`SamplingOptions` field it fills. From the declaration come, per protocol (`SAMPLING`), the
server's checks and their 400s (`ProtocolSampling.read`), the one mapping to the engine's
options (`ProtocolSampling.options`), and the OpenAPI schemas (`openapi/fields.py`). A new
sampling field is one entry in `SAMPLING_FIELDS` (plus the engine's side of its
`SamplingOptions` field).

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
from typing import Any

from deepseek_recipe import InferenceOptions

from deepinfer_server.errors import BadRequestError, ErrorKind
from deepinfer_server.ipc.messages import SamplingOptions

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
class SamplingField:
    """One sampling field of the request bodies."""

    name: str
    #: `int` or `float`: what JSON value the field takes (a boolean is neither).
    kind: type[int] | type[float]
    minimum: float
    maximum: float
    apis: frozenset[Api]
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
    #: The OpenAPI description.
    description: str = ""
    #: The JSON value types it takes (an exact int, or any number); a bool is never one.
    _types: type | tuple[type, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        exact_int = self.kind is int and self.neutral is None
        object.__setattr__(self, "_types", int if exact_int else (int, float))

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
            raise BadRequestError(self.range_message or self._type_message(), param=self.name)
        if self.kind is float:
            value = float(value)
        return value if self.to_engine is _same else self.to_engine(value)

    def _type_message(self) -> str:
        if self.neutral is not None:
            return f"'{self.name}' must be a number"
        if self.kind is int:
            return f"'{self.name}' must be an integer"
        return f"'{self.name}' must be a number between {self.minimum:g} and {self.maximum:g}"


_OPENAI = frozenset({Api.CHAT, Api.COMPLETIONS})


def _neutral(name: str, value: float, kind: type[int] | type[float], lacks: str) -> SamplingField:
    return SamplingField(
        name,
        kind,
        value,
        value,
        _OPENAI,
        neutral=value,
        description=f"Accepted only as {value:g}: the engine has no {lacks}",
    )


#: Every sampling field, in the order the server checks them.
SAMPLING_FIELDS: tuple[SamplingField, ...] = (
    _neutral("presence_penalty", 0.0, float, "penalties"),
    _neutral("frequency_penalty", 0.0, float, "penalties"),
    _neutral("repetition_penalty", 1.0, float, "penalties"),
    _neutral("min_p", 0.0, float, "min_p"),
    # DeepInfer can keep EOS off the first generated token only (`first_n_token_no_eos`), not
    # off the first n, and never stop strings: vLLM's min_tokens is refused beyond 0.
    _neutral("min_tokens", 0, int, "minimum length (vLLM's min_tokens)"),
    SamplingField(
        "temperature",
        float,
        0,
        2,
        frozenset(Api),
        option="temperature",
        recipe_checked=CONVERTED,
    ),
    SamplingField(
        # deepseek-recipe's range is (0, 1] in 32-bit floats (a 64-bit denormal rounds to 0).
        "top_p",
        float,
        1e-9,
        1,
        frozenset(Api),
        option="top_p",
        recipe_checked=CONVERTED,
    ),
    SamplingField(
        "top_k",
        int,
        -1,
        INT32_MAX,
        frozenset({Api.CHAT, Api.COMPLETIONS, Api.MESSAGES}),
        option="top_k",
        range_message=f"'top_k' must be -1 or 0 (disabled) or between 1 and {INT32_MAX}",
        # DeepInfer's off is -1 only; vLLM's clients also send 0.
        to_engine=lambda value: -1 if value == 0 else value,
        description="-1 or 0 disable it (vLLM's extension)",
    ),
    SamplingField(
        # vLLM's hard reasoning budget (Responses: this server's extension, same name).
        "thinking_token_budget",
        int,
        0,
        INT32_MAX,
        frozenset({Api.CHAT, Api.COMPLETIONS, Api.RESPONSES}),
        option="thinking_budget",
        range_message=f"'thinking_token_budget' must be between 0 and {INT32_MAX}",
        description="vLLM's extension: the most reasoning tokens; then `</think>` is forced "
        "and the answer follows",
    ),
    SamplingField(
        # deepseek-recipe's range; DeepInfer takes any uint64.
        "seed",
        int,
        0,
        SEED_MAX,
        _OPENAI,
        option="seed",
        recipe_checked=frozenset({Api.CHAT}),
        range_message=f"'seed' must be between 0 and {SEED_MAX}",
    ),
)


class ProtocolSampling:
    """One protocol's sampling fields: the server's checks of its body, and its engine options."""

    __slots__ = ("_checked", "_from_recipe", "api", "fields")

    def __init__(self, api: Api) -> None:
        self.api = api
        #: The fields `api`'s body takes, in declaration order.
        self.fields = tuple(field for field in SAMPLING_FIELDS if api in field.apis)
        # The fields the server checks itself (deepseek-recipe checks the others), and the
        # SamplingOptions fields deepseek-recipe's InferenceOptions fills.
        self._checked = tuple(
            (field.name, field) for field in self.fields if api not in field.recipe_checked
        )
        self._from_recipe = tuple(
            field.option
            for field in self.fields
            if api in field.recipe_checked and field.option is not None
        )

    def read(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Check the fields the server checks: the engine's values of the present ones, by
        `SamplingOptions` field name (a 400 naming the field otherwise)."""
        values: dict[str, Any] = {}
        for name, field in self._checked:
            value = body.get(name)
            if value is not None:
                checked = field.check(value)
                if field.option is not None:
                    values[field.option] = checked
        return values

    def options(
        self, read: Mapping[str, Any], inference: InferenceOptions | None = None, **rest: Any
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
