"""The prefix cache's shared store tier on the simulated engine, against an in-memory store
client: a prompt one engine cached is restored by another (counted as the store's hits) at a
cached entry's end, where its state snapshot was taken, never at a mere block boundary, never
across a partition or a layout; a store failure is a miss, and a write never waits."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from deepinfer_server.engines.simulated.engine import LLMEngine
from deepinfer_server.prefix_cache.host_tier import HostTierSettings
from deepinfer_server.prefix_cache.store_pages import SNAPSHOT_SLOTS, page_keys
from deepinfer_server.prefix_cache.store_tier import (
    StoreClient,
    StoreTier,
    StoreTierSettings,
)
from tests.unit.engines.test_simulated_engine import make_engine, run_to_end
from tests.unit.engines.test_simulated_prefix_cache import _cached, _turn

BLOCK_BYTES = 114_048
STATE_BYTES = 2_954_688
LAYOUT = b"simulated layout"


class FakeStore:
    """Mooncake Store's calls on a dict shared by every client of one "master"."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def put(self, key: str, value: bytes) -> int:
        with self.lock:
            self.values[key] = value
        return 0

    def get_batch(self, keys: list[str]) -> list[bytes]:
        if not keys:
            return [b""]  # as Mooncake answers a read of no key
        with self.lock:
            return [self.values.get(key, b"") for key in keys]

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        with self.lock:
            return [int(key in self.values) for key in keys]


class LostMaster(FakeStore):
    """A client whose master went away: every call answers an error code."""

    def put(self, key: str, value: bytes) -> int:
        return -900

    def get_batch(self, keys: list[str]) -> list[bytes]:
        return [b""] * len(keys)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [-900] * len(keys)


def _tier(client: StoreClient, identity: bytes = LAYOUT, timeout: float = 5.0) -> StoreTier:
    settings = StoreTierSettings(identity, bandwidth=25e9, lookup_timeout=timeout)
    return StoreTier(settings, lambda: client)


def _engine(store: StoreTier) -> LLMEngine:
    host = HostTierSettings(1 << 40, 50e9, BLOCK_BYTES, STATE_BYTES, 20_000.0)
    return make_engine(enable_prefix_caching=True, host_tier=host, store_tier=store)


def _written(shared: FakeStore, *prompts: np.ndarray, salt: bytes | None = None) -> None:
    """Cache each of `prompts` on an engine of its own writing to `shared`."""
    for number, prompt in enumerate(prompts):
        writer = _tier(shared)
        engine = _engine(writer)
        engine.add_request("0", f"w{number}", {"max_tokens": 2}, prompt, cache_salt=salt)
        list(run_to_end(engine))
        writer.drain()


def test_a_turn_moved_to_another_engine_is_restored_from_the_store() -> None:
    shared = FakeStore()
    first, second = _turn("Hello."), _turn("Hello.", "Run the tests.")
    assert len(first) % 128  # its snapshot is mid-block
    writer, reader = _tier(shared), _tier(shared)
    _cached(_engine(writer), "one", first)
    writer.drain()
    assert writer.pages_written == len(first) // 128 == len(shared.values) - 1
    assert writer.snapshots_written == 1
    engine = _engine(reader)
    computed = engine.prompt_tokens_computed
    # Restored at the first turn's end, where its state was taken, not at the page before.
    assert _cached(engine, "two", second) == len(first)
    assert engine.prompt_tokens_computed - computed == len(second) - len(first)
    stats = engine.host_tier_stats()
    assert stats is not None
    assert stats.store_hit_tokens == stats.hit_tokens == len(first)
    assert stats.store_errors == 0


def test_whole_pages_without_a_snapshot_restore_nothing() -> None:
    shared = FakeStore()
    first = _turn("Hello.")
    _written(shared, first)
    # Its first three pages, then other tokens: no state was ever taken in there.
    other = np.concatenate([first[:384], first[384:] + 1, first[:100]]).astype(np.int32)
    engine = _engine(_tier(shared))
    assert _cached(engine, "two", other) == 0
    assert engine.prompt_tokens_computed == len(other)


def test_entries_ending_in_the_same_block_are_each_found() -> None:
    shared = FakeStore()
    base = _turn("Hello.")
    end = len(base) - len(base) % 128 + 60  # mid-block, with room for a longer one after it
    short = np.concatenate([base, base[:80]])[:end].astype(np.int32)
    long = np.concatenate([short, base[5:35]]).astype(np.int32)
    assert len(short) // 128 == len(long) // 128
    _written(shared, short, long)
    engine = _engine(_tier(shared))
    more = base[200:300]
    assert _cached(engine, "short", np.concatenate([short, more + 7])) == len(short)
    engine = _engine(_tier(shared))
    assert _cached(engine, "long", np.concatenate([long, more])) == len(long)


