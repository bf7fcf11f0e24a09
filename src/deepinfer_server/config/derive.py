"""What `resolve()` derives from the options as given and the environment: the parallel
layout, DeepInfer's prefill intervals and draft length, the address peers reach."""

from __future__ import annotations

import os
import socket

from deepinfer_server.errors import ConfigError

#: DeepInfer 0.1.0's prefill attempt intervals (deepinfer/environ.py:174,177).
DEFAULT_PREFILL_ATTEMPT_INTERVAL = 70
DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL = 100
#: DeepInfer's MTP draft length, read by its Python (environ.py:129) and its C++ (utils.hpp).
SPECULATIVE_TOKENS_VARIABLE = "DEEPINFER_USE_NEXTN_DECODE"


def derive_parallelism(ep: int | None, dp: int | None, cp: int | None) -> tuple[int, int, int]:
    """Return (EP, DP, CP) with DP * CP == EP, or raise ConfigError with a one-line reason.

    Without --ep, EP is DP * CP (each defaulting to 1), so `--dp 2` alone means two ranks of
    one GPU each; with --ep, the missing one of DP and CP is derived from it.
    """
    for name, value in (("--ep", ep), ("--dp", dp), ("--cp", cp)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be at least 1, got {value}")
    if ep is None:
        dp, cp = dp or 1, cp or 1
        return dp * cp, dp, cp
    return (ep, *_split(ep, dp, cp))


def _split(ep: int, dp: int | None, cp: int | None) -> tuple[int, int]:
    if dp is None and cp is None:
        return 1, ep
    if dp is None:
        assert cp is not None
        if ep % cp:
            raise ConfigError(f"--cp {cp} does not divide --ep {ep}: DP*CP must equal EP")
        return ep // cp, cp
    if cp is None:
        if ep % dp:
            raise ConfigError(
                f"--dp {dp} does not divide --ep {ep}: DP*CP must equal EP "
                f"(for {dp} ranks of one GPU each, pass --dp {dp} without --ep, or --ep {dp})"
            )
        return dp, ep // dp
    if dp * cp != ep:
        raise ConfigError(f"--dp {dp} times --cp {cp} is {dp * cp}, not --ep {ep}")
    return dp, cp


def _flag_or_variable(flag: str, given: int | None, variable: str) -> tuple[str, int | None]:
    """The flag and its value, else the exported variable and its value, else (flag, None)."""
    if given is not None:
        return flag, given
    raw = os.environ.get(variable, "").strip()
    if not raw:
        return flag, None
    try:
        return variable, int(raw)
    except ValueError:
        raise ConfigError(f"{variable}={raw!r} is not an integer") from None


def prefill_interval(flag: str, given: int | None, variable: str, default: int) -> int:
    """A prefill interval: the flag, else the exported DeepInfer variable, else its default."""
    source, value = _flag_or_variable(flag, given, variable)
    if value is None:
        return default
    if value < 1:
        raise ConfigError(f"{source} must be at least 1, got {value}")
    return value


def speculative_tokens(given: int | None) -> int:
    """Draft tokens per step: the flag, else the exported DEEPINFER_USE_NEXTN_DECODE, else 0
    (DeepInfer's own default is 5; this server ships speculation off)."""
    source, value = _flag_or_variable("--speculative-tokens", given, SPECULATIVE_TOKENS_VARIABLE)
    if value is None:
        return 0
    if value < 0:
        raise ConfigError(f"{source} must not be negative (0 turns speculation off), got {value}")
    return value


def advertised_host(given: str | None, listen_host: str) -> str:
    """The address a prefill server gives decode servers: `given`, else the listen address,
    else (a wildcard) this machine's own address."""
    if given:
        return given
    if listen_host not in ("0.0.0.0", "::", ""):
        return listen_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
