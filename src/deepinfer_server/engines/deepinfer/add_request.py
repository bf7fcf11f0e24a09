"""DeepInfer's `LLMEngine.add_request` arguments, as the server's engine subclasses pass them on."""

from __future__ import annotations

from typing import Any


def add_request_args(
    user_id: str,
    request_id: str,
    sampling_params: Any,
    prompt_token_ids: Any,
    multi_modal_data: Any = None,
    arrival_time: float | None = None,
    extra: Any = None,
    enqueue: bool = True,
    chunk_checkpoints: Any = None,
) -> tuple[Any, ...]:
    """All nine arguments of DeepInfer 0.1.0's `add_request`, positionally and with its
    defaults, however the caller passed them."""
    return (
        user_id,
        request_id,
        sampling_params,
        prompt_token_ids,
        multi_modal_data,
        arrival_time,
        extra,
        enqueue,
        chunk_checkpoints,
    )
