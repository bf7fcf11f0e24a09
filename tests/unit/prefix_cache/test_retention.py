"""Retention's pins on an injected clock: per-partition budgets in blocks, renewal by a rewrite
of the same prompt, expiry with the ttl, and the eviction order that puts pinned entries last."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from deepinfer_server.model.kv_block import BLOCK_SIZE, blocks_for
from deepinfer_server.prefix_cache.index import CacheEntry, PrefixIndex
from deepinfer_server.prefix_cache.retention import Retention


class Clock:
    """A retention clock the test moves."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _tokens(count: int, seed: int) -> npt.NDArray[np.int32]:
    return np.random.default_rng(seed).integers(10, 1000, size=count, dtype=np.int32)


def _entries(
    index: PrefixIndex[int], count: int, salt: bytes | None = b"a"
) -> list[CacheEntry[int]]:
    return [index.add(number, _tokens(512, number), salt) for number in range(count)]


def test_over_its_partitions_budget_a_write_is_kept_unpinned() -> None:
    index: PrefixIndex[int] = PrefixIndex()
    clock = Clock()
    retention = Retention(key_budget_blocks=2 * 512 // BLOCK_SIZE, clock=clock)
    entries = _entries(index, 3)
    assert retention.pin(entries[0], 60) and retention.pin(entries[1], 60)
    assert not retention.pin(entries[2], 60)  # over key a's budget: plain LRU
    assert not retention.pinned(entries[2])
    assert retention.pin(index.add(9, _tokens(512, 9), b"b"), 60)  # another key's own budget
    assert retention.pin(entries[0], 60)  # a rewrite renews its pin within the same budget
    assert retention.pinned_blocks(b"a") == 2 * 512 // BLOCK_SIZE
    clock.now += 61
    assert retention.pinned_blocks(b"a") == 0 and retention.pin(entries[2], 60)
    assert retention.last(entries) == [entries[0], entries[1], entries[2]]


def test_a_partial_block_counts_as_a_whole_one() -> None:
    index: PrefixIndex[int] = PrefixIndex()
    retention = Retention(key_budget_blocks=2, clock=Clock())
    assert not retention.pin(index.add(0, _tokens(2 * BLOCK_SIZE + 1, 0), None), 60)
    assert retention.pin(index.add(1, _tokens(2 * BLOCK_SIZE, 1), None), 60)
    assert retention.pinned_blocks(None) == 2


def test_a_rewrite_of_the_same_prompt_renews_its_pin() -> None:
    index: PrefixIndex[int] = PrefixIndex()
    clock = Clock()
    retention = Retention(key_budget_blocks=100, clock=clock)
    prompt = _tokens(300, 0)
    first = index.add(0, prompt, b"a")
    assert retention.pin(first, 60)
    clock.now += 50
    # The same prompt kept again (a later request's write): one pin, its ttl from now.
    second = index.add(1, prompt, b"a")
    assert retention.pin(second, 60)
    assert retention.pinned_blocks(b"a") == blocks_for(300)
    clock.now += 30  # past the first write's ttl, within the rewrite's
    assert retention.pinned(first) and retention.pinned(second)
    clock.now += 31
    assert not retention.pinned(first) and retention.pinned_blocks(b"a") == 0


def test_the_same_tokens_under_another_salt_are_another_pin() -> None:
    index: PrefixIndex[int] = PrefixIndex()
    retention = Retention(key_budget_blocks=100, clock=Clock())
    prompt = _tokens(300, 0)
    salted = index.add(0, prompt, b"a")
    assert retention.pin(salted, 60)
    assert not retention.pinned(index.add(1, prompt, b"b"))
    assert not retention.pinned(index.add(2, prompt, None))


def test_pinned_entries_go_last_and_each_group_keeps_its_order() -> None:
    index: PrefixIndex[int] = PrefixIndex()
    clock = Clock()
    retention = Retention(key_budget_blocks=100, clock=clock)
    entries = _entries(index, 5)
    assert retention.last(entries) == entries  # nothing pinned: the order as given
    assert retention.pin(entries[3], 60) and retention.pin(entries[0], 120)
    order = retention.last(index.eviction_order())
    assert order == [entries[1], entries[2], entries[4], entries[0], entries[3]]
    clock.now += 61  # entries[3]'s pin runs out: it goes back to its LRU place
    assert retention.last(index.eviction_order()) == [*entries[1:], entries[0]]


def test_a_released_pin_frees_its_partitions_budget() -> None:
    index: PrefixIndex[int] = PrefixIndex()
    retention = Retention(key_budget_blocks=512 // BLOCK_SIZE, clock=Clock())
    first, second = _entries(index, 2)
    assert retention.pin(first, 3600) and not retention.pin(second, 3600)
    index.remove(first)
    retention.release(first, index)  # evicted, and no tier holds it
    assert retention.pinned_blocks(b"a") == 0 and retention.pin(second, 3600)


def test_a_pin_stays_while_the_cache_holds_the_same_prompt_again() -> None:
    index: PrefixIndex[int] = PrefixIndex()
    retention = Retention(key_budget_blocks=100, clock=Clock())
    prompt = _tokens(300, 0)
    first, again = index.add(0, prompt, b"a"), index.add(1, prompt, b"a")
    assert retention.pin(first, 60) and retention.pin(again, 60)
    index.remove(first)
    retention.release(first, index)
    assert retention.pinned(again)
    index.remove(again)
    retention.release(again, index)
    assert not retention.pinned(again) and retention.pinned_blocks(b"a") == 0
