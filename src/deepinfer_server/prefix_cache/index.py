"""PrefixIndex: which cached sequence a new prompt can be forked from, and at which token.

A cached sequence (an *entry*) is a finished request whose KV blocks are kept together with a
snapshot of its per-sequence state taken at the end of its prompt, after P tokens. V4.1's state
(sliding-window and compression rings) is valid at the position it was taken and a few tokens
back (the rings keep room for speculative-decoding rollback), never further: a new prompt can
reuse an entry only at a fork point F with `P - max_rollback <= F <= P` and the first F tokens
equal. A full prefix match gives F = P; a thinking-mode user turn, whose rendering drops the
`<think>` that ended the earlier prompt, shares P - 1 tokens and gives F = P - 1.

Lookup is "hash, then compare": every entry is filed under the hash of its first `128 * d`
tokens, d = (P - max_rollback) // 128 (the blocks any acceptable fork point covers), so a prompt
probes one dictionary key per depth; candidates are then compared token by token, so a hash
collision costs a compare, never a wrong fork. The hash of a prefix is the sum of
`token[p] * weight[p]` modulo 2**64 with random odd weights drawn once per index: one vectorised
pass gives every depth's hash (tens of microseconds for 14k tokens, where chaining blake2b over
the blocks took over half a millisecond).

A cache salt partitions the index (vLLM's `cache_salt`: requests with different salts never
share blocks). As vLLM mixes it into the hash of the first block, a salt's keyed 64-bit digest
is added to the first block's sum, so every depth's hash depends on it; an entry keeps its salt
and only a prompt with the same salt (or, both, none) is compared with it.
"""

from __future__ import annotations

import hashlib
import itertools
import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

from deepinfer_server.model.kv_block import BLOCK_SIZE

T = TypeVar("T")


