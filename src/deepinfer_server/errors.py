"""The server's exception tree and the one table from error kind to what a client sees.

    ServerError
    ├── ConfigError               invalid command line or checkpoint; the CLI exits with code 2
    ├── StartupError              a rank failed to start, or did not become ready in time
    ├── LockstepViolation         DP ranks left lockstep (simulated collectives)
    └── ApiError                  one request fails; carries an ErrorKind, a message, a param
        ├── BadRequestError       400 (kind BAD_REQUEST unless told otherwise)
        ├── ContextLengthError    400 context_length_exceeded
        ├── AuthenticationError   401
        ├── ModelNotFoundError    404
        ├── StoredObjectNotFound  404 a stored response or item (or 400: a previous response)
        ├── RequestTimeoutError   408 (request or body timeout)
        ├── RequestTooLargeError  413
        ├── RetryLaterError       an error sent with Retry-After
        │   ├── OverloadedError   429
        │   │   └── QueueTimeoutError no first token within --queue-timeout
        │   └── GrammarCapacityError 503: no grammar compile worker free in time
        ├── EngineRequestError    the engine refused or ended one request (kind says how)
        ├── ServiceUnavailableError 503
        │   ├── ShuttingDownError the server is draining or stopping
        │   └── ServiceFailedError a rank failed; the service needs a restart
        ├── StoreUnavailableError 503 the Responses store cannot be read or written
        ├── ClientDisconnected    the client left (never sent; counted as 499)
        └── InternalError         a bug: 500, logged with its traceback and request ID

`ErrorKind` travels on the wire (a rank rejecting a request) and keys `ERROR_TABLE`, the only
place that says which HTTP status and which OpenAI / Anthropic error type a failure has. The
envelopes themselves are built per protocol in `protocol/core/error_shapes.py` from this table.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class ErrorKind(enum.StrEnum):
    """Every way a request can fail, as clients and metrics tell them apart."""

    BAD_REQUEST = "bad_request"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    UNSUPPORTED = "unsupported"
    AUTHENTICATION = "authentication"
    NOT_FOUND = "not_found"
    MODEL_NOT_FOUND = "model_not_found"
    RESPONSE_NOT_FOUND = "response_not_found"
    PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"
    ITEM_NOT_FOUND = "item_not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    REQUEST_TIMEOUT = "request_timeout"
    REQUEST_TOO_LARGE = "request_too_large"
    URI_TOO_LONG = "uri_too_long"
    HEADERS_TOO_LARGE = "headers_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    OVERLOADED = "overloaded"
    ENGINE_REJECTED = "engine_rejected"
    ENGINE_OUT_OF_RESOURCES = "engine_out_of_resources"
    ENGINE_ABORTED = "engine_aborted"
    ENGINE_GRAMMAR_FAILED = "engine_grammar_failed"
    ENGINE_ERROR = "engine_error"
    SHUTTING_DOWN = "shutting_down"
    SERVICE_FAILED = "service_failed"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    STORE_UNAVAILABLE = "store_unavailable"
    CLIENT_DISCONNECTED = "client_disconnected"
    INTERNAL = "internal"
    THREAD_UNSUPPORTED = "thread_unsupported"
    QUEUE_TIMEOUT = "queue_timeout"
    GRAMMAR_CAPACITY = "grammar_capacity"
    RECEIVE_BUFFER_FULL = "receive_buffer_full"
    KV_TRANSFER_FAILED = "kv_transfer_failed"
    KV_HANDOFF_UNVERIFIED = "kv_handoff_unverified"


@dataclass(frozen=True, slots=True)
class ErrorSpec:
    """How one error kind looks to clients."""

    status: int
    openai_type: str
    openai_code: str | None
    anthropic_type: str
    #: Anthropic's `error.details.error_code`, for the errors its SDK branches on.
    anthropic_code: str | None = None


#: The one table from error kind to HTTP status and each protocol's error type and code.
ERROR_TABLE: dict[ErrorKind, ErrorSpec] = {
    ErrorKind.BAD_REQUEST: ErrorSpec(400, "invalid_request_error", None, "invalid_request_error"),
    ErrorKind.CONTEXT_LENGTH_EXCEEDED: ErrorSpec(
        400, "invalid_request_error", "context_length_exceeded", "invalid_request_error"
    ),
    ErrorKind.UNSUPPORTED: ErrorSpec(
        400, "invalid_request_error", "unsupported_parameter", "invalid_request_error"
    ),
    ErrorKind.AUTHENTICATION: ErrorSpec(
        401, "invalid_request_error", "invalid_api_key", "authentication_error"
    ),
    ErrorKind.NOT_FOUND: ErrorSpec(404, "not_found_error", "not_found", "not_found_error"),
    ErrorKind.MODEL_NOT_FOUND: ErrorSpec(
        404, "invalid_request_error", "model_not_found", "not_found_error"
    ),
    ErrorKind.RESPONSE_NOT_FOUND: ErrorSpec(
        404, "not_found_error", "response_not_found", "not_found_error"
    ),
    # OpenAI answers an unknown `previous_response_id` with a 400 naming the parameter.
    ErrorKind.PREVIOUS_RESPONSE_NOT_FOUND: ErrorSpec(
        400, "invalid_request_error", "previous_response_not_found", "invalid_request_error"
    ),
    ErrorKind.ITEM_NOT_FOUND: ErrorSpec(
        404, "not_found_error", "item_not_found", "not_found_error"
    ),
    ErrorKind.METHOD_NOT_ALLOWED: ErrorSpec(
        405, "invalid_request_error", "method_not_allowed", "invalid_request_error"
    ),
    ErrorKind.REQUEST_TIMEOUT: ErrorSpec(408, "timeout_error", "request_timeout", "timeout_error"),
    ErrorKind.REQUEST_TOO_LARGE: ErrorSpec(
        413, "invalid_request_error", "request_too_large", "request_too_large"
    ),
    ErrorKind.URI_TOO_LONG: ErrorSpec(
        414, "invalid_request_error", "uri_too_long", "invalid_request_error"
    ),
    ErrorKind.HEADERS_TOO_LARGE: ErrorSpec(
        431, "invalid_request_error", "request_header_fields_too_large", "invalid_request_error"
    ),
    ErrorKind.UNSUPPORTED_MEDIA_TYPE: ErrorSpec(
        415, "invalid_request_error", "unsupported_media_type", "invalid_request_error"
    ),
    ErrorKind.OVERLOADED: ErrorSpec(
        429, "rate_limit_exceeded", "rate_limit_exceeded", "rate_limit_error"
    ),
    ErrorKind.ENGINE_REJECTED: ErrorSpec(
        400, "invalid_request_error", "engine_rejected", "invalid_request_error"
    ),
    ErrorKind.ENGINE_OUT_OF_RESOURCES: ErrorSpec(
        503, "server_error", "insufficient_system_resource", "overloaded_error"
    ),
    ErrorKind.ENGINE_ABORTED: ErrorSpec(500, "server_error", "engine_aborted", "api_error"),
    ErrorKind.ENGINE_GRAMMAR_FAILED: ErrorSpec(
        500, "server_error", "structured_output_failed", "api_error"
    ),
    ErrorKind.ENGINE_ERROR: ErrorSpec(500, "server_error", "engine_error", "api_error"),
    ErrorKind.KV_TRANSFER_FAILED: ErrorSpec(
        503, "service_unavailable", "kv_transfer_failed", "overloaded_error"
    ),
    ErrorKind.KV_HANDOFF_UNVERIFIED: ErrorSpec(
        403, "permission_error", "kv_transfer_params_unverified", "permission_error"
    ),
    ErrorKind.SHUTTING_DOWN: ErrorSpec(
        503, "service_unavailable", "server_shutting_down", "overloaded_error"
    ),
    ErrorKind.SERVICE_FAILED: ErrorSpec(
        503, "service_unavailable", "service_unavailable", "overloaded_error"
    ),
    ErrorKind.TOO_MANY_CONNECTIONS: ErrorSpec(
        503, "service_unavailable", "too_many_connections", "overloaded_error"
    ),
    ErrorKind.RECEIVE_BUFFER_FULL: ErrorSpec(
        503, "service_unavailable", "receive_buffer_full", "overloaded_error"
    ),
    ErrorKind.STORE_UNAVAILABLE: ErrorSpec(
        503, "service_unavailable", "response_store_unavailable", "overloaded_error"
    ),
    ErrorKind.CLIENT_DISCONNECTED: ErrorSpec(
        499, "invalid_request_error", "client_closed_request", "invalid_request_error"
    ),
    ErrorKind.INTERNAL: ErrorSpec(500, "server_error", "internal_error", "api_error"),
    # Anthropic's message threads (a `thread` field): the anthropic SDK's tool runner resends
    # the whole conversation without one on this code.
    ErrorKind.THREAD_UNSUPPORTED: ErrorSpec(
        400,
        "invalid_request_error",
        "unsupported_parameter",
        "invalid_request_error",
        anthropic_code="thread_unsupported_request",
    ),
    ErrorKind.QUEUE_TIMEOUT: ErrorSpec(
        429, "rate_limit_exceeded", "queue_timeout", "rate_limit_error"
    ),
    ErrorKind.GRAMMAR_CAPACITY: ErrorSpec(
        503, "service_unavailable", "grammar_compile_capacity", "overloaded_error"
    ),
}


class ServerError(Exception):
    """Base class of every exception the server raises on purpose."""


class ConfigError(ServerError):
    """An inconsistent or invalid configuration; the message is one line for the user."""


class StartupError(ServerError):
    """A rank failed to start, or did not become ready in time."""


class LockstepViolation(ServerError):
    """DP ranks did not enter the same collective together (or a peer never arrived)."""


class ApiError(ServerError):
    """A request failure: its kind picks the status and the error types (`ERROR_TABLE`)."""

    kind: ErrorKind = ErrorKind.INTERNAL

    def __init_subclass__(cls, *, kind: ErrorKind | None = None, **rest: Any) -> None:
        """A subclass names its kind in its bases: `class X(ApiError, kind=ErrorKind.Y)`."""
        super().__init_subclass__(**rest)
        if kind is not None:
            cls.kind = kind

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        kind: ErrorKind | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if kind is not None:
            self.kind = kind
        self._code = code

    @property
    def spec(self) -> ErrorSpec:
        return ERROR_TABLE[self.kind]

    @property
    def status_code(self) -> int:
        return self.spec.status

    @property
    def code(self) -> str | None:
        """The OpenAI `code`: an explicit one (for example the recipe's), else the table's."""
        return self._code if self._code is not None else self.spec.openai_code

    def headers(self) -> dict[str, str]:
        """Extra HTTP headers to send with this error."""
        return {}


class BadRequestError(ApiError, kind=ErrorKind.BAD_REQUEST):
    """The request is malformed or asks for something this service does not do."""


class HandoffUnverifiedError(ApiError, kind=ErrorKind.KV_HANDOFF_UNVERIFIED):
    """A decode request's `kv_transfer_params` is not a signed, unexpired handoff of its prompt."""


class ContextLengthError(ApiError, kind=ErrorKind.CONTEXT_LENGTH_EXCEEDED):
    """The prompt (plus the requested output) does not fit in the context window."""


class AuthenticationError(ApiError, kind=ErrorKind.AUTHENTICATION):
    """A missing or wrong API key."""


class ModelNotFoundError(ApiError, kind=ErrorKind.MODEL_NOT_FOUND):
    """The request names a model this server does not serve."""


class StoredObjectNotFound(ApiError, kind=ErrorKind.RESPONSE_NOT_FOUND):
    """A stored response or item that does not exist, expired, or belongs to another API key's
    scope (all three look the same to the client)."""


class RequestTimeoutError(ApiError, kind=ErrorKind.REQUEST_TIMEOUT):
    """The request ran longer than `--request-timeout` (or its body took too long)."""


class RequestTooLargeError(ApiError, kind=ErrorKind.REQUEST_TOO_LARGE):
    """The request body is larger than the server accepts."""


class RetryLaterError(ApiError):
    """An error the client should retry after `retry_after_seconds` (its Retry-After header)."""

    def __init__(self, message: str, *, retry_after_seconds: int = 1) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_seconds)}


