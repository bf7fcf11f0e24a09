"""The speculative-decoding family, named as vLLM's (zero while it is off)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import Metric

from deepinfer_server.ipc.messages import EngineCounters
from deepinfer_server.metrics.declare import counter_family


def speculation_totals(labels: list[str], ranks: list[EngineCounters]) -> Iterator[Metric]:
    """The ranks' drafts, draft tokens and accepted tokens, summed over the ranks."""
    families = (
        ("spec_decode_num_drafts", "Decode steps of a sequence that verified draft tokens."),
        ("spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
        ("spec_decode_num_accepted_tokens", "Draft tokens accepted (emitted as output)."),
    )
    totals = (
        sum(c.spec_drafts for c in ranks),
        sum(c.spec_draft_tokens for c in ranks),
        sum(c.spec_accepted_tokens for c in ranks),
    )
    for (name, doc), total in zip(families, totals, strict=True):
        family = counter_family(name, doc + " Over every DP rank.")
        family.add_metric(labels, total)
        yield family
    per_position = counter_family(
        "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted at each draft position (0: the first draft of a step), over "
        "every DP rank.",
        "position",
    )
    by_position: list[int] = []
    for counters in ranks:
        for position, count in enumerate(counters.spec_accepted_per_position):
            if position == len(by_position):
                by_position.append(0)
            by_position[position] += count
    for position, count in enumerate(by_position):
        per_position.add_metric([*labels, str(position)], count)
    yield per_position
