"""The server's OpenAPI 3.1 description, built from the validation's own constants."""

from __future__ import annotations

from deepinfer_server.openapi.document import build_document

__all__ = ["build_document"]
