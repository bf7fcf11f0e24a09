"""ReasoningBudgets: the driver's side of hard reasoning budgets (`engines.thinking_budget`).

A request with a reasoning budget (`SamplingOptions.thinking_budget`) is followed while it
reasons; when the budget is spent, `</think>` is forced by ending its engine request and adding,
after the next step, one that continues from the prompt, the reasoning and `</think>`. A budget
of 0 forces `</think>` before any output: the engine request starts after it, or there is none
when `</think>` is the whole output.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from deepinfer_server.engines.driver.aborts import UnplacedAborts
from deepinfer_server.engines.driver.contract import append_forced, empty_tokens
from deepinfer_server.engines.thinking_budget import BudgetedRequest, ThinkingBudgets
from deepinfer_server.ipc.messages import AddRequest, Finish, RequestDelta, SamplingOptions


@dataclass(frozen=True)
class EngineStart:
    """How a request enters the engine: its engine request ID, the prompt it is given and the
    output tokens already forced before it."""

    engine_id: str
    prompt: npt.NDArray[np.int32]
    after_reasoning: int = 0


@dataclass(frozen=True)
class DueContinuation:
    """A request whose budget ran out: its continuation is added after the next step."""

    request_id: str
    engine_id: str
    tracked: BudgetedRequest
    left: int


class ReasoningBudgets(ThinkingBudgets):
    """The budgeted requests of one driver, the `</think>` forced first and the continuations
    due."""

    def __init__(self) -> None:
        super().__init__()
        #: Requests whose `</think>` is forced before any output (a budget of 0).
        self.forced_first: set[str] = set()
        #: Requests whose budget ran out in the last read: their continuation is added after
        #: the next step, once DeepInfer has finalized the aborted sequence (and a prefix cache
        #: has kept its prompt for the continuation to fork from).
        self.due: list[DueContinuation] = []

    def start(self, request: AddRequest, prompt: npt.NDArray[np.int32]) -> EngineStart | None:
        """How `request` enters the engine; None when `</think>` is its whole output (no
        engine request: `emit_forced_first` answers it)."""
        request_id = request.request_id
        if not self.track(request, prompt):
            return EngineStart(request_id, prompt)
        assert self.reasoning(request_id) is not None
        self.forced_first.add(request_id)
        if request.sampling.max_tokens < 2:
            self.forget(request_id)
            return None
        engine_id, tracked = self.continue_after_budget(request_id)
        return EngineStart(engine_id, tracked.continuation_prompt(), after_reasoning=1)

    def refused(self, request_id: str) -> None:
        """The engine refused the request: nothing is followed for it."""
        self.forget(request_id)
        self.forced_first.discard(request_id)

    def abort(self, request_id: str, sampling: SamplingOptions, aborts: UnplacedAborts) -> None:
        """Abort the engine request that stands for `request_id`, if there is one."""
        if request_id in self.forced_first:
            self.forced_first.discard(request_id)
            if sampling.max_tokens < 2:  # the engine never had it
                return
        engine_id = self.engine_id(request_id)
        self.forget(request_id)
        due = [entry for entry in self.due if entry.request_id == request_id]
        if due:  # its engine request already ended and its continuation is not added yet
            self.due.remove(due[0])
            return
        aborts.abort(engine_id)

    def emit_forced_first(
        self, live: dict[str, SamplingOptions], by_request: dict[str, RequestDelta]
    ) -> None:
        """The forced `</think>` of requests with a budget of 0, before their first output."""
        for request_id in self.forced_first:
            sampling = live.get(request_id)
            if sampling is not None:
                delta = by_request[request_id] = RequestDelta(request_id, empty_tokens(sampling))
                append_forced(delta.tokens, sampling.thinking_end_id)
                if sampling.max_tokens < 2:  # nothing left for an answer
                    delta.finish = Finish.LENGTH
                    del live[request_id]
        self.forced_first.clear()

    def end_reasoning(
        self, request_id: str, tracked: BudgetedRequest, delta: RequestDelta, aborts: UnplacedAborts
    ) -> Finish | None:
        """The budget is spent: force `</think>` (a token of this delta) and end the engine
        request; the one that continues after `</think>` is added after the next step. The
        request's finish when no output token is left for an answer."""
        continuation, tracked = self.continue_after_budget(request_id)
        aborts.abort(request_id)
        append_forced(delta.tokens, tracked.end_id)
        left = tracked.request.sampling.max_tokens - len(tracked.generated) - 1
        if left < 1:
            return Finish.LENGTH
        self.due.append(DueContinuation(request_id, continuation, tracked, left))
        return None

    def take_due(self) -> list[DueContinuation]:
        """The continuations to add after this step."""
        due, self.due = self.due, []
        return due