def test_a_thinking_turn_restores_from_the_snapshot_one_token_on() -> None:
    shared = FakeStore()
    first = _turn("Hello.", thinking=True)
    second = _turn("Hello.", "Run the tests.", thinking=True)
    _written(shared, first)
    assert second[len(first) - 1] != first[-1]
    assert _cached(_engine(_tier(shared)), "two", second) == len(first) - 1


def test_a_block_aligned_entry_serves_a_thinking_turn() -> None:
    shared = FakeStore()
    first = _turn("Hello.", thinking=True)
    aligned = np.concatenate([first[: len(first) - len(first) % 128 - 1], first[-1:]])
    assert len(aligned) % 128 == 0
    _written(shared, aligned)
    second = np.concatenate([aligned[:-1], first[10:200]]).astype(np.int32)
    assert _cached(_engine(_tier(shared)), "two", second) == len(aligned) - 1


def test_the_restore_lasts_the_store_copy_and_the_host_copy() -> None:
    shared = FakeStore()
    first, second = _turn("Hello."), _turn("Hello.", "Run the tests.")
    writer = _tier(shared)
    _cached(_engine(writer), "one", first)
    writer.drain()
    engine = _engine(_tier(shared))
    engine.add_request("0", "two", {"max_tokens": 2}, second)
    cache = engine._cache
    assert cache.host is not None
    nbytes = cache.host.settings.copy_bytes(len(first))
    engine.step()
    assert cache.host.restore_bytes == nbytes
    assert cache.host.restore_seconds == pytest.approx(nbytes / 50e9)


@pytest.mark.parametrize(("written", "read"), [(None, b"salt"), (b"salt", None), (b"a", b"b")])
def test_no_hit_crosses_a_partition(written: bytes | None, read: bytes | None) -> None:
    shared = FakeStore()
    first, second = _turn("Hello."), _turn("Hello.", "Run the tests.")
    writer = _tier(shared)
    engine = _engine(writer)
    assert engine.add_request("0", "one", {"max_tokens": 2}, first, cache_salt=written)
    list(run_to_end(engine))
    writer.drain()
    assert shared.values
    reader = _tier(shared)
    engine = _engine(reader)
    sequence = engine.add_request("0", "two", {"max_tokens": 2}, second, cache_salt=read)
    assert sequence is not None and sequence.num_cached_tokens == 0
    assert reader.errors == 0  # a miss, not a failure


def test_the_key_includes_the_layout_and_the_partition() -> None:
    tokens = np.arange(300, dtype=np.int32)
    keys = page_keys(LAYOUT, None, tokens)
    assert len(keys) == 2 and len(set(keys)) == 2
    assert page_keys(b"another layout", None, tokens)[0] != keys[0]
    assert page_keys(LAYOUT, b"", tokens)[0] != keys[0]
    changed = tokens.copy()
    changed[5] += 1
    assert page_keys(LAYOUT, None, changed)[1] != keys[1]


def test_rows_of_another_layout_are_not_read() -> None:
    shared = FakeStore()
    first, second = _turn("Hello."), _turn("Hello.", "Run the tests.")
    writer = _tier(shared)
    _cached(_engine(writer), "one", first)
    writer.drain()
    engine = _engine(_tier(shared, identity=b"another layout"))
    assert _cached(engine, "two", second) == 0


def test_a_lost_master_is_a_miss_and_counted() -> None:
    second = _turn("Hello.", "Run the tests.")
    store = _tier(LostMaster())
    engine = _engine(store)
    assert _cached(engine, "two", second) == 0
    store.drain()  # the finished prompt's write failed too
    stats = engine.host_tier_stats()
    assert stats is not None and stats.store_errors == 2


def test_a_client_that_cannot_connect_is_a_miss() -> None:
    def refuse() -> StoreClient:
        raise RuntimeError("no master")

    store = StoreTier(StoreTierSettings(LAYOUT, 25e9, lookup_timeout=5.0), refuse)
    engine = _engine(store)
    assert _cached(engine, "two", _turn("Hello.", "Run the tests.")) == 0
    assert store.errors == 1  # the connection is retried later, not at once


def test_an_unanswered_lookup_is_a_miss() -> None:
    release = threading.Event()

    class Hung(FakeStore):
        def batch_is_exist(self, keys: list[str]) -> list[int]:
            release.wait()
            return super().batch_is_exist(keys)

    store = _tier(Hung(), timeout=0.01)
    engine = _engine(store)
    sequence = engine.add_request("0", "two", {"max_tokens": 2}, _turn("Hello.", "Again."))
    assert sequence is not None and sequence.num_cached_tokens == 0
    assert store.errors == 1
    # While it stays unanswered, the next lookups miss without waiting for the store.
    prompt = _turn("Hello.", "Once more.")
    queued = store._lookups.qsize()
    assert store.lookup(prompt, None) == []
    assert store.errors == 2 and store._lookups.qsize() == queued  # never asked
    release.set()


