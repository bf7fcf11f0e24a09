"""Tenants: who a request belongs to (its API key's name) and that key's admission limits.

`--api-key-file` names each key, one per line:

    # comments and blank lines are skipped
    NAME KEY [max_running=N] [max_queued=N] [weight=W]

A name is 1-64 of `A-Z a-z 0-9 _ . -`; names and keys are unique (within the file and against
`--api-key`). Keys given with `--api-key` (or `$DEEPINFER_API_KEY`) are tenants `api-key-1`,
`api-key-2`, ... in their order; without any key every request is tenant `default`. A malformed
file is refused at start with its line number, never with the key itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer_server.errors import ConfigError

#: The only tenant of a server without API keys.
DEFAULT_TENANT = "default"

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_LIMITS = ("max_running", "max_queued", "weight")


@dataclass(frozen=True)
class Tenant:
    """One API key's name and its admission limits (None: the server's default)."""

    name: str
    #: Its share of running slots relative to other keys' when several wait.
    weight: float = 1.0
    #: Requests it may have running on the engine at once.
    max_running: int | None = None
    #: Requests it may have waiting in the server's queue at once (429 beyond).
    max_queued: int | None = None


@dataclass(frozen=True)
class NamedKey:
    """An accepted API key and the tenant it belongs to."""

    key: str = field(repr=False)
    tenant: Tenant


def read_key_file(path: str) -> tuple[NamedKey, ...]:
    """The keys of an `--api-key-file`, or ConfigError naming the line that is wrong."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-key-file {path}: cannot read it ({exc})") from None
    keys: list[NamedKey] = []
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        try:
            keys.append(_parse_line(words))
        except ValueError as exc:
            raise ConfigError(f"--api-key-file {path} line {number}: {exc}") from None
    if not keys:
        raise ConfigError(f"--api-key-file {path}: no keys in it")
    return tuple(keys)


def _parse_line(words: list[str]) -> NamedKey:
    if len(words) < 2:
        raise ValueError("expected 'NAME KEY [max_running=N] [max_queued=N] [weight=W]'")
    name, key, *limits = words
    if not _NAME.fullmatch(name):
        raise ValueError(f"the name {name!r} is not 1-64 of A-Z a-z 0-9 _ . -")
    if "=" in key and key.split("=", 1)[0] in _LIMITS:
        raise ValueError(f"{name}: the key is missing (the second word is a limit)")
    values: dict[str, str] = {}
    for word in limits:
        option, sep, value = word.partition("=")
        if not sep or option not in _LIMITS:
            raise ValueError(
                f"{name}: unknown limit {word!r}: expected one of {', '.join(_LIMITS)}"
            )
        if option in values:
            raise ValueError(f"{name}: {option} is given twice")
        values[option] = value
    return NamedKey(key, Tenant(name, *_limits(name, values)))


def _limits(name: str, values: dict[str, str]) -> tuple[float, int | None, int | None]:
    weight = 1.0
    if "weight" in values:
        try:
            weight = float(values["weight"])
        except ValueError:
            weight = 0.0
        if not 0 < weight < float("inf"):
            raise ValueError(f"{name}: weight must be a positive number, got {values['weight']!r}")
    counts: list[int | None] = []
    for limit, least in (("max_running", 1), ("max_queued", 0)):
        raw = values.get(limit)
        if raw is None:
            counts.append(None)
            continue
        if not raw.isdigit() or int(raw) < least:
            raise ValueError(f"{name}: {limit} must be an integer >= {least}, got {raw!r}")
        counts.append(int(raw))
    return weight, counts[0], counts[1]


def named_keys(api_keys: tuple[str, ...], key_file: str | None) -> tuple[NamedKey, ...]:
    """Every accepted key with its tenant: `--api-key`'s first, then the file's."""
    named = [NamedKey(key, Tenant(f"api-key-{i}")) for i, key in enumerate(api_keys, start=1)]
    if key_file is not None:
        named.extend(read_key_file(key_file))
    names = [entry.tenant.name for entry in named]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ConfigError(f"--api-key-file: the name(s) {', '.join(twice)} are used twice")
    seen: dict[str, str] = {}
    for entry in named:
        if entry.key in seen:
            raise ConfigError(
                f"--api-key-file: {entry.tenant.name} has the same key as {seen[entry.key]}"
            )
        seen[entry.key] = entry.tenant.name
    return tuple(named)


def tenants_of(keys: tuple[NamedKey, ...]) -> tuple[Tenant, ...]:
    """The server's tenants in a fixed order (their index in the shared admission counts)."""
    return tuple(entry.tenant for entry in keys) or (Tenant(DEFAULT_TENANT),)
