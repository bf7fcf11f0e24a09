"""Endpoint: one entry of the route table (`api/route_table/`), declared with its handler.

An entry says all the server knows of an endpoint: its path and method, its handler, the API
its clients speak (its error envelope), whether it is behind the API keys, and its OpenAPI
operation. This module imports no handler, so that a handler's module may import it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cached_property

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import compile_path

from deepinfer_server.api.dialects import Dialect
from deepinfer_server.openapi.schema import Schema

Handler = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True, eq=False)
class Endpoint:
    """One method on one path: its handler, the API its clients speak, whether it needs an API
    key, its OpenAPI operation."""

    #: The Starlette path (converters such as `{model_id:path}` allowed).
    path: str
    method: str
    handler: Handler
    dialect: Dialect
    operation: Schema
    #: Behind the API keys (when the server has some); every /v1 route is, by its prefix too.
    protected: bool = False

    @cached_property
    def openapi_path(self) -> str:
        """The path as OpenAPI writes it (no converters)."""
        return compile_path(self.path)[1]


def with_parameters(operation: Schema, *parameters: Schema) -> Schema:
    """`operation` with its `parameters`."""
    return {**operation, "parameters": list(parameters)}
