"""Retention: prompts a request asked the prefix cache to keep for a time, and their pins.

Engine-independent: both engines' caches pin with it (`engines/simulated/prefix_cache.py`,
`engines/deepinfer/prefix_cache.py`).

A request with a retention (`AddRequest.retention_seconds`: Anthropic's `cache_control` ttl,
OpenAI's `prompt_cache_retention`) whose prompt the cache can keep has it written when it
ends (the simulated `PrefixCache.finish`, DeepInfer's `finalize_seq`); the write is decided
at admission, so that the engine reports the written tokens with the request's first output,
as it reports the cached ones. The entry is then pinned until its ttl runs out, within a
per-partition budget (a partition: the API key's scope and the request's `cache_salt`),
measured in KV blocks:

- in the pool, pinned entries are evicted after every unpinned one (least recently used
  first within each group), and only when the pool needs the room;
- in the host tier, a pinned entry is never dropped for room: a copy that only pinned
  entries stand in the way of is not made.

A write over its partition's budget is kept as any prompt (plain LRU, no pin); a rewrite of
the same prompt renews its pin. A pin is looked up by the entry's prompt (its salt and a digest
of its tokens, which no index's secret hash weights change), so it follows the entry from the
pool to the host tier and back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from deepinfer_server.model.kv_block import blocks_for
from deepinfer_server.prefix_cache.index import CacheEntry

#: The share of its tier (the host tier's blocks, else the pool's) one partition may pin, by
#: default (`--prefix-cache-retention-share`).
KEY_BUDGET_SHARE = 0.25

_E = TypeVar("_E", bound=CacheEntry[Any])
_PinKey = tuple[bytes | None, bytes]


@dataclass(slots=True)
class Pin:
    """One pinned prompt: until when (the retention clock's seconds), and its blocks."""

    until: float
    blocks: int


def _key_of(entry: CacheEntry[Any]) -> _PinKey:
    """The entry's prompt, the same whichever tier's index holds it: its salt and its tokens'
    digest."""
    return entry.salt, entry.prompt_digest()


class Retention:
    """The pins of one rank's prefix cache (its loop's thread owns it)."""

    def __init__(self, key_budget_blocks: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.key_budget_blocks = key_budget_blocks
        self._clock = clock
        self._pins: dict[_PinKey, Pin] = {}

    def pin(self, entry: CacheEntry[Any], seconds: float) -> bool:
        """Pin a just-written entry for `seconds`; False (left unpinned) when its partition's
        live pins and it would exceed the budget."""
        self._expire()
        key = _key_of(entry)
        blocks = blocks_for(entry.length)
        held = sum(pin.blocks for (salt, *_), pin in self._pins.items() if salt == entry.salt)
        held -= self._pins[key].blocks if key in self._pins else 0
        if held + blocks > self.key_budget_blocks:
            return False
        self._pins[key] = Pin(self._clock() + seconds, blocks)
        return True

    def release(self, entry: CacheEntry[Any], held: Iterable[CacheEntry[Any]]) -> None:
        """`entry` left the cache: its pin goes, unless another entry of `held` (those the
        cache still holds) is the same prompt. A pin of a prompt no tier holds would count
        against its partition's budget until its ttl (up to a day) for nothing."""
        key = _key_of(entry)
        if key not in self._pins:
            return
        for other in held:
            if other.length == entry.length and _key_of(other) == key:
                return
        del self._pins[key]

    def pinned(self, entry: CacheEntry[Any]) -> bool:
        """Whether `entry`'s prompt is pinned now."""
        pin = self._pins.get(_key_of(entry))
        return pin is not None and pin.until > self._clock()

    def last(self, entries: Iterable[_E]) -> list[_E]:
        """`entries` (an eviction order) with the pinned ones moved after the others."""
        listed = list(entries)
        if not self._pins:  # the common case: nothing to reorder, no key to build
            return listed
        marks = [self.pinned(entry) for entry in listed]
        free = [entry for entry, pinned in zip(listed, marks, strict=True) if not pinned]
        pinned = [entry for entry, pinned in zip(listed, marks, strict=True) if pinned]
        return free + pinned

    def pinned_blocks(self, salt: bytes | None) -> int:
        """The blocks partition `salt` has pinned now."""
        self._expire()
        return sum(pin.blocks for (key_salt, *_), pin in self._pins.items() if key_salt == salt)

    def _expire(self) -> None:
        now = self._clock()
        for key in [key for key, pin in self._pins.items() if pin.until <= now]:
            del self._pins[key]
