"""The prefix index's match rule: hash, then compare; rollback budget; the caller's limit; LRU."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import numpy.typing as npt
from hypothesis import given, settings
from hypothesis import strategies as st

from deepinfer_server.model.kv_block import BLOCK_SIZE
from deepinfer_server.prefix_cache.index import PrefixIndex


def tokens(*parts: Iterable[int]) -> npt.NDArray[np.int32]:
    """Concatenate token lists and `range`s into a prompt."""
    return np.array([t for part in parts for t in part], dtype=np.int32)


def test_an_extended_prompt_forks_at_the_entrys_end() -> None:
    index: PrefixIndex[str] = PrefixIndex()
    turn1 = tokens(range(1000))
    entry = index.add("turn1", turn1)
    turn2 = tokens(range(1000), range(5000, 5300))
    match = index.match(turn2, limit=len(turn2) - 2)
    assert match is not None
    assert (match.entry, match.fork_point) == (entry, 1000)


def test_a_prompt_that_drops_the_last_token_forks_one_token_back() -> None:
    # Thinking mode: turn 1 ended with <think>, turn 2 renders </think> there instead.
    index: PrefixIndex[str] = PrefixIndex(max_rollback=1)
    index.add("turn1", tokens(range(1000)))
    turn2 = tokens(range(999), [7], range(5000, 5300))
    match = index.match(turn2, limit=len(turn2) - 2)
    assert match is not None and match.fork_point == 999


def test_a_rollback_at_a_block_boundary_is_found() -> None:
    # P = 1024: the deepest block a P - 1 fork covers is the 7th, not the 8th.
    index: PrefixIndex[str] = PrefixIndex(max_rollback=1)
    index.add("turn1", tokens(range(1024)))
    turn2 = tokens(range(1023), [7], range(5000, 5100))
    match = index.match(turn2, limit=len(turn2) - 2)
    assert match is not None and match.fork_point == 1023


def test_no_fork_beyond_the_rollback_budget() -> None:
    index: PrefixIndex[str] = PrefixIndex(max_rollback=1)
    index.add("turn1", tokens(range(1000)))
    two_back = tokens(range(998), [7, 7], range(5000, 5300))
    assert index.match(two_back, limit=len(two_back) - 2) is None
    shared_system_prompt = tokens(range(600), range(9000, 9400))
    assert index.match(shared_system_prompt, limit=len(shared_system_prompt) - 2) is None


def test_the_limit_caps_the_fork_point() -> None:
    index: PrefixIndex[str] = PrefixIndex(max_rollback=1)
    index.add("turn1", tokens(range(1000)))
    retry = tokens(range(1000))  # the same prompt again: the engine must compute 2 tokens
    assert index.match(retry, limit=len(retry) - 2) is None
    one_more = tokens(range(1000), [7])
    match = index.match(one_more, limit=len(one_more) - 2)
    assert match is not None and match.fork_point == 999


def test_a_hash_collision_never_forks_from_other_tokens() -> None:
    index: PrefixIndex[str] = PrefixIndex()
    entry = index.add("turn1", tokens(range(1000)))
    other = tokens([9] * 1000, range(5000, 5100))
    # Forge the collision: file the entry under the other prompt's hash at its depth.
    index._by_key.clear()
    depth = entry.key[0]
    entry.key = (depth, index.hashes(other, depth)[-1])
    index._by_key[entry.key] = [entry]
    assert index.match(other, limit=len(other) - 2) is None


def test_a_salted_entry_serves_only_prompts_with_its_salt() -> None:
    index: PrefixIndex[str] = PrefixIndex()
    tenant_a = index.add("a", tokens(range(1000)), salt=b"tenant-a")
    prompt = tokens(range(1000), range(5000, 5300))
    limit = len(prompt) - 2
    assert index.match(prompt, limit) is None
    assert index.match(prompt, limit, salt=b"tenant-b") is None
    match = index.match(prompt, limit, salt=b"tenant-a")
    assert match is not None and (match.entry, match.fork_point) == (tenant_a, 1000)
    unsalted = index.add("none", tokens(range(1000)))
    match = index.match(prompt, limit)
    assert match is not None and match.entry is unsalted


def test_the_salt_changes_every_prefix_hash() -> None:
    # As vLLM mixes cache_salt into the first block's hash: no depth's hash is shared.
    index: PrefixIndex[str] = PrefixIndex()
    prompt = tokens(range(1000))
    plain = index.hashes(prompt, 7)
    salted = index.hashes(prompt, 7, b"s")
    assert len(salted) == 7 and all(a != b for a, b in zip(plain, salted, strict=True))
    assert index.hashes(prompt, 7, b"s") == salted != index.hashes(prompt, 7, b"t")


def test_a_hash_collision_never_forks_across_salts() -> None:
    index: PrefixIndex[str] = PrefixIndex()
    entry = index.add("a", tokens(range(1000)), salt=b"tenant-a")
    prompt = tokens(range(1000), range(5000, 5100))
    # Forge the collision: file the entry under tenant b's hash of the same tokens.
    index._by_key.clear()
    depth = entry.key[0]
    entry.key = (depth, index.hashes(prompt, depth, b"tenant-b")[-1])
    index._by_key[entry.key] = [entry]
    assert index.match(prompt, len(prompt) - 2, salt=b"tenant-b") is None


def test_prefix_hashes_depend_on_the_prefix_only() -> None:
    index: PrefixIndex[str] = PrefixIndex()
    short = index.hashes(tokens(range(300)), 2)
    # Hashing a longer list grows the weights; the earlier prefixes keep their hashes.
    longer = index.hashes(tokens(range(256), [1] * 2000), 15)
    assert len(short) == 2 and longer[:2] == short and len(longer) == 15
    assert index.hashes(tokens([7], range(1, 256)), 2)[1] != short[1]
    assert index.hashes(tokens(range(100)), 3) == []


def test_the_longest_reuse_wins_then_the_most_recent() -> None:
    index: PrefixIndex[str] = PrefixIndex()
    index.add("short", tokens(range(500)))
    index.add("long", tokens(range(900)))
    first = index.add("same", tokens(range(700)))
    second = index.add("same-again", tokens(range(700)))
    prompt = tokens(range(900), range(5000, 5100))
    match = index.match(prompt, limit=len(prompt) - 2)
    assert match is not None and match.entry.value == "long"
    prompt = tokens(range(700), range(5000, 5100))
    match = index.match(prompt, limit=len(prompt) - 2)
    assert match is not None and match.entry is second
    index.touch(first)
    match = index.match(prompt, limit=len(prompt) - 2)
    assert match is not None and match.entry is first


def test_eviction_order_is_least_recent_first_and_idle_before_busy() -> None:
    index: PrefixIndex[str] = PrefixIndex()
    a = index.add("a", tokens(range(300)))
    b = index.add("b", tokens(range(400)))
    c = index.add("c", tokens(range(500)))
    index.touch(a)
    b.live_forks = 1
    assert index.eviction_order() == [c, a, b]
    index.remove(c)
    assert len(index) == 2 and list(index) == [b, a]


@settings(max_examples=200, deadline=None)
@given(
    length=st.integers(1, 4 * BLOCK_SIZE),
    common=st.integers(0, 5 * BLOCK_SIZE),
    extra=st.integers(0, 300),
    rollback=st.integers(0, 3),
)
def test_the_match_is_exactly_the_rule(length: int, common: int, extra: int, rollback: int) -> None:
    """Against a brute-force statement of the rule on random lengths."""
    index: PrefixIndex[str] = PrefixIndex(max_rollback=rollback)
    cached = tokens(range(1, length + 1))
    index.add("e", cached)
    common = min(common, length)
    prompt = tokens(range(1, common + 1), [0] * extra)  # 0 never occurs in the entry
    limit = len(prompt) - 2
    lcp = common
    expected = min(lcp, limit)
    match = index.match(prompt, limit)
    if limit > 0 and expected >= length - rollback:
        assert match is not None and match.fork_point == expected
    else:
        assert match is None
