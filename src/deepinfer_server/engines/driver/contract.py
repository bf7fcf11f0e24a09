"""DeepInfer 0.1.0's LLMEngine contract as the driver uses it, and the request data it exchanges.

`LLMEngine` and `OutputReader` are the subset of DeepInfer's engine and RequestOutput the driver
calls; `engine_params` is a request's SamplingParams dict; DeepInfer's finish strings become
`Finish` values in `finish_of` and nowhere else.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from deepinfer_server.disaggregation.transfer.connector import KV_TRANSFER_FAILED
from deepinfer_server.ipc.messages import Finish, GeneratedTokens, SamplingOptions

#: DeepInfer's finish-reason strings (csrc/engine/sequence.hpp `get_finished_reason`) as the
#: server's outcomes; anything else (for example "ve_error") is an engine error.
FINISH_REASONS: dict[str, Finish] = {
    "stop": Finish.STOP,
    "length": Finish.LENGTH,
    "abort": Finish.ABORTED,
    "prompt_length_exceeded": Finish.PROMPT_TOO_LONG,
    "insufficient_system_resource": Finish.OUT_OF_RESOURCES,
    "xgrammar runtime errors or timeout": Finish.GRAMMAR_FAILED,
}


class LLMEngine(Protocol):
    """The subset of DeepInfer 0.1.0's LLMEngine that the server drives."""

    eos_id: int

    def add_request(
        self,
        user_id: str,
        request_id: str,
        sampling_params: dict[str, Any] | None,
        prompt_token_ids: npt.NDArray[np.int32],
        multi_modal_data: dict[str, Any] | None = None,
        arrival_time: float | None = None,
        extra: dict[str, Any] | None = None,
    ) -> object | None: ...

    def abort_request(self, request_id: list[str]) -> tuple[int, int]: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> npt.NDArray[np.uint64]: ...

    def flush_inflight_reqs(self) -> npt.NDArray[np.uint64]: ...

    def close(self) -> None: ...


class OutputReader(Protocol):
    """DeepInfer's RequestOutput class: static getters that take a uint64 handle."""

    @staticmethod
    def get_request_id(handle: int) -> str: ...

    @staticmethod
    def get_token_id(handle: int) -> int: ...

    @staticmethod
    def get_finish_reason(handle: int) -> str: ...

    @staticmethod
    def get_token_logprobs(handle: int) -> float: ...

    @staticmethod
    def get_top_logprobs(handle: int) -> list[float]: ...

    @staticmethod
    def get_top_token_ids(handle: int) -> list[int]: ...

    @staticmethod
    def get_prompt_logprobs(handle: int) -> list[float]: ...

    @staticmethod
    def get_draft_tok(handle: int) -> int: ...

    @staticmethod
    def get_accept_tok(handle: int) -> int: ...


def finish_of(reason: str) -> Finish:
    """The outcome of a DeepInfer finish string (unknown strings are engine errors)."""
    if reason.startswith(KV_TRANSFER_FAILED):
        return Finish.KV_TRANSFER_FAILED
    return FINISH_REASONS.get(reason, Finish.ENGINE_ERROR)


def transfer_failure(reason: str) -> str | None:
    """The reason after the colon of a failed transfer's finish string (None: none given)."""
    return reason.partition(":")[2] or None


def engine_params(sampling: SamplingOptions, after_reasoning: int = 0) -> dict[str, Any]:
    """DeepInfer's SamplingParams of a request; `after_reasoning` > 0 for the engine request
    that continues after a forced `</think>` (that many output tokens already generated):
    the output limit left, no prompt logprobs again, and its grammar from the first token (the
    `</think>` that would trigger it is in the prompt)."""
    # A fresh dict per request: DeepInfer mutates the SamplingParams it is given.
    params: dict[str, Any] = {
        "max_tokens": sampling.max_tokens - after_reasoning,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "ignore_eos": sampling.ignore_eos,
        "seq_seed": sampling.seed,
        "top_k": sampling.top_k,
        "top_logprobs": sampling.top_logprobs,
        "prompt_logprobs": sampling.prompt_logprobs and not after_reasoning,
    }
    if sampling.structured is not None:
        so_args = sampling.structured.as_so_args()
        if after_reasoning:
            so_args.pop("trigger_token_ids", None)
        params["so_args"] = so_args
    return params


def append_forced(tokens: GeneratedTokens, token: int) -> None:
    """A token the server forced: certain, so logprob 0 and no other alternative."""
    tokens.token_ids.append(token)
    if tokens.logprobs is not None:
        tokens.logprobs.append(0.0)
        if tokens.top_logprobs is not None:
            tokens.top_logprobs.append([(token, 0.0)])


def empty_tokens(sampling: SamplingOptions) -> GeneratedTokens:
    """A batch that carries the per-token data this request asked for."""
    tokens = GeneratedTokens()
    if sampling.logprobs:
        tokens.logprobs = []
        if sampling.top_logprobs:
            tokens.top_logprobs = []
    return tokens
