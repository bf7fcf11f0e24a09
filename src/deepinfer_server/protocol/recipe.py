"""RecipeContext: the deepseek-recipe objects built once per server, and error translation.

This module and its siblings are the only code that touches deepseek-recipe; its exceptions are
translated into the server's ApiError tree here (`recipe_errors`), never above.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import orjson
from deepseek_recipe import (
    ConversionError,
    ConversionOptions,
    DeepseekV41Encoding,
    ModelVersion,
    Tokenizer,
)

from deepinfer_server.errors import ApiError, BadRequestError


@dataclass(frozen=True)
class RecipeContext:
    """Conversion options, the V4.1 prompt encoding and the tokenizer shared by every request."""

    options: ConversionOptions
    encoding: DeepseekV41Encoding
    tokenizer: Tokenizer
    served_model_names: tuple[str, ...]
    context_limit: int

    @classmethod
    def create(
        cls,
        tokenizer_json: str,
        served_model_names: tuple[str, ...],
        context_limit: int,
        default_thinking: bool,
    ) -> RecipeContext:
        tokenizer = Tokenizer.from_str(tokenizer_json)
        # Only the served names are accepted, all as DeepSeek-V4.1-Flash: the recipe's default
        # table would also accept "DeepSeek-V4-Pro" and render it with the wrong encoding.
        options = ConversionOptions(default_thinking_mode=default_thinking)
        options = options.with_model_versions_by_name(
            {name: ModelVersion.DeepseekV41Flash for name in served_model_names}
        )
        encoding = DeepseekV41Encoding().with_tokenizer(tokenizer)
        return cls(options, encoding, tokenizer, served_model_names, context_limit)

    @property
    def model_name(self) -> str:
        """The name responses report."""
        return self.served_model_names[0]


def _conversion_error(exc: ConversionError) -> ApiError:
    message, param, code = str(exc), None, None
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        error = orjson.loads(exc.body)["error"]
        message = error.get("message") or message
        param = error.get("param")
        code = error.get("code")
    return BadRequestError(message, param=param, code=code, status_code=exc.status_code)


@contextlib.contextmanager
def recipe_errors() -> Iterator[None]:
    """Translate deepseek-recipe's request exceptions into BadRequestError (400)."""
    try:
        yield
    except ConversionError as exc:
        raise _conversion_error(exc) from exc
    except ValueError as exc:
        raise BadRequestError(str(exc)) from exc
