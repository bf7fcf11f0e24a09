"""The typed request bodies: msgspec converts what each protocol's Struct declares, and a
refused field gets its own 400, worded from its declaration (the wording the HTTP tests pin)."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import pytest

from deepinfer_server.errors import BadRequestError
from deepinfer_server.protocol.chat.request import ChatBody
from deepinfer_server.protocol.completions.request import CompletionBody
from deepinfer_server.protocol.core.body import Said, declared_fields, read_body
from deepinfer_server.protocol.core.sampling import SAMPLING, Api

UINT32_MAX = 2**32 - 1
_SALT = "Parameter 'cache_salt' must be a non-empty string if provided."


def _chat(**fields: Any) -> ChatBody:
    return SAMPLING[Api.CHAT].typed({"model": "m", "messages": [], **fields}, ChatBody)


def test_a_valid_body_is_read_typed() -> None:
    typed = _chat(
        n=3,
        ignore_eos=True,
        max_completion_tokens=7,
        cache_salt="s",
        stream_options={"include_usage": True},
        top_k=0,
    )
    assert (typed.n, typed.ignore_eos, typed.max_completion_tokens, typed.cache_salt) == (
        3,
        True,
        7,
        "s",
    )
    assert typed.stream_options is not None and typed.stream_options.include_usage is True
    assert SAMPLING[Api.CHAT].values(typed) == {"top_k": -1}


@pytest.mark.parametrize(
    ("fields", "message", "param"),
    [
        ({"n": 0}, "'n' must be an integer between 1 and 128", "n"),
        ({"n": "2"}, "'n' must be an integer between 1 and 128", "n"),
        ({"n": True}, "'n' must be an integer between 1 and 128", "n"),
        ({"ignore_eos": "yes"}, "'ignore_eos' must be a boolean", "ignore_eos"),
        ({"max_tokens": 1.5}, "'max_tokens' must be an integer", "max_tokens"),
        ({"max_tokens": -1}, f"'max_tokens' must be between 0 and {UINT32_MAX}", "max_tokens"),
        ({"max_tokens": 2**70}, f"'max_tokens' must be between 0 and {UINT32_MAX}", "max_tokens"),
        ({"cache_salt": ""}, _SALT, "cache_salt"),
        ({"cache_salt": 1}, _SALT, "cache_salt"),
        ({"stream_options": 1}, "'stream_options' must be an object", "stream_options"),
        (
            {"stream_options": {"include_usage": 1}},
            "'include_usage' must be a boolean",
            "include_usage",
        ),
        # The first refused field in declaration order: n is declared before cache_salt.
        ({"cache_salt": "", "n": 0}, "'n' must be an integer between 1 and 128", "n"),
        (
            {"top_k": -2},
            f"'top_k' must be -1 or 0 (disabled) or between 1 and {2**31 - 1}",
            "top_k",
        ),
    ],
)
def test_a_refused_field_gets_its_own_400(fields: dict[str, Any], message: str, param: str) -> None:
    with pytest.raises(BadRequestError) as refused:
        _chat(**fields)
    assert (refused.value.message, refused.value.param) == (message, param)


def test_a_field_deepseek_recipe_checks_is_left_to_its_400() -> None:
    """Chat's temperature is the recipe's to refuse: the typed body reads it as absent."""
    typed = _chat(temperature=7, n=2)
    assert (typed.temperature, typed.n) == (None, 2)
    with pytest.raises(BadRequestError, match="'temperature' must be a number between 0 and 2"):
        SAMPLING[Api.COMPLETIONS].typed({"temperature": 7}, CompletionBody)


def test_the_wording_comes_from_the_declaration() -> None:
    class Body(msgspec.Struct, kw_only=True):
        ratio: Annotated[float, msgspec.Meta(ge=0.5)] | None = None
        name: Annotated[str, msgspec.Meta(min_length=1), Said("name it")] | None = None

    assert read_body({"ratio": 1}, Body).ratio == 1.0
    cases: list[tuple[dict[str, Any], str]] = [
        ({"ratio": 0.1}, "'ratio' must be at least 0.5"),
        ({"ratio": "x"}, "'ratio' must be a number"),
        ({"name": ""}, "name it"),
    ]
    for body, message in cases:
        with pytest.raises(BadRequestError) as refused:
            read_body(body, Body)
        assert refused.value.message == message


def test_a_bound_no_wording_fits_gets_msgspecs_own_and_never_a_500() -> None:
    class Body(msgspec.Struct, kw_only=True):
        above: Annotated[int, msgspec.Meta(gt=0)] | None = None
        code: Annotated[str, msgspec.Meta(pattern="^[a-z]+$")] | None = None
        big: Annotated[float, msgspec.Meta(le=4294967295.0)] | None = None
        needed: int = 0

    cases: list[tuple[dict[str, Any], str]] = [
        ({"above": 0}, "'above' is not valid: Expected `int` >= 1"),
        ({"code": "A"}, "'code' is not valid: Expected `str` matching regex"),
        ({"big": 5e9}, "'big' must be at most 4294967295"),
        ({"needed": None}, "'needed' must be an integer"),
    ]
    for body, message in cases:
        with pytest.raises(BadRequestError) as refused:
            read_body(body, Body)
        assert refused.value.message.startswith(message)
        assert refused.value.param == next(iter(body))


def test_a_field_declared_in_a_shape_without_wording_is_refused_at_declaration() -> None:
    class Union(msgspec.Struct, kw_only=True):
        either: int | str | None = None

    class Listed(msgspec.Struct, kw_only=True):
        names: list[str] | None = None

    for struct in (Union, Listed):
        with pytest.raises(TypeError):
            declared_fields(struct)
    assert declared_fields(ChatBody) == ChatBody.__struct_fields__
