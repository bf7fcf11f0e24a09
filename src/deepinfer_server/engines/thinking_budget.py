"""Hard reasoning budgets on an engine with DeepInfer 0.1.0's LLMEngine contract.

DeepInfer has no reasoning budget of its own. When a request has generated its
`thinking_budget` reasoning tokens without `</think>`, the driver ends that engine request
(`abort_request`), and after the next step adds one whose prompt is the old prompt, the
reasoning and `</think>`, with the output limit that is left: the answer follows `</think>`.
Every engine with the contract takes the same path (the simulated engine too). The new engine
request has an ID of its own, so outputs still in flight for the ended one (zero-overhead
scheduling reports a step late) are discarded. It is added one step later so that DeepInfer
has finalized the ended sequence first: with the server's prefix cache, the ended sequence's
prompt is then a cache entry, and the continuation forks from it and prefills only the
reasoning and `</think>`; without the prefix cache it prefills the prompt again as well
(bench/thinking_budget.py measures both on the twin).

DeepInfer's scheduler also offers `fork_seq(..., replace_last_token_id, ...)`
(csrc/engine/scheduler.hpp), which forks a running sequence with its last token replaced and
recomputes only that position. Using it means owning what the LLMEngine contract hides: the
parent's blocks and shared state slot once its in-flight outputs are flushed, the engine's
request maps for the fork, its structured-output matcher. It is the cheaper path (one position
instead of the reasoning) for a GPU build to measure against this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from deepinfer_server.ipc.messages import AddRequest

#: Suffix of the engine request that continues a request after its budget ran out.
CONTINUATION_SUFFIX = "/think-end"


@dataclass
class BudgetedRequest:
    """One live request with a reasoning budget that is still reasoning."""

    request: AddRequest
    prompt: npt.NDArray[np.int32]
    budget: int
    end_id: int
    #: Every token the engine generated for it so far (reasoning, EOS under ignore_eos too).
    generated: list[int] = field(default_factory=list)
    reasoning: int = 0

    def push(self, token: int) -> bool:
        """Record a generated token; True when the budget is spent (`</think>` is due)."""
        self.generated.append(token)
        self.reasoning += 1
        return self.reasoning >= self.budget

    def continuation_prompt(self) -> npt.NDArray[np.int32]:
        """The prompt of the engine request that continues after the forced `</think>`."""
        tail = np.asarray([*self.generated, self.end_id], dtype=np.int32)
        return np.concatenate([self.prompt.astype(np.int32, copy=False), tail])


class ThinkingBudgets:
    """The budgeted requests of one driver that are still reasoning, and the engine request
    IDs that stand for a request."""

    def __init__(self) -> None:
        self._reasoning: dict[str, BudgetedRequest] = {}
        #: Engine request ID → the request it continues.
        self._continuations: dict[str, str] = {}
        #: Engine request IDs whose outputs are discarded (ended at a budget).
        self._retired: set[str] = set()

    def track(self, request: AddRequest, prompt: npt.NDArray[np.int32]) -> bool:
        """Follow a request with a budget; True when the budget is 0 (`</think>` is due at
        once)."""
        sampling = request.sampling
        if sampling.thinking_budget is None or sampling.thinking_end_id < 0:
            return False
        tracked = BudgetedRequest(
            request, prompt, sampling.thinking_budget, sampling.thinking_end_id
        )
        self._reasoning[request.request_id] = tracked
        return tracked.budget <= 0

    def request_of(self, engine_id: str) -> str | None:
        """The request an engine request's outputs belong to (None: discard them)."""
        if engine_id in self._retired:
            return None
        return self._continuations.get(engine_id, engine_id)

    def engine_id(self, request_id: str) -> str:
        """The engine request that currently stands for `request_id`."""
        continuation = request_id + CONTINUATION_SUFFIX
        return continuation if continuation in self._continuations else request_id

    def reasoning(self, request_id: str) -> BudgetedRequest | None:
        """The request's budget while it is still reasoning."""
        return self._reasoning.get(request_id)

    def reasoning_ended(self, request_id: str) -> None:
        """The model wrote `</think>` itself: the budget has nothing left to do."""
        self._reasoning.pop(request_id, None)

    def continue_after_budget(self, request_id: str) -> tuple[str, BudgetedRequest]:
        """Retire the request's engine request; the ID of the one that continues it."""
        tracked = self._reasoning.pop(request_id)
        self._retired.add(request_id)
        continuation = request_id + CONTINUATION_SUFFIX
        self._continuations[continuation] = request_id
        return continuation, tracked

    def forget(self, request_id: str) -> None:
        """The request ended: drop everything kept for it."""
        self._reasoning.pop(request_id, None)
        self._retired.discard(request_id)
        self._continuations.pop(request_id + CONTINUATION_SUFFIX, None)
