"""Decode scheduling under KV pressure: which running sequences step, which are preempted.

As DeepInfer with `stop_preempted_request=False` (the server's setting): a preempted sequence
is requeued at the front of `waiting` for recomputation and its in-flight (deferred) output is
discarded; a structured-output request cannot be recomputed and ends
"insufficient_system_resource".
"""

from __future__ import annotations

import logging
import time

from deepinfer_server.engines.simulated.outputs import OutputRecord
from deepinfer_server.engines.simulated.request_table import RequestTable
from deepinfer_server.engines.simulated.sequence import Sequence

logger = logging.getLogger(__name__)

FINISH_PREEMPTED = "insufficient_system_resource"


def schedule_decode(
    table: RequestTable,
    deferred: list[OutputRecord],
    tokens_per_step: int,
    stop_preempted: bool = False,
) -> tuple[list[Sequence], list[OutputRecord]]:
    """(the sequences that step, in running order; `deferred` without the victims' outputs).

    Victims leave `running` (with their state); recomputable ones go to the front of
    `waiting`, the others get their terminal output appended to the returned records. With
    `stop_preempted` (DeepInfer's `stop_preempted_request`, which a COMPLETION engine requires:
    it cannot recompute a prompt) every victim ends "insufficient_system_resource".
    """
    running = table.running
    scheduled, preempted = table.kv.plan_decode(
        running,
        lambda s: s.request_id,
        lambda s: len(s.output),
        lambda s: s.length + tokens_per_step,
    )
    for victim in preempted:
        logger.info("request %s preempted: no free KV block", victim.request_id)
        table.preempted(victim)
        inflight = sum(r.request_id == victim.request_id for r in deferred)
        deferred = [r for r in deferred if r.request_id != victim.request_id]
        del victim.output[len(victim.output) - inflight :]
        if victim.matcher is not None or stop_preempted:
            deferred.append(victim.ignored_output(FINISH_PREEMPTED))
        else:
            victim.ready_at = time.monotonic()
            table.waiting.insert(0, victim)
    chosen = {id(s) for s in scheduled}
    return [s for s in running if id(s) in chosen], deferred
