"""TransferStats: what a decode rank's KV pulls did, read by the engine driver for /metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class TransferStats:
    """What a rank's transfers did since it started (histogram samples: since the last take)."""

    bytes: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    seconds: list[float] = field(default_factory=list)
    wait_seconds: list[float] = field(default_factory=list)
