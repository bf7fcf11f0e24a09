"""What the prefix cache checks of, and patches in, DeepInfer's engine before it runs."""

from __future__ import annotations

from typing import Any

import numpy as np


def disabled_reason(engine: Any) -> str | None:
    """Why the cache cannot run on this engine, or None."""
    from deepinfer.engine.engine_type import EngineType

    if engine.engine_type != EngineType.NORMAL:
        return f"the engine type is {engine.engine_type.name}, not NORMAL"
    if engine.state_manager is None:
        return "the model keeps no per-sequence state"
    if engine.yoco_prefill_truncation_mode != "off":
        # The truncated prefill skips the consumer layers' KV for all but the last tokens: a
        # prefix computed that way cannot be attended to by a later suffix.
        return f"YoCo prefill truncation is on ({engine.yoco_prefill_truncation_mode})"
    return None


def copy_clone_unpins(deferred_release: Any) -> None:
    """Make DeepInfer's deferred release keep copies of the clone "to release" arrays.

    They borrow process-static C++ vectors that the next clone call overwrites; a snapshot
    clone in the same step would otherwise make the step's release unpin the snapshot's
    source (a running sequence's live slot) instead of the fork's parent slot.
    """
    collect = deferred_release.collect_clone_unpins

    def collect_copies(states: Any, blocks: Any) -> None:
        collect(np.array(states, dtype=np.int32), np.array(blocks, dtype=np.int32))

    deferred_release.collect_clone_unpins = collect_copies
