"""The one reasoning-effort table, for every API.

Chat Completions `reasoning_effort`, Responses `reasoning.effort` and Anthropic
`output_config.effort` take the same values and reach the prompt the same way: the server
checks the value against this table and passes it to deepseek-recipe, which renders it into the
system prompt as `Reasoning Effort: N` (the table's values are what the recipe renders; a test
reads them from the prompt). `none` turns thinking off, as in vLLM and SGLang; the other values
follow DeepSeek's API: `minimal` and `low` render the lowest effort, `medium`, `high` and
`xhigh` the default, `max` and DeepSeek's `ultra` the highest.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from deepinfer_server.errors import BadRequestError

#: Effort → the `Reasoning Effort: N` of the system prompt; None: thinking off (no line).
EFFORT_PROMPT: Mapping[str, int | None] = MappingProxyType(
    {
        "none": None,
        "minimal": 50,
        "low": 50,
        "medium": 75,
        "high": 75,
        "xhigh": 75,
        "max": 100,
        "ultra": 100,
    }
)
#: The effort rendered when the request names none (thinking on).
DEFAULT_EFFORT_PROMPT = 75

_VALUES = ", ".join(f"'{value}'" for value in EFFORT_PROMPT)


def read_effort(value: Any, param: str) -> str | None:
    """The effort the request names (None: unset), or a 400 naming `param`."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in EFFORT_PROMPT:
        raise BadRequestError(f"'{param}' must be one of {_VALUES}", param=param)
    return value


def check_effort_agrees(effort: str | None, thinking_mode: bool, param: str, enable: str) -> None:
    """A 400 when the effort contradicts the request's thinking mode (the recipe would let the
    explicit thinking setting win and drop the effort): `none` with thinking on, or a reasoning
    effort with thinking off. `enable` says how the request turns thinking on."""
    if effort is None:
        return
    if effort == "none" and thinking_mode:
        raise BadRequestError(
            f"'{param}': 'none' turns thinking off, which this request enables", param=param
        )
    if effort != "none" and not thinking_mode:
        raise BadRequestError(
            f"'{param}' sets the reasoning effort, and thinking is off for this request: "
            f"{enable} to reason with it",
            param=param,
        )
