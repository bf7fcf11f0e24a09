"""The route table's repeated entry kinds, built from their few differences: a protected
request of an object by its path parameters (a GET, a DELETE, a cancel's POST), a POST of a
body component, and a generation POST."""

from __future__ import annotations

from deepinfer_server.api.dialects import Dialect
from deepinfer_server.api.route import Endpoint, Handler, with_parameters
from deepinfer_server.openapi import operations as op
from deepinfer_server.openapi.schema import Schema


def envelope_of(dialect: Dialect) -> str:
    """The error envelope `dialect`'s clients read (Anthropic's, or OpenAI's)."""
    return op.ANTHROPIC_ENVELOPE if dialect is Dialect.ANTHROPIC else op.OPENAI_ENVELOPE


def on_object(
    method: str,
    path: str,
    handler: Handler,
    summary: str,
    *parameters: Schema,
    dialect: Dialect = Dialect.OPENAI,
) -> Endpoint:
    """A protected bodiless `method` on `path` answering a JSON object, with `parameters`."""
    operation = op.get(summary, envelope=envelope_of(dialect))
    return Endpoint(
        path, method, handler, dialect, with_parameters(operation, *parameters), protected=True
    )


def post_body(
    path: str,
    handler: Handler,
    summary: str,
    body: str,
    *parameters: Schema,
    dialect: Dialect = Dialect.OPENAI,
) -> Endpoint:
    """A protected POST of the `body` component answering a JSON object, with `parameters`
    (none: the operation has no `parameters` list)."""
    operation = op.post_object(summary, body, envelope_of(dialect))
    if parameters:
        operation = with_parameters(operation, *parameters)
    return Endpoint(path, "POST", handler, dialect, operation, protected=True)


def generation(
    path: str, handler: Handler, summary: str, body: str, dialect: Dialect = Dialect.OPENAI
) -> Endpoint:
    """A protected generation POST of the `body` component (JSON or SSE)."""
    operation = op.generation(summary, body, envelope_of(dialect))
    return Endpoint(path, "POST", handler, dialect, operation, protected=True)
