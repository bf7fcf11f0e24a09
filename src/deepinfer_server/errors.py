"""The server's exception tree. Every request failure maps to one OpenAI-shaped error.

    ServerError
    ├── ApiError                  a request fails; carries HTTP status, type, param, code
    │   ├── BadRequestError       400 invalid_request_error
    │   ├── AuthenticationError   401 invalid_api_key
    │   ├── ModelNotFoundError    404 model_not_found
    │   ├── OverloadedError       429 rate_limit_exceeded (with Retry-After)
    │   ├── RequestTimeoutError   408 request_timeout
    │   ├── RequestTooLargeError  413 request_too_large
    │   ├── EngineRequestError    an engine refused or ended one request (status from the engine)
    │   └── ServiceUnavailableError 503: a rank failed or the server is shutting down
    └── ConfigError               invalid command line; the CLI exits with code 2

`ApiError.to_body()` is the only place that builds the `{"error": {...}}` envelope.
"""

from __future__ import annotations

from typing import Any


class ServerError(Exception):
    """Base class of every exception the server raises on purpose."""


class ConfigError(ServerError):
    """An inconsistent or invalid configuration; the message is one line for the user."""


class ApiError(ServerError):
    """A request failure with an HTTP status and an OpenAI error envelope."""

    status_code: int = 500
    error_type: str = "server_error"
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status_code: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        if status_code is not None:
            self.status_code = status_code

    def to_body(self) -> dict[str, Any]:
        """The OpenAI error envelope for this error."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        """Extra HTTP headers to send with this error."""
        return {}


class BadRequestError(ApiError):
    """The request is malformed or asks for something this service does not do."""

    status_code = 400
    error_type = "invalid_request_error"


class AuthenticationError(ApiError):
    """A missing or wrong API key."""

    status_code = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"


class ModelNotFoundError(ApiError):
    """The request names a model this server does not serve."""

    status_code = 404
    error_type = "invalid_request_error"
    default_code = "model_not_found"


class OverloadedError(ApiError):
    """Admission capacity is full; the client should retry later."""

    status_code = 429
    error_type = "rate_limit_exceeded"
    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_seconds: int = 1) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_seconds)}


class RequestTimeoutError(ApiError):
    """The request ran longer than `--request-timeout`."""

    status_code = 408
    error_type = "timeout_error"
    default_code = "request_timeout"


class RequestTooLargeError(ApiError):
    """The request body is larger than the server accepts."""

    status_code = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class EngineRequestError(ApiError):
    """The engine rejected or ended one request (the engine itself is still healthy)."""

    error_type = "server_error"
    default_code = "engine_error"


class ServiceUnavailableError(ApiError):
    """The service cannot take requests: a rank failed, or the server is shutting down."""

    status_code = 503
    error_type = "service_unavailable"
    default_code = "service_unavailable"
