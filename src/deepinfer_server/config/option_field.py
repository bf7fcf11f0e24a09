"""option(): a dataclass field that is also a command-line option."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def option(
    default: Any, *flags: str, help: str, secret: bool = False, **argparse_kwargs: Any
) -> Any:
    """A dataclass field that is also a command-line option (a secret one stays out of repr)."""
    metadata = {"flags": flags, "help": help, "argparse": argparse_kwargs}
    return field(default=default, metadata=metadata, repr=not secret)


def int_option(default: int | None, *flags: str, help: str) -> Any:
    """An option that takes an integer."""
    return option(default, *flags, help=help, type=int)


def float_option(default: float, *flags: str, help: str) -> Any:
    """An option that takes a number (seconds, a share)."""
    return option(default, *flags, help=help, type=float)


def flag_option(*flags: str, help: str) -> Any:
    """An on/off option: off unless its flag is given."""
    return option(False, *flags, help=help, action="store_true")
