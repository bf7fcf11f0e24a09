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

from deepinfer_server.ipc.messages import SamplingOptions


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
