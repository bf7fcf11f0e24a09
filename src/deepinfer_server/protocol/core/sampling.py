"""Sampling parameters the recipe leaves to the server: top_k, and the ones the engine lacks.

DeepInfer 0.1.0's SamplingParams has temperature, top_p and top_k and nothing else that shapes
the distribution: penalties, `min_p` and `logit_bias` are accepted only at their neutral value
(what a client library sends by default), anything else is a 400 naming the parameter.
"""

from __future__ import annotations

from typing import Any

from deepinfer_server.errors import BadRequestError, ErrorKind

_INT32_MAX = 2**31 - 1

#: Parameters the engine cannot honour, with the value that leaves sampling unchanged.
_NEUTRAL: dict[str, float] = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
}


def read_top_k(body: dict[str, Any]) -> int:
    """DeepInfer's top_k from a request: -1 (off) when absent, -1 or 0, else at least 1 (vLLM)."""
    value = body.get("top_k")
    if value is None:
        return -1
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequestError("'top_k' must be an integer", param="top_k")
    if value < -1 or value > _INT32_MAX:
        raise BadRequestError(
            f"'top_k' must be -1 or 0 (disabled) or between 1 and {_INT32_MAX}", param="top_k"
        )
    return -1 if value == 0 else value


def reject_unhonoured_sampling(body: dict[str, Any]) -> None:
    """400 for a sampling parameter the engine cannot apply, unless it has its neutral value."""
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadRequestError(f"'{name}' must be a number", param=name)
        if value != neutral:
            raise _unsupported(name, f"{neutral:g}")
    logit_bias = body.get("logit_bias")
    if logit_bias is not None:
        if not isinstance(logit_bias, dict):
            raise BadRequestError("'logit_bias' must be an object", param="logit_bias")
        if any(bias != 0 for bias in logit_bias.values()):
            raise _unsupported("logit_bias", "{} (or all biases 0)")


def _unsupported(name: str, neutral: str) -> BadRequestError:
    return BadRequestError(
        f"'{name}' is not supported: the DeepInfer engine cannot apply it; omit it or send "
        f"{neutral}",
        param=name,
        kind=ErrorKind.UNSUPPORTED,
    )
