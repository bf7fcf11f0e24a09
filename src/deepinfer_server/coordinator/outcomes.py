"""The client-facing errors of engine outcomes: finishes that are not normal, rejections."""

from __future__ import annotations

from deepinfer_server.errors import ApiError, ContextLengthError, EngineRequestError, ErrorKind
from deepinfer_server.ipc.messages import Finish, RequestRejected

_FINISH_ERRORS: dict[Finish, tuple[ErrorKind, str]] = {
    Finish.PROMPT_TOO_LONG: (
        ErrorKind.CONTEXT_LENGTH_EXCEEDED,
        "the prompt is longer than the engine accepts",
    ),
    Finish.OUT_OF_RESOURCES: (
        ErrorKind.ENGINE_OUT_OF_RESOURCES,
        "the engine ran out of KV-cache memory for this request; retry later",
    ),
    # The driver reports only the aborts it did not ask for: in DeepInfer 0.1.0 those are its
    # multimodal processor's (`fetch_to_abort_requests`), for images it could not prepare.
    Finish.ABORTED: (
        ErrorKind.ENGINE_ABORTED,
        "the engine aborted the request: it could not prepare the request's images",
    ),
    Finish.GRAMMAR_FAILED: (
        ErrorKind.ENGINE_GRAMMAR_FAILED,
        "the engine's structured-output grammar failed for this request (xgrammar error or "
        "timeout)",
    ),
    Finish.ENGINE_ERROR: (ErrorKind.ENGINE_ABORTED, "the engine ended the request with an error"),
}


_KV_TRANSFER_REASONS = {
    "timeout": "the prefill server did not deliver the prompt's KV in time",
    "no_kv_room": "no KV room for the prompt freed up in time on this decode server",
    "transfer_error": "the prefill server's KV could not be read (is it still running?)",
    "kv_mismatch": "the pulled KV does not hold this request's prompt",
    "peer_unhealthy": "a KV pull from that prefill server timed out recently: it is skipped",
}


def error_for_finish(finish: Finish, detail: str | None = None) -> ApiError:
    """The error a client sees for an engine finish other than STOP or LENGTH (`detail`: the
    engine's reason, for a failed KV transfer)."""
    if finish is Finish.KV_TRANSFER_FAILED:
        reason = detail or "transfer_error"
        explained = _KV_TRANSFER_REASONS.get(reason, "the KV transfer failed")
        return EngineRequestError(
            f"KV transfer failed ({reason}): {explained}", kind=ErrorKind.KV_TRANSFER_FAILED
        )
    kind, message = _FINISH_ERRORS[finish]
    if kind is ErrorKind.CONTEXT_LENGTH_EXCEEDED:
        return ContextLengthError(message)
    return EngineRequestError(message, kind=kind)


def error_for_rejection(message: RequestRejected) -> ApiError:
    """The error a client sees when the engine refused its request at add time."""
    return EngineRequestError(message.message, kind=message.kind)