def test_writes_never_wait_for_the_store() -> None:
    release = threading.Event()

    class Slow(FakeStore):
        def batch_is_exist(self, keys: list[str]) -> list[int]:
            release.wait()
            return super().batch_is_exist(keys)

    client = Slow()
    store = StoreTier(StoreTierSettings(LAYOUT, 25e9, queue_depth=2), lambda: client)
    tokens = np.arange(256, dtype=np.int32)
    for _ in range(10):
        store.write(tokens, None)  # returns while the writer is stuck
    assert store.dropped >= 7
    release.set()
    store.drain()
    assert store.pages_written == 2 and store.snapshots_written == 1 and len(client.values) == 3


def test_a_store_slower_than_computing_is_not_read() -> None:
    shared = FakeStore()
    first, second = _turn("Hello."), _turn("Hello.", "Run the tests.")
    writer = _tier(shared)
    _cached(_engine(writer), "one", first)
    writer.drain()
    slow = StoreTier(StoreTierSettings(LAYOUT, bandwidth=1e3, lookup_timeout=5.0), lambda: shared)
    assert _cached(_engine(slow), "two", second) == 0


def test_a_prompt_the_pool_serves_whole_is_not_looked_up() -> None:
    class Counting(FakeStore):
        asked = 0

        def batch_is_exist(self, keys: list[str]) -> list[int]:
            Counting.asked += 1
            return super().batch_is_exist(keys)

    client = Counting()
    store = _tier(client)
    engine = _engine(store)
    first = _turn("Hello.")
    _cached(engine, "one", first)
    store.drain()
    asked = Counting.asked  # the first turn's lookup and its write
    # Two tokens more: the pool's fork leaves no whole page beyond it for the store.
    longer = np.concatenate([first, first[-2:]])
    assert _cached(engine, "longer", longer) == len(first)
    store.drain()
    assert Counting.asked == asked + 1  # only the write's existence check


def test_a_boundary_keeps_one_copy_of_each_snapshot_up_to_its_slots() -> None:
    shared = FakeStore()
    store = _tier(shared)
    base = np.arange(300, dtype=np.int32)
    for _ in range(2):
        store.write(base, None)
    # Prompts ending in the same block as `base` after the same pages, one more than the slots.
    for extra in range(SNAPSHOT_SLOTS):
        store.write(np.concatenate([base[:-1], [1000 + extra]]).astype(np.int32), None)
    store.drain()
    assert store.pages_written == 2
    assert store.snapshots_written == SNAPSHOT_SLOTS  # the last prompt's has no slot left
    assert len(store.lookup(base, None)) == SNAPSHOT_SLOTS
    assert store.errors == 0


class _Rows:
    """Rows an engine stores beside the ids: each block's page number, the snapshot's mark."""

    def block(self, page: int) -> bytes:
        return bytes([page]) * 3

    def snapshot(self) -> bytes:
        return b"state"


def _rows_tier(client: StoreClient) -> StoreTier:
    settings = StoreTierSettings(LAYOUT, 25e9, lookup_timeout=5.0, block_rows=3, snapshot_rows=5)
    return StoreTier(settings, lambda: client)


def test_rows_stored_beside_the_ids_come_back_with_the_snapshot() -> None:
    shared = FakeStore()
    writer, reader = _rows_tier(shared), _rows_tier(shared)
    prompt = np.arange(300, dtype=np.int32)
    writer.write(prompt, b"salt", _Rows())
    writer.drain()
    (found,) = reader.lookup(np.concatenate([prompt, [7, 8]]).astype(np.int32), b"salt")
    assert found.tokens.tolist() == prompt.tolist()
    assert found.at == 2
    assert found.blocks == [b"\x00" * 3, b"\x01" * 3]
    assert found.state == b"state"
    assert reader.lookup(prompt, b"other") == []


def test_a_page_whose_ids_differ_from_the_prompt_is_a_miss() -> None:
    shared = FakeStore()
    store = _rows_tier(shared)
    prompt = np.arange(300, dtype=np.int32)
    store.write(prompt, None, _Rows())
    store.drain()
    (first,) = page_keys(LAYOUT, None, prompt)[:1]
    # A foreign value under the key (another writer's, or one evicted and replaced).
    shared.values[first] = np.arange(1, 129, dtype="<i4").tobytes() + b"abc"
    assert store.lookup(prompt, None) == []
    assert store.errors == 0