class OverloadedError(RetryLaterError, kind=ErrorKind.OVERLOADED):
    """Admission capacity is full; the client should retry later."""


class QueueTimeoutError(OverloadedError, kind=ErrorKind.QUEUE_TIMEOUT):
    """The request waited longer than `--queue-timeout` for its first token."""


class GrammarCapacityError(RetryLaterError, kind=ErrorKind.GRAMMAR_CAPACITY):
    """No grammar compile worker was free in time: the server is out of compile capacity for
    now (the grammar itself is not at fault); the client should retry later."""


class EngineRequestError(ApiError, kind=ErrorKind.ENGINE_ABORTED):
    """The engine refused or ended one request; the engine itself is still healthy."""


class ServiceUnavailableError(ApiError, kind=ErrorKind.SERVICE_FAILED):
    """The service cannot take requests (see the two subclasses)."""


class ShuttingDownError(ServiceUnavailableError, kind=ErrorKind.SHUTTING_DOWN):
    """The server is draining or stopping."""

    def __init__(self, message: str = "the server is shutting down") -> None:
        super().__init__(message)


class ServiceFailedError(ServiceUnavailableError, kind=ErrorKind.SERVICE_FAILED):
    """A rank failed or hung; every request fails until the server is restarted."""


class StoreUnavailableError(ApiError, kind=ErrorKind.STORE_UNAVAILABLE):
    """The Responses store failed (its database is unreachable, locked or broken): only the
    requests that need it fail."""

    def __init__(self, message: str = "the response store is unavailable; retry later") -> None:
        super().__init__(message)


class ClientDisconnected(ApiError, kind=ErrorKind.CLIENT_DISCONNECTED):
    """The client closed the connection before the response was complete."""

    def __init__(self, message: str = "the client closed the connection") -> None:
        super().__init__(message)


class InternalError(ApiError, kind=ErrorKind.INTERNAL):
    """An unexpected exception (a bug), reported to the client as a generic 500."""

    def __init__(self, message: str = "internal server error") -> None:
        super().__init__(message)
