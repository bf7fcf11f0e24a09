"""A request's hard reasoning budget, as the engine gets it.

Anthropic's `thinking.budget_tokens` and vLLM's `thinking_token_budget` become
`SamplingOptions.thinking_budget`: once the request has generated that many reasoning tokens,
the engine driver makes `</think>` the next token and the answer follows
(`engines/thinking_budget.py`). The output limit (`max_tokens`) still counts reasoning and
answer together; so that a budget never lets reasoning leave the answer no room, the budget is
capped at half of the output limit: the answer keeps at least half of `max_tokens`.
A request that does not think (its prompt ends in `</think>`) generates no reasoning and
needs no budget: the budget is honoured as it stands and the engine gets none.
"""

from __future__ import annotations

import msgspec

from deepinfer_server.errors import BadRequestError
from deepinfer_server.ipc.messages import SamplingOptions
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.sampling import EngineValues


def budgeted(sampling: SamplingOptions, thinking: bool, think_end_id: int) -> SamplingOptions:
    """`sampling` with its reasoning budget capped at half of max_tokens and `</think>`'s ID,
    or without a budget when the request does not think."""
    budget = sampling.thinking_budget
    if budget is None:
        return sampling
    if not thinking:
        return msgspec.structs.replace(sampling, thinking_budget=None)
    return msgspec.structs.replace(
        sampling,
        thinking_budget=min(budget, sampling.max_tokens // 2),
        thinking_end_id=think_end_id,
    )


def read_budget(body: JsonObject) -> int | None:
    """`thinking.budget_tokens` of an enabled `thinking` (Anthropic's field, which Chat
    Completions' `thinking` also takes), None without one, or a 400."""
    thinking = body.get("thinking")
    if not isinstance(thinking, dict) or thinking.get("type") != "enabled":
        return None
    budget = thinking.get("budget_tokens")
    if budget is None:
        return None
    if budget.__class__ is bool or not isinstance(budget, int) or budget < 0:
        raise BadRequestError(
            "'thinking.budget_tokens' must be a non-negative integer",
            param="thinking.budget_tokens",
        )
    return budget


def merge_budgets(sampling: EngineValues, body: JsonObject) -> None:
    """Put `thinking.budget_tokens` into the checked sampling fields (`thinking_budget`); a
    400 when it and `thinking_token_budget` disagree."""
    budget = read_budget(body)
    if budget is None:
        return
    other = sampling.get("thinking_budget")
    if other is not None and other != budget:
        raise BadRequestError(
            "'thinking.budget_tokens' and 'thinking_token_budget' disagree: send one",
            param="thinking.budget_tokens",
        )
    sampling["thinking_budget"] = budget
