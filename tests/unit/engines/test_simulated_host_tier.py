"""The prefix cache's host-memory tier on the simulated engine: what the pool evicts is copied
there, a later turn is restored from it (counted as cached, computing only the rest) when that
is faster than recomputing, and the tier keeps its own LRU, byte budget, partitions and fair
shares."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver
from deepinfer_server.engines.simulated.abilities import SimulatedAbilities
from deepinfer_server.engines.simulated.engine import LLMEngine
from deepinfer_server.engines.simulated.outputs import RequestOutput
from deepinfer_server.prefix_cache.host_tier import HostTier, HostTierSettings
from tests.unit.engines.test_simulated_engine import make_engine, run_to_end
from tests.unit.engines.test_simulated_prefix_cache import _baseline, _cached, _clear, _turn

BLOCK_BYTES = 114_048
STATE_BYTES = 2_954_688


def _settings(
    budget: int = 1 << 40, bandwidth: float = 50e9, rate: float = 20_000.0
) -> HostTierSettings:
    return HostTierSettings(budget, bandwidth, BLOCK_BYTES, STATE_BYTES, rate)


def _engine(settings: HostTierSettings | None = None, **overrides: object) -> LLMEngine:
    # The engine's own prefill rate stays 0 (steps never wait); the tier's decides restores.
    return make_engine(enable_prefix_caching=True, host_tier=settings or _settings(), **overrides)


def _host(engine: LLMEngine) -> HostTier:
    host = engine._cache.host
    assert host is not None
    return host


def _tokens(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(10, 1000, size=count, dtype=np.int32)


def test_an_evicted_entry_is_copied_to_the_host_tier_at_its_size() -> None:
    engine = _engine()
    first = _turn("Hello.")
    _cached(engine, "one", first)
    _clear(engine)  # the pool evicts the entry
    host = _host(engine)
    assert len(engine._cache.index) == 0 and len(host.index) == 1
    expected = host.settings.copy_bytes(len(first))
    assert expected == -(-len(first) // 128) * BLOCK_BYTES + STATE_BYTES
    stats = engine.host_tier_stats()
    assert (stats.sequences, stats.bytes, stats.offload_bytes) == (1, expected, expected)
    assert stats.offload_seconds == pytest.approx(expected / 50e9)
    assert stats.hit_tokens == stats.restore_bytes == 0


def test_a_turn_after_eviction_is_restored_and_counted_as_cached() -> None:
    engine = _engine()
    empty = _baseline(engine)
    first, second = _turn("Hello."), _turn("Hello.", "Run the tests.")
    _cached(engine, "one", first)
    _clear(engine)
    driver = LLMEngineDriver(engine, RequestOutput, SimulatedAbilities(engine, True))
    from deepinfer_server.ipc.codec import pack_token_ids
    from deepinfer_server.ipc.messages import AddRequest, SamplingOptions

    computed = engine.prompt_tokens_computed
    driver.add(AddRequest("two", pack_token_ids(second.tolist()), SamplingOptions(max_tokens=4)))
    _, deltas = driver.iterate()
    assert deltas[0].cached_tokens == len(first)
    list(run_to_end(engine))
    # The prompt step computed only what the restored prefix did not hold.
    assert engine.prompt_tokens_computed - computed == len(second) - len(first)
    host = _host(engine)
    restored = host.settings.copy_bytes(len(first))
    assert (host.hit_tokens, host.restore_bytes) == (len(first), restored)
    assert host.restore_seconds == pytest.approx(restored / 50e9)
    # Every tier's hits count in the cache's own; the entry moved back to the pool.
    assert engine.prefix_cache_stats() == (len(first) + len(second), len(first), 1)
    assert len(host.index) == 0 and host.used_bytes == 0
    stats = driver.prefix_cache_stats()
    assert stats is not None and stats.host is not None and stats.host.hit_tokens == len(first)
    _clear(engine)
    host.index.remove(next(iter(host.index)))  # the second turn's copy
    assert _baseline(engine) == empty


def test_a_restore_slower_than_recomputing_is_not_taken() -> None:
    # 1 MB/s: copying the first turn's blocks and state back would take seconds, computing
    # its ~1.3k tokens some 70 ms.
    engine = _engine(_settings(bandwidth=1e6))
    first, second = _turn("Hello."), _turn("Hello.", "Run the tests.")
    _cached(engine, "one", first)
    _clear(engine)
    assert _cached(engine, "two", second) == 0
    assert _host(engine).hit_tokens == 0 and len(_host(engine).index) == 1
    # Without a prefill cost (rate 0) computing is free: never restore either.
    free = _engine(_settings(rate=0.0))
    _cached(free, "one", first)
    _clear(free)
    assert _cached(free, "two", second) == 0


def test_without_a_host_tier_an_evicted_turn_is_recomputed() -> None:
    engine = make_engine(enable_prefix_caching=True)
    first, second = _turn("Hello."), _turn("Hello.", "Run the tests.")
    _cached(engine, "one", first)
    _clear(engine)
    assert _cached(engine, "two", second) == 0
    assert engine.host_tier_stats() is None


def test_host_entries_keep_their_cache_salt() -> None:
    engine = _engine()
    first, second = _turn("Hello."), _turn("Hello.", "Run the tests.")
    sequence = engine.add_request("0", "a-1", {"max_tokens": 4}, first, cache_salt=b"a")
    assert sequence is not None
    list(run_to_end(engine))
    _clear(engine)
    for request_id, salt in (("none-2", None), ("b-2", b"b")):
        other = engine.add_request("0", request_id, {"max_tokens": 4}, second, cache_salt=salt)
        assert other is not None and other.num_cached_tokens == 0
        list(run_to_end(engine))
    assert _host(engine).hit_tokens == 0
    same = engine.add_request("0", "a-2", {"max_tokens": 4}, second, cache_salt=b"a")
    assert same is not None and same.num_cached_tokens == len(first)
    list(run_to_end(engine))
    assert _host(engine).hit_tokens == len(first)


def test_an_aborted_waiting_restore_leaves_the_host_entry() -> None:
    engine = _engine()
    first, second = _turn("Hello."), _turn("Hello.", "Run the tests.")
    _cached(engine, "one", first)
    _clear(engine)
    engine._admission.ttft_ms = 60_000.0  # the restore waits
    sequence = engine.add_request("0", "waits", {"max_tokens": 4}, second)
    assert sequence is not None and sequence.num_cached_tokens == len(first)
    (entry,) = _host(engine).index
    assert entry.live_forks == 1
    engine.abort_request("waits")
    list(run_to_end(engine))
    assert entry.live_forks == 0 and len(_host(engine).index) == 1
    assert _host(engine).hit_tokens == 0


def test_the_host_budget_drops_its_least_recently_used_entries() -> None:
    one = _settings().copy_bytes(512)
    host = HostTier(_settings(budget=2 * one), max_rollback=1)
    prompts = [_tokens(512, seed) for seed in range(3)]
    assert host.offload(prompts[0], None) and host.offload(prompts[1], None)
    # The first is used again: the second is now the least recently used.
    match = host.match(np.concatenate([prompts[0], _tokens(64, 9)]), 570, None, 0)
    assert match is not None
    host.index.touch(match.entry)
    assert host.offload(prompts[2], None)
    held = [entry.tokens for entry in host.entries()]
    assert len(held) == 2 and host.used_bytes == 2 * one
    assert not any(np.array_equal(tokens, prompts[1]) for tokens in held)
    # An entry a waiting prompt counts on is never dropped; with only those, no room is made.
    for entry in host.entries():
        host.pin(entry)
    assert not host.offload(_tokens(512, 7), None)
    assert len(host.index) == 2
    # Larger than the whole budget: never kept.
    assert not HostTier(_settings(budget=one - 1), max_rollback=1).offload(prompts[0], None)


def test_a_partition_over_its_share_gives_room_first() -> None:
    one = _settings().copy_bytes(512)
    host = HostTier(_settings(budget=3 * one), max_rollback=1)
    # Key b's one entry is the least recently used, but key a holds more than its half.
    assert host.offload(_tokens(512, 0), b"b")
    assert host.offload(_tokens(512, 1), b"a")
    assert host.offload(_tokens(512, 2), b"a")
    assert host.offload(_tokens(512, 3), b"a")
    salts = sorted(entry.salt or b"" for entry in host.entries())
    assert salts == [b"a", b"a", b"b"]
    # With every partition within its share, the least recently used goes.
    host = HostTier(_settings(budget=2 * one), max_rollback=1)
    assert host.offload(_tokens(512, 0), b"b")
    assert host.offload(_tokens(512, 1), b"a")
    assert host.offload(_tokens(512, 2), b"c")
    assert sorted(entry.salt or b"" for entry in host.entries()) == [b"a", b"c"]


def test_a_restore_queues_last_and_a_fork_first() -> None:
    engine = _engine()
    evicted, kept = _turn("Hello."), _turn("Bonjour.")
    _cached(engine, "one", evicted)
    _clear(engine)
    _cached(engine, "two", kept)
    engine._admission.ttft_ms = 60_000.0  # everything waits
    for request_id, prompt in (
        ("plain", _turn("Hola.")),
        ("restore", _turn("Hello.", "Run the tests.")),
        ("fork", _turn("Bonjour.", "Run the tests.")),
    ):
        sequence = engine.add_request("0", request_id, {"max_tokens": 4}, prompt)
        assert sequence is not None
    waiting = engine._table.waiting
    assert [sequence.request_id for sequence in waiting] == ["fork", "plain", "restore"]
    assert waiting[0].fork_of is not None and waiting[2].restore_of is not None
    engine.abort_request(["plain", "restore", "fork"])
    list(run_to_end(engine))
