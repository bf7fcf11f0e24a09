"""DisaggregationRole: a server's part in prefill/decode disaggregation (`--disaggregation-mode`).

Defined once here, below config, the engines and the API side, which all read it; it imports
nothing of theirs.
"""

from __future__ import annotations

import argparse
import enum


class DisaggregationRole(enum.StrEnum):
    """The role of a server and its engines: NULL runs DeepInfer's NORMAL engine (prefill and
    decode), PREFILL its PROMPT engine, DECODE its COMPLETION engine."""

    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def disaggregated(self) -> bool:
        """Whether the server plays a prefill or decode part (not NULL)."""
        return self is not DisaggregationRole.NULL

    @classmethod
    def of_option(cls, value: str) -> DisaggregationRole:
        """The role a command-line value names; argparse's own words for a value it refuses."""
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(repr(role.value) for role in cls)
            raise argparse.ArgumentTypeError(
                f"invalid choice: {value!r} (choose from {choices})"
            ) from None
