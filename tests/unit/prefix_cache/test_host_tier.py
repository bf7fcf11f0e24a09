"""The host tier's engine-agnostic policy as the DeepInfer engine uses it: the rows it copies
are taken only for an entry it keeps, counted copy seconds are the engine's own, and clearing
it keeps the entries a waiting prompt counts on."""

from __future__ import annotations

import numpy as np

from deepinfer_server.prefix_cache.host_tier import HostTier, HostTierSettings

BLOCK_BYTES = 1_000
STATE_BYTES = 500


def _tier(budget: int, measured: bool = False) -> HostTier:
    settings = HostTierSettings(budget, 1e9, BLOCK_BYTES, STATE_BYTES, 20_000.0, measured=measured)
    return HostTier(settings, max_rollback=1)


def _tokens(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(10, 1000, size=count, dtype=np.int32)


def _next_turn(tokens: np.ndarray) -> np.ndarray:
    return np.concatenate([tokens, _tokens(10, 99)])


def test_the_rows_are_copied_only_for_an_entry_the_tier_keeps() -> None:
    tier = _tier(budget=2 * BLOCK_BYTES + STATE_BYTES)
    copies: list[str] = []
    assert tier.offload(_tokens(256, 1), None, copy=lambda: copies.append("kept") or "rows")
    (entry,) = tier.entries()
    assert entry.value.rows == "rows" and copies == ["kept"]
    # Three blocks are over the budget: nothing is copied, nothing dropped.
    assert not tier.offload(_tokens(300, 2), None, copy=lambda: copies.append("too big"))
    assert copies == ["kept"] and len(tier.index) == 1


def test_an_engine_that_measures_its_copies_counts_their_seconds_itself() -> None:
    modelled, measured = _tier(1 << 30), _tier(1 << 30, measured=True)
    for tier in (modelled, measured):
        assert tier.offload(_tokens(256, 1), None)
        match = tier.match(_next_turn(_tokens(256, 1)), 264, None, 0)
        assert match is not None
        tier.pin(match.entry)
        tier.restore(match.entry, match.fork_point)
    assert modelled.offload_seconds > 0 and modelled.restore_seconds > 0
    assert measured.offload_seconds == 0 and measured.restore_seconds == 0
    assert measured.offload_bytes == modelled.offload_bytes > 0
    assert measured.restore_bytes == modelled.restore_bytes > 0


def test_clearing_keeps_an_entry_a_waiting_prompt_counts_on() -> None:
    tier = _tier(1 << 30)
    assert tier.offload(_tokens(256, 1), None)
    assert tier.offload(_tokens(256, 2), b"salt")
    waited = tier.match(_next_turn(_tokens(256, 2)), 264, b"salt", 0)
    assert waited is not None
    tier.pin(waited.entry)
    tier.clear()
    assert list(tier.entries()) == [waited.entry]
    assert tier.used_bytes == 2 * BLOCK_BYTES + STATE_BYTES
