"""Copied from deepinfer/engine/engine_type.py (0.1.0)."""

import enum


class EngineType(enum.Enum):
    NORMAL = 0
    PROMPT = enum.auto()
    COMPLETION = enum.auto()

    @property
    def default_zero_overhead_scheduling(self) -> bool:
        return self in (EngineType.NORMAL, EngineType.COMPLETION)
