"""Retention on the simulated engine: a request that asks for it has its prompt's write
decided at admission (reported with its first output), its entry is pinned for its ttl (an
injected clock), evicted from the pool after every unpinned entry, kept in the host tier
against LRU drops until the ttl runs out, and only within its partition's budget."""

from __future__ import annotations

import numpy as np

from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver
from deepinfer_server.engines.simulated.abilities import SimulatedAbilities
from deepinfer_server.engines.simulated.engine import LLMEngine
from deepinfer_server.engines.simulated.outputs import RequestOutput
from deepinfer_server.ipc.codec import pack_token_ids
from deepinfer_server.ipc.messages import AddRequest, SamplingOptions
from deepinfer_server.model.kv_block import blocks_for
from deepinfer_server.prefix_cache.host_tier import HostTier
from deepinfer_server.prefix_cache.retention import Retention
from tests.unit.engines.test_simulated_engine import make_engine, run_to_end
from tests.unit.engines.test_simulated_host_tier import _settings, _tokens
from tests.unit.engines.test_simulated_prefix_cache import _turn


class Clock:
    """A retention clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _run(engine: LLMEngine, request_id: str, prompt: np.ndarray, seconds: float = 0.0) -> int:
    """Run one request to its end; the prompt tokens it was to write."""
    sequence = engine.add_request(
        "0", request_id, {"max_tokens": 4}, prompt, retention_seconds=seconds
    )
    assert sequence is not None
    written = int(sequence.num_written_tokens)
    list(run_to_end(engine))
    return written


def _with_clock(engine: LLMEngine, budget_blocks: int = 10_000) -> Clock:
    clock = Clock()
    engine._cache.retention = Retention(budget_blocks, clock)
    if engine._cache.host is not None:
        engine._cache.host.pins = engine._cache.retention
    return clock


def test_a_request_with_retention_reports_its_write_and_is_kept() -> None:
    engine = make_engine(enable_prefix_caching=True)
    _with_clock(engine)
    prompt = _turn("Hello.")
    assert _run(engine, "plain", _turn("Other.")) == 0  # no retention asked: no write reported
    assert _run(engine, "kept", prompt, seconds=300) == len(prompt)
    entries = list(engine._cache.index)
    assert len(entries) == 2
    kept = [entry for entry in entries if np.array_equal(entry.tokens, prompt)]
    assert len(kept) == 1 and engine._cache.retention.pinned(kept[0])
    assert not engine._cache.retention.pinned(
        entries[0] if entries[0] is not kept[0] else entries[1]
    )


def test_the_driver_reports_the_written_tokens_with_the_first_output() -> None:
    engine = make_engine(enable_prefix_caching=True)
    driver = LLMEngineDriver(engine, RequestOutput, SimulatedAbilities(engine, prefix_caching=True))
    prompt = _turn("Hello.")
    sampling = SamplingOptions(max_tokens=4, retention_seconds=300)
    driver.add(AddRequest("one", pack_token_ids(prompt.tolist()), sampling))
    driver.add(AddRequest("two", pack_token_ids(_turn("Other.").tolist()), SamplingOptions(4)))
    _, deltas = driver.iterate()
    by_id = {delta.request_id: delta for delta in deltas}
    assert by_id["one"].written_tokens == len(prompt)
    assert by_id["two"].written_tokens is None and by_id["two"].cached_tokens == 0


def test_pinned_entries_leave_the_pool_last() -> None:
    first = _turn("Hello.")
    engine = make_engine(enable_prefix_caching=True, kv_blocks=3 * blocks_for(len(first) + 5))
    _with_clock(engine)
    _run(engine, "pinned", _turn("Conversation pinned."), seconds=300)
    for number in range(5):
        _run(engine, f"c{number}", _turn(f"Conversation {number}."))
    held = [entry.tokens for entry in engine._cache.index]
    assert any(np.array_equal(tokens, _turn("Conversation pinned.")) for tokens in held)
    assert 1 <= len(held) < 6


def test_a_pinned_entry_the_pool_gives_up_takes_its_pin_along() -> None:
    # Room for one conversation's entry and the next prompt: the pinned entry must go too.
    first = _turn("Conversation pinned.")
    engine = make_engine(enable_prefix_caching=True, kv_blocks=2 * blocks_for(len(first) + 5))
    assert engine._cache.host is None
    _with_clock(engine)
    _run(engine, "pinned", first, seconds=300)
    assert engine._cache.retention.pinned_blocks(None) > 0
    for number in range(3):
        _run(engine, f"c{number}", _turn(f"Conversation {number}, a little longer."))
    held = [entry.tokens for entry in engine._cache.index]
    assert not any(np.array_equal(tokens, first) for tokens in held)
    # Without a tier to take it along, the pin of a prompt gone no longer counts.
    assert engine._cache.retention.pinned_blocks(None) == 0


def test_a_pin_ends_with_its_ttl() -> None:
    first = _turn("Hello.")
    engine = make_engine(enable_prefix_caching=True, kv_blocks=3 * blocks_for(len(first) + 5))
    clock = _with_clock(engine)
    _run(engine, "pinned", _turn("Conversation pinned."), seconds=300)
    clock.now += 301
    for number in range(5):
        _run(engine, f"c{number}", _turn(f"Conversation {number}."))
    held = [entry.tokens for entry in engine._cache.index]
    assert not any(np.array_equal(tokens, _turn("Conversation pinned.")) for tokens in held)


def test_the_host_tier_keeps_a_pinned_entry_until_its_ttl() -> None:
    one = _settings().copy_bytes(512)
    host = HostTier(_settings(budget=2 * one), max_rollback=1)
    clock = Clock()
    host.pins = Retention(10_000, clock)
    pinned = _tokens(512, 0)
    assert host.offload(pinned, None)
    (entry,) = host.entries()
    assert host.pins.pin(entry, 3600)
    assert host.offload(_tokens(512, 1), None)
    # The pinned entry is the least recently used, yet the unpinned one gives room.
    assert host.offload(_tokens(512, 2), None)
    assert any(np.array_equal(held.tokens, pinned) for held in host.entries())
    clock.now += 3601
    assert host.offload(_tokens(512, 3), None)
    assert not any(np.array_equal(held.tokens, pinned) for held in host.entries())


def test_a_pin_follows_its_entry_from_the_pool_into_the_host_tier() -> None:
    # Each tier's index hashes blocks under weights of its own: the pin must not name the
    # entry by its pool index key.
    first = _turn("Conversation pinned.")
    engine = make_engine(
        enable_prefix_caching=True, host_tier=_settings(), kv_blocks=2 * blocks_for(len(first) + 5)
    )
    _with_clock(engine)
    _run(engine, "pinned", first, seconds=300)
    for number in range(3):
        _run(engine, f"c{number}", _turn(f"Conversation {number}, a little longer."))
    host = engine._cache.host
    assert host is not None
    (moved,) = [entry for entry in host.entries() if np.array_equal(entry.tokens, first)]
    assert engine._cache.retention.pinned(moved)


def test_an_aborted_waiting_write_gives_its_slot_back() -> None:
    engine = make_engine(enable_prefix_caching=True)
    free = engine._cache.slots.free_count
    sequence = engine.add_request(
        "0", "one", {"max_tokens": 4}, _turn("Hello."), retention_seconds=300
    )
    assert sequence is not None and sequence.snapshot_slot
    assert engine._cache.slots.free_count == free - 1
    engine.abort_request("one")
    list(run_to_end(engine))
    assert engine._cache.slots.free_count == free and not engine._cache.index


def test_a_preempted_write_keeps_its_slot_and_is_still_written() -> None:
    engine = make_engine(enable_prefix_caching=True)
    prompt = _turn("Hello.")
    sequence = engine.add_request("0", "one", {"max_tokens": 4}, prompt, retention_seconds=300)
    assert sequence is not None
    slot = sequence.snapshot_slot
    engine._cache.preempted(sequence)  # as the decode plan does before requeueing it
    assert sequence.snapshot_slot == slot
    list(run_to_end(engine))
    assert [len(entry.tokens) for entry in engine._cache.index] == [len(prompt)]


def test_the_retention_share_sizes_each_partitions_budget() -> None:
    default = make_engine(enable_prefix_caching=True, kv_blocks=400)
    half = make_engine(enable_prefix_caching=True, kv_blocks=400, prefix_cache_retention_share=0.5)
    assert default._cache.retention.key_budget_blocks == 100
    assert half._cache.retention.key_budget_blocks == 200
