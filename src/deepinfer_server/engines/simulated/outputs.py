"""RequestOutput handles with DeepInfer's one-step lifetime (contract §3.3-3.4, §9.3).

`step()` returns uint64 handles; each names one token's output and is released during the
next `step()`. Unlike DeepInfer, where a stale handle is a silent use-after-free, reading a
released handle here raises, so an adapter that holds handles too long fails in tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

POOL_CAPACITY = 10_000


@dataclass(slots=True)
class OutputRecord:
    """The fields of one DeepInfer RequestOutput (set by the engine, read-only to callers)."""

    request_id: str
    prompt_len: int
    token_id: int
    finish_reason: str = ""
    finished: bool = False
    token_logprobs: float = 0.0
    nextn_logprobs: float = 1.0
    sum_smaller_probs: float = -1.0
    top_logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    draft_tok: int = 0
    accept_tok: int = 0
    confidence_score: list[float] | None = None
    max_num_batched_tokens: int = 0
    #: Fills the logprob fields on first read (they cost more than the rest of a step).
    deferred: Callable[[OutputRecord], None] | None = None

    def materialised(self) -> OutputRecord:
        """This record with every field computed."""
        if self.deferred is not None:
            deferred, self.deferred = self.deferred, None
            deferred(self)
        return self


class OutputPool:
    """Live output records by handle; capacity and release behave as DeepInfer's pool."""

    def __init__(self) -> None:
        self._live: dict[int, OutputRecord] = {}
        self._next_handle = 1

    def publish(self, records: list[OutputRecord]) -> npt.NDArray[np.uint64]:
        """Give each record a handle; raises RuntimeError when the pool is exhausted."""
        if len(self._live) + len(records) > POOL_CAPACITY:
            raise RuntimeError("RequestOutputPool exhausted: outputs were never released")
        handles = np.empty(len(records), dtype=np.uint64)
        for index, record in enumerate(records):
            handle = self._next_handle
            self._next_handle += 1
            self._live[handle] = record
            handles[index] = handle
        return handles

    def release(self, handles: npt.NDArray[np.uint64]) -> None:
        """Destroy these outputs; later reads of their handles raise."""
        for handle in handles.tolist():
            self._live.pop(int(handle), None)

    def get(self, handle: int) -> OutputRecord:
        try:
            return self._live[int(handle)]
        except KeyError:
            raise RuntimeError(
                f"RequestOutput handle {int(handle)} was released by a later step(): "
                "read or clone outputs before calling step() again"
            ) from None


POOL = OutputPool()


class Published:
    """The handles an engine returned, each valid until its next `step()` releases it."""

    def __init__(self) -> None:
        self._live: list[npt.NDArray[np.uint64]] = []

    def __len__(self) -> int:
        """The handles held until the next release."""
        return sum(len(handles) for handles in self._live)

    def publish(self, records: list[OutputRecord]) -> npt.NDArray[np.uint64]:
        """Handles for these records, held until `release`."""
        handles = POOL.publish(records)
        self._live.append(handles)
        return handles

    def release(self) -> None:
        """Release every handle published so far (their reads raise from now on)."""
        for handles in self._live:
            POOL.release(handles)
        self._live.clear()


class RequestOutput:
    """DeepInfer's `deepinfer._C.engine.RequestOutput`: static getters on handles, or clones."""

    def __init__(self, record: OutputRecord) -> None:
        self._record = record

    def __getattr__(self, name: str) -> object:
        return getattr(self._record, name)

    @staticmethod
    def clone(handle: int) -> RequestOutput:
        return RequestOutput(POOL.get(handle).materialised())

    @staticmethod
    def get_request_id(handle: int) -> str:
        return POOL.get(handle).request_id

    @staticmethod
    def get_prompt_len(handle: int) -> int:
        return POOL.get(handle).prompt_len

    @staticmethod
    def get_token_id(handle: int) -> int:
        return POOL.get(handle).token_id

    @staticmethod
    def get_finish_reason(handle: int) -> str:
        return POOL.get(handle).finish_reason

    @staticmethod
    def get_finished(handle: int) -> bool:
        return POOL.get(handle).finished

    @staticmethod
    def get_token_logprobs(handle: int) -> float:
        return POOL.get(handle).materialised().token_logprobs

    @staticmethod
    def get_nextn_logprobs(handle: int) -> float:
        return POOL.get(handle).nextn_logprobs

    @staticmethod
    def get_sum_smaller_probs(handle: int) -> float:
        return POOL.get(handle).sum_smaller_probs

    @staticmethod
    def get_top_logprobs(handle: int) -> list[float]:
        return POOL.get(handle).materialised().top_logprobs

    @staticmethod
    def get_top_token_ids(handle: int) -> list[int]:
        return POOL.get(handle).materialised().top_token_ids

    @staticmethod
    def get_prompt_logprobs(handle: int) -> list[float]:
        return POOL.get(handle).materialised().prompt_logprobs

    @staticmethod
    def get_num_output_tokens(handle: int) -> int:
        return POOL.get(handle).num_output_tokens

    @staticmethod
    def get_draft_tok(handle: int) -> int:
        return POOL.get(handle).draft_tok

    @staticmethod
    def get_accept_tok(handle: int) -> int:
        return POOL.get(handle).accept_tok

    @staticmethod
    def get_confidence_score(handle: int) -> list[float] | None:
        return POOL.get(handle).confidence_score
