"""What the transfer side's threads hand to the engine's thread, taken without waiting."""

from __future__ import annotations

import queue
from typing import TypeVar

T = TypeVar("T")


def drain(items: queue.SimpleQueue[T]) -> list[T]:
    """Everything queued now, in order (the engine's thread never waits for more)."""
    taken: list[T] = []
    while True:
        try:
            taken.append(items.get_nowait())
        except queue.Empty:
            return taken
