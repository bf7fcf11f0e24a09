"""PrefixIndex: which cached sequence a new prompt can be forked from, and at which token.

A cached sequence (an *entry*) is a finished request whose KV blocks are kept together with a
snapshot of its per-sequence state taken at the end of its prompt, after P tokens. V4.1's state
(sliding-window and compression rings) is valid at the position it was taken and a few tokens
back (the rings keep room for speculative-decoding rollback), never further: a new prompt can
reuse an entry only at a fork point F with `P - max_rollback <= F <= P` and the first F tokens
equal. A full prefix match gives F = P; a thinking-mode user turn, whose rendering drops the
`<think>` that ended the earlier prompt, shares P - 1 tokens and gives F = P - 1.

Lookup is "hash, then compare": every entry is filed under the chained hash of its first
`128 * d` tokens, d = (P - max_rollback) // 128 (the blocks any acceptable fork point covers), so
a prompt probes one dictionary key per depth; candidates are then compared token by token.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

#: DeepInfer's KV block size (tokens per block), the unit hashes are chained over.
BLOCK_SIZE = 128
_DIGEST_BYTES = 16

T = TypeVar("T")


def chain_hashes(
    tokens: npt.NDArray[np.int32], num_blocks: int, block_size: int = BLOCK_SIZE
) -> list[bytes]:
    """`h_i = blake2b(h_(i-1) || block i)` over the first `num_blocks` full blocks of `tokens`."""
    count = min(num_blocks, len(tokens) // block_size)
    data = np.ascontiguousarray(tokens[: count * block_size], dtype="<i4").tobytes()
    stride = block_size * 4
    hashes: list[bytes] = []
    previous = b""
    for offset in range(0, count * stride, stride):
        previous = hashlib.blake2b(
            previous + data[offset : offset + stride], digest_size=_DIGEST_BYTES
        ).digest()
        hashes.append(previous)
    return hashes


_stamps = itertools.count(1)


@dataclass(eq=False)
class CacheEntry(Generic[T]):
    """One cached sequence: the engine's handle, its first P tokens and its index key."""

    value: T
    tokens: npt.NDArray[np.int32]
    key: tuple[int, bytes]
    #: Forks made from this entry that have not ended; eviction prefers entries without any.
    live_forks: int = 0
    #: When it was last added or forked from (larger is more recent).
    stamp: int = field(default_factory=lambda: next(_stamps))

    @property
    def length(self) -> int:
        """P: the tokens its state snapshot was taken after."""
        return len(self.tokens)


@dataclass(frozen=True)
class Match(Generic[T]):
    """Where a prompt forks from a cached sequence: its first `fork_point` tokens are reused."""

    entry: CacheEntry[T]
    fork_point: int


class PrefixIndex(Generic[T]):
    """The cached sequences of one engine, by chained block hash and by last use.

    Not thread-safe: the engine's loop thread owns it.
    """

    def __init__(self, max_rollback: int = 1, block_size: int = BLOCK_SIZE) -> None:
        assert max_rollback >= 0, "a fork point can never be past the snapshot"
        self.max_rollback = max_rollback
        self.block_size = block_size
        self._by_key: dict[tuple[int, bytes], list[CacheEntry[T]]] = {}
        #: Every entry, least recently used first.
        self._lru: OrderedDict[CacheEntry[T], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __iter__(self) -> Iterator[CacheEntry[T]]:
        return iter(list(self._lru))

    def key_depth(self, length: int) -> int:
        """The full blocks every acceptable fork point of a length-`length` entry covers."""
        return max(0, length - self.max_rollback) // self.block_size

    def add(self, value: T, tokens: npt.NDArray[np.int32]) -> CacheEntry[T]:
        """File a cached sequence whose state was snapshotted after `tokens`."""
        depth = self.key_depth(len(tokens))
        hashes = chain_hashes(tokens, depth, self.block_size)
        key = (depth, hashes[-1] if hashes else b"")
        entry = CacheEntry(value, np.array(tokens, dtype=np.int32), key)
        self._by_key.setdefault(key, []).append(entry)
        self._lru[entry] = None
        return entry

    def remove(self, entry: CacheEntry[T]) -> None:
        """Forget an entry (evicted); the caller frees what it holds."""
        del self._lru[entry]
        bucket = self._by_key[entry.key]
        bucket.remove(entry)
        if not bucket:
            del self._by_key[entry.key]

    def touch(self, entry: CacheEntry[T]) -> None:
        """Mark an entry as just used."""
        entry.stamp = next(_stamps)
        self._lru.move_to_end(entry)

    def eviction_order(self) -> list[CacheEntry[T]]:
        """Entries to evict first to last: least recently used, those without live forks first
        (evicting an entry a fork still pins frees nothing until the fork ends)."""
        idle = [entry for entry in self._lru if entry.live_forks == 0]
        busy = [entry for entry in self._lru if entry.live_forks > 0]
        return idle + busy

    def match(self, prompt: npt.NDArray[np.int32], limit: int) -> Match[T] | None:
        """The entry that lets `prompt` reuse the most tokens, with a fork point <= `limit`.

        The fork point F is the longest common prefix of the prompt and the entry's P tokens,
        capped at `limit` (an engine may need to compute the prompt's last tokens itself); it
        is accepted when `F >= P - max_rollback`. Ties go to the most recently used entry.
        """
        if not self._lru or limit <= 0:
            return None
        limit = min(limit, len(prompt))
        max_depth = limit // self.block_size
        hashes = chain_hashes(prompt, max_depth, self.block_size)
        for depth in range(len(hashes), -1, -1):
            bucket = self._by_key.get((depth, hashes[depth - 1] if depth else b""))
            if not bucket:
                continue
            best: Match[T] | None = None
            for entry in bucket:
                fork_point = self._fork_point(prompt, entry, depth, limit)
                if fork_point is None:
                    continue
                if (
                    best is None
                    or fork_point > best.fork_point
                    or (fork_point == best.fork_point and entry.stamp > best.entry.stamp)
                ):
                    best = Match(entry, fork_point)
            if best is not None:
                return best
        return None

    def _fork_point(
        self, prompt: npt.NDArray[np.int32], entry: CacheEntry[T], depth: int, limit: int
    ) -> int | None:
        """F for this candidate, or None; the hashed blocks are compared again token by token
        (a hash collision must never fork from the wrong tokens)."""
        length = entry.length
        start = depth * self.block_size
        if length - self.max_rollback > limit:
            return None
        if not np.array_equal(prompt[:start], entry.tokens[:start]):
            return None
        end = min(length, len(prompt))
        differ = np.flatnonzero(prompt[start:end] != entry.tokens[start:end])
        common = start + int(differ[0]) if differ.size else end
        fork_point = min(common, limit)
        return fork_point if fork_point >= length - self.max_rollback else None
