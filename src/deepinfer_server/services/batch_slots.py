"""The running slots a batch line may take: counted in engine requests, idle ones only.

A line is one HTTP request but as many engine requests as its prompts times its choices (`n`),
each with an admission slot of its own, so the runner weighs each line by that count
(`engine_requests`) against the slots idle now (`IdleSlots`). Admission sees a line's engine
requests only once its request has been prepared, a while after the line is claimed: the runner
counts the engine requests of its lines itself and takes from admission's count only those it
can tell are its own (`IdleSlots.admitted`), so a line claimed but not yet admitted is never
left out nor counted twice in a way that lets batch work overfill the server.

A line wider than the most batch work may ever take (every running slot but the one kept for
interactive requests) runs alone, and only on a server with nothing else admitted: its engine
requests past the running slots wait in the queue, within its key's share of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


def engine_requests(body: Mapping[str, object]) -> int:
    """The engine requests a line's request body makes: one per prompt (a completions
    `prompt` array of texts or of token-ID arrays) and choice (`n`); a count the endpoint will
    refuse counts as one."""
    n = body.get("n")
    choices = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return choices
    texts = all(isinstance(item, str) for item in prompt)
    arrays = all(isinstance(item, list) for item in prompt)
    return choices * (len(prompt) if texts or arrays else 1)


def _unlimited() -> int:
    return 1 << 30


def _none() -> int:
    return 0


@dataclass(frozen=True)
class IdleSlots:
    """How the batch runner sees the server's running slots (the server's state answers;
    the defaults: unlimited)."""

    #: The most batch work may take: every running slot but the one kept for interactive
    #: requests.
    most: int = 1 << 30
    #: The running slots idle now, every process's admitted requests counted (below zero while
    #: requests wait in the queue), the one kept for interactive requests left out.
    idle: Callable[[], int] = _unlimited
    #: At least how many of the engine requests admission holds now are this process's batch
    #: lines'.
    admitted: Callable[[], int] = _none

    def budget(self, own: int) -> int:
        """The engine requests new lines may make now, while this process's lines in flight
        make `own` (some of which admission may not hold yet)."""
        return self.idle() - (own - min(own, self.admitted()))

    def fits(self, cost: int, own: int) -> bool:
        """Whether a line of `cost` engine requests may start now, beside lines making `own`:
        within the budget, or wider than any budget and alone on an idle server."""
        budget = self.budget(own)
        return cost <= budget or (own == 0 and cost > self.most and budget >= self.most)