class PrefixHasher:
    """Hashes of a token list's block-aligned prefixes: `sum(token[p] * weight[p]) mod 2**64`."""

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self._generator = np.random.default_rng(secrets.randbits(128))
        self._weights = np.empty(0, dtype=np.uint64)
        self._salt_key = secrets.token_bytes(32)

    def salt_term(self, salt: bytes | None) -> int:
        """What a salt adds to the first block's sum (and so to every prefix's hash): 0 for
        none, else a 64-bit digest keyed by this hasher's secret."""
        if salt is None:
            return 0
        digest = hashlib.blake2b(salt, digest_size=8, key=self._salt_key).digest()
        return int.from_bytes(digest, "little")

    def __call__(
        self, tokens: npt.NDArray[np.int32], num_blocks: int, salt: bytes | None = None
    ) -> list[int]:
        """The hashes of the first 1, 2, ... `num_blocks` full blocks of `tokens`, under
        `salt`."""
        count = min(num_blocks, len(tokens) // self.block_size)
        if count <= 0:
            return []
        length = count * self.block_size
        if len(self._weights) < length:
            more = self._generator.integers(
                0, 2**64, size=length - len(self._weights), dtype=np.uint64, endpoint=False
            )
            self._weights = np.concatenate([self._weights, more | np.uint64(1)])
        # Unsigned products and sums wrap modulo 2**64.
        products = tokens[:length].astype(np.uint64) * self._weights[:length]
        blocks = products.reshape(count, self.block_size).sum(axis=1, dtype=np.uint64)
        blocks[:1] += np.uint64(self.salt_term(salt))  # an array add wraps silently
        return [int(value) for value in np.cumsum(blocks, dtype=np.uint64)]


_stamps = itertools.count(1)


@dataclass(eq=False)
class CacheEntry(Generic[T]):
    """One cached sequence: the engine's handle, its first P tokens, its cache salt and its
    index key."""

    value: T
    tokens: npt.NDArray[np.int32]
    key: tuple[int, int]
    #: Only prompts with this salt may fork from it (None: prompts without one).
    salt: bytes | None = None
    #: Forks made from this entry that have not ended; eviction prefers entries without any.
    live_forks: int = 0
    #: When it was last added or forked from (larger is more recent).
    stamp: int = field(default_factory=lambda: next(_stamps))
    _prompt_digest: bytes | None = field(default=None, repr=False)

    @property
    def length(self) -> int:
        """P: the tokens its state snapshot was taken after."""
        return len(self.tokens)

    def prompt_digest(self) -> bytes:
        """A digest of its tokens, the same in every index (its `key` hashes under its own
        index's secret weights): what names its prompt from one tier to the next."""
        if self._prompt_digest is None:
            self._prompt_digest = hashlib.blake2b(self.tokens.tobytes(), digest_size=16).digest()
        return self._prompt_digest


@dataclass(frozen=True)
class Match(Generic[T]):
    """Where a prompt forks from a cached sequence: its first `fork_point` tokens are reused."""

    entry: CacheEntry[T]
    fork_point: int


class PrefixIndex(Generic[T]):
    """The cached sequences of one engine, by block-prefix hash and by last use.

    Not thread-safe: the engine's loop thread owns it.
    """

    def __init__(self, max_rollback: int = 1, block_size: int = BLOCK_SIZE) -> None:
        assert max_rollback >= 0, "a fork point can never be past the snapshot"
        self.max_rollback = max_rollback
        self.block_size = block_size
        self.hashes = PrefixHasher(block_size)
        self._by_key: dict[tuple[int, int], list[CacheEntry[T]]] = {}
        #: How many entries are filed at each depth (only those depths are probed).
        self._depths: dict[int, int] = {}
        #: Every entry, least recently used first.
        self._lru: OrderedDict[CacheEntry[T], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __iter__(self) -> Iterator[CacheEntry[T]]:
        return iter(list(self._lru))

    def key_depth(self, length: int) -> int:
        """The full blocks every acceptable fork point of a length-`length` entry covers."""
        return max(0, length - self.max_rollback) // self.block_size

    def add(
        self, value: T, tokens: npt.NDArray[np.int32], salt: bytes | None = None
    ) -> CacheEntry[T]:
        """File a cached sequence whose state was snapshotted after `tokens`, for prompts
        with the cache salt `salt`."""
        depth = self.key_depth(len(tokens))
        hashes = self.hashes(tokens, depth, salt)
        key = (depth, hashes[-1] if hashes else self.hashes.salt_term(salt))
        entry = CacheEntry(value, np.array(tokens, dtype=np.int32), key, salt)
        self._by_key.setdefault(key, []).append(entry)
        self._depths[depth] = self._depths.get(depth, 0) + 1
        self._lru[entry] = None
        return entry

    def remove(self, entry: CacheEntry[T]) -> None:
        """Forget an entry (evicted); the caller frees what it holds."""
        del self._lru[entry]
        bucket = self._by_key[entry.key]
        bucket.remove(entry)
        if not bucket:
            del self._by_key[entry.key]
        depth = entry.key[0]
        self._depths[depth] -= 1
        if not self._depths[depth]:
            del self._depths[depth]

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

    def evict_until(
        self, satisfied: Callable[[], bool], evict: Callable[[CacheEntry[T]], None]
    ) -> None:
        """Hand entries to `evict` in `eviction_order()` until `satisfied()` holds (or none is
        left); `evict` removes each from the index."""
        if satisfied():
            return
        for entry in self.eviction_order():
            evict(entry)
            if satisfied():
                return

    def match(
        self, prompt: npt.NDArray[np.int32], limit: int, salt: bytes | None = None
    ) -> Match[T] | None:
        """The entry with the cache salt `salt` that lets `prompt` reuse the most tokens, with
        a fork point <= `limit`.

        The fork point F is the longest common prefix of the prompt and the entry's P tokens,
        capped at `limit` (an engine may need to compute the prompt's last tokens itself); it
        is accepted when `F >= P - max_rollback`. Ties go to the most recently used entry.
        """
        if not self._lru or limit <= 0:
            return None
        limit = min(limit, len(prompt))
        max_depth = limit // self.block_size
        hashes = self.hashes(prompt, max_depth, salt)
        unhashed = self.hashes.salt_term(salt)
        for depth in sorted(self._depths, reverse=True):
            if depth > len(hashes):
                continue
            bucket = self._by_key.get((depth, hashes[depth - 1] if depth else unhashed))
            if not bucket:
                continue
            best: Match[T] | None = None
            for entry in bucket:
                # Equal keys under different salts are a hash collision: never a fork.
                if entry.salt != salt:
                    continue
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
