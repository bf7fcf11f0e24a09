"""deliver_step: a rank's step outputs handed to the requests they belong to."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.coordinator.outcomes import error_for_finish
from deepinfer_server.ipc.messages import StepOutputs


def deliver_step(
    message: StepOutputs,
    handles: Mapping[str, RequestHandle],
    now: float,
    engine_done: Callable[[str], None],
    to_flush: list[RequestHandle],
) -> None:
    """Each delta to its request's handle (a request no longer in flight is skipped):
    `engine_done(request_id)` for each the engine ended, and the handles whose sinks are due
    appended to `to_flush`; a request that ended abnormally fails with its finish's error."""
    step_seconds = message.step_seconds
    for delta in message.deltas:
        handle = handles.get(delta.request_id)
        if handle is None:
            continue
        if delta.cached_tokens is not None:
            handle.started(delta.cached_tokens, delta.written_tokens or 0)
        if delta.kv_transfer_params is not None:
            handle.kv_transfer_params = delta.kv_transfer_params
        finish = delta.finish
        if finish is not None:
            engine_done(delta.request_id)
        if finish is None or finish.is_normal:
            if handle.deliver(delta.tokens, finish, now, step_seconds):
                to_flush.append(handle)
        else:
            handle.deliver(delta.tokens, None, now, step_seconds)
            handle.fail(error_for_finish(finish, delta.detail), engine_finished=True)
