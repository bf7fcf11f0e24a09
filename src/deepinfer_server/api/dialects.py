"""Which API a path's clients speak (OpenAI's or Anthropic's), as the route table declares it.

The error envelope of a path, and the shape `/v1/models` answers in, follow from it. The lookup
is by path prefix, so that a path no route serves (a 404, a trailing slash, a request refused
before its head was complete) is still answered in its neighbours' envelope.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from starlette.types import Scope

_ANTHROPIC_VERSION = b"anthropic-version"


class Dialect(enum.Enum):
    """The API an endpoint's clients speak."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"
    #: Both APIs share the path; Anthropic's clients are told apart by `anthropic-version`.
    EITHER = "either"


def sends_anthropic_version(scope: Scope) -> bool:
    """Whether the request has an `anthropic-version` header: on a path both APIs share
    (`Dialect.EITHER`), what tells Anthropic's clients apart."""
    return any(name == _ANTHROPIC_VERSION for name, _ in scope.get("headers", ()))


def path_prefix(path: str) -> str:
    """The fixed part of a route's path: up to its first parameter, without a trailing slash."""
    return path.split("{", 1)[0].rstrip("/") or "/"


def _outermost(prefixes: Iterable[str]) -> tuple[str, ...]:
    ordered = sorted(set(prefixes))
    kept: list[str] = []
    for prefix in ordered:
        if not any(prefix.startswith(outer) for outer in kept):
            kept.append(prefix)
    return tuple(kept)


@dataclass(frozen=True)
class PathDialects:
    """The path prefixes whose clients speak Anthropic's API, always or by header."""

    anthropic: tuple[str, ...]
    either: tuple[str, ...]

    @classmethod
    def of(cls, routes: Iterable[tuple[str, Dialect]]) -> PathDialects:
        """From (path, dialect) pairs; a ValueError when an OpenAI path falls under another
        dialect's prefix (the lookup by prefix could not tell them apart)."""
        routes = list(routes)
        anthropic = _outermost(path_prefix(p) for p, d in routes if d is Dialect.ANTHROPIC)
        either = _outermost(path_prefix(p) for p, d in routes if d is Dialect.EITHER)
        for path, dialect in routes:
            if dialect is Dialect.OPENAI and path.startswith(anthropic + either):
                raise ValueError(f"{path} speaks OpenAI's API under another API's path prefix")
        return cls(anthropic, either)

    def speaks_anthropic(self, scope: Scope) -> bool:
        """True for a path of Anthropic's API, and for a shared one asked with an
        `anthropic-version` header."""
        path: str = scope["path"]
        if path.startswith(self.anthropic):
            return True
        return path.startswith(self.either) and sends_anthropic_version(scope)
