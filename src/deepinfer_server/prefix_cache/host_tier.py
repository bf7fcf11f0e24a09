"""HostTier: the host-memory KV tier behind a prefix cache (either engine's).

When the prefix cache evicts an entry from the rank's pool (`PrefixCache.evict`), the tier
keeps a copy of what a fork needs of it: the KV blocks of its first P tokens and its state
snapshot, accounted at the model's size (`block_bytes`, `state_bytes`: the rows
`kv_size.KVSize` gives, the checkpoint's by default). The copy is asynchronous on a GPU (its
own stream, from blocks the eviction has already handed back to the pool's bookkeeping), so it
is counted, never added to a step. A later prompt that starts with
such an entry's tokens is restored from here instead of recomputed: its blocks and state slot
are allocated as for any prompt, the prompt step lasts the copy back (`bytes / bandwidth`) on
top of the tokens it still computes, and the restored tokens count as cached. A restore is
taken only when it is faster than recomputing the tokens it saves (a short prefix over a slow
link is recomputed).

The tier has its own least-recently-used order and byte budget, with the pool's partitions
(an entry is found only by prompts of its cache salt) and a fair share per partition: when
room is needed, a partition holding more than the budget over the partitions present loses
its least recently used entry first, so that one key's sessions cannot push every other key's
out. A restored entry moves back to the pool: it leaves the tier once no waiting prompt
still counts on it. An entry found in the shared store (`store_tier`) is brought here first
and restored like any other, after the store's copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from deepinfer_server.ipc.messages import HostTierStats
from deepinfer_server.model.kv_block import blocks_for
from deepinfer_server.prefix_cache.index import CacheEntry, Match, PrefixIndex


class Pins(Protocol):
    """Which entries requests asked to keep for a time (the simulated engine's retention)."""

    def pinned(self, entry: CacheEntry[Any]) -> bool: ...


@dataclass(frozen=True)
class HostTierSettings:
    """The tier's budget and what moving KV between host and GPU costs."""

    budget_bytes: int
    #: Bytes per second between host memory and one GPU, each way (PCIe 5 x16: ~50 GB/s).
    bandwidth: float
    #: The model's bytes of one KV block (every layer) and of one sequence's state snapshot.
    block_bytes: int
    state_bytes: int
    #: Prompt tokens a prompt step computes per second (0: computing is free, never restore).
    prefill_tokens_per_s: float
    #: The engine counts the copies' real seconds itself (DeepInfer); else `bytes / bandwidth`.
    measured: bool = False

    def capacity_blocks(self) -> int:
        """The KV blocks the budget holds (what a partition's retention share is a share of)."""
        return self.budget_bytes // max(1, self.block_bytes)

    def copy_bytes(self, tokens: int) -> int:
        """The bytes of the blocks holding `tokens` tokens and of a state snapshot."""
        return blocks_for(tokens) * self.block_bytes + self.state_bytes

    def copy_seconds(self, nbytes: int) -> float:
        """How long a copy of `nbytes` takes one way."""
        return nbytes / self.bandwidth

    def worth_restoring(self, tokens: int, saved: int, fetch: float = 0.0) -> bool:
        """Whether restoring the first `tokens` tokens (after `fetch` seconds bringing them to
        host memory) is faster than computing the `saved` tokens it spares the prompt step."""
        if self.prefill_tokens_per_s <= 0 or saved <= 0:
            return False
        restore = self.copy_seconds(self.copy_bytes(tokens))
        return fetch + restore < saved / self.prefill_tokens_per_s


@dataclass(slots=True)
class HostCopy:
    """One entry's copy in host memory."""

    nbytes: int
    #: False once it left the tier (dropped, or moved back to the pool).
    resident: bool = True
    #: The seconds its copy from the shared store took (None: offloaded from this rank's pool).
    fetched: float | None = None
    #: The copied rows, where the engine keeps real ones (DeepInfer's `host_rows.HostRows`).
    rows: object = None


class HostTier:
    """The host-memory tier of one simulated rank (its loop's thread owns it)."""

    def __init__(self, settings: HostTierSettings, max_rollback: int) -> None:
        self.settings = settings
        self.index: PrefixIndex[HostCopy] = PrefixIndex(max_rollback=max_rollback)
        self.used_bytes = 0
        self._partition_bytes: dict[bytes | None, int] = {}
        self.hit_tokens = 0
        self.restore_bytes = 0
        self.restore_seconds = 0.0
        self.offload_bytes = 0
        self.offload_seconds = 0.0
        #: Entries requests asked to keep for a time are never dropped before it runs out.
        self.pins: Pins | None = None
        self.store_hit_tokens = 0

    def offload(
        self,
        tokens: npt.NDArray[np.int32],
        salt: bytes | None,
        fetched: float | None = None,
        copy: Callable[[], object] | None = None,
    ) -> bool:
        """Keep a copy of an entry the pool evicts (its first P tokens, for prompts with the
        cache salt `salt`), or of one the shared store's copy brought in `fetched` seconds;
        False when it cannot fit (larger than the budget, or only entries that waiting prompts
        count on stand in the way). `copy`, called once room is made, copies the rows."""
        nbytes = self.settings.copy_bytes(len(tokens))
        if nbytes > self.settings.budget_bytes:
            return False
        while self.used_bytes + nbytes > self.settings.budget_bytes:
            victim = self._victim(salt)
            if victim is None:
                return False
            self._drop(victim)
        rows = None if copy is None else copy()
        self.index.add(HostCopy(nbytes, fetched=fetched, rows=rows), tokens, salt)
        self.used_bytes += nbytes
        self._partition_bytes[salt] = self._partition_bytes.get(salt, 0) + nbytes
        if fetched is None:
            self.offload_bytes += nbytes
            if not self.settings.measured:
                self.offload_seconds += self.settings.copy_seconds(nbytes)
        return True

    def match(
        self, prompt: npt.NDArray[np.int32], limit: int, salt: bytes | None, pool_fork: int
    ) -> Match[HostCopy] | None:
        """The entry to restore `prompt` from, when it reuses more than the pool's best fork
        (`pool_fork` tokens, 0 for none) and restoring is faster than computing the rest."""
        if not self.index:
            return None
        match = self.index.match(prompt, limit=limit, salt=salt)
        if match is None or match.fork_point <= pool_fork:
            return None
        if not self.settings.worth_restoring(match.fork_point, match.fork_point - pool_fork):
            return None
        return match

    def pin(self, entry: CacheEntry[Any]) -> None:
        """A waiting prompt will restore from `entry`: it stays until that prompt starts."""
        entry.live_forks += 1
        self.index.touch(entry)

    def unpin(self, entry: CacheEntry[Any]) -> None:
        """A waiting prompt that would have restored from `entry` ended first."""
        entry.live_forks -= 1

    def restore(self, entry: CacheEntry[Any], fork_point: int) -> float:
        """A prompt step restores the first `fork_point` tokens of `entry`: the seconds the
        copy takes. The entry leaves the tier once no other waiting prompt counts on it."""
        nbytes = self.settings.copy_bytes(fork_point)
        seconds = self.settings.copy_seconds(nbytes)
        self.hit_tokens += fork_point
        self.restore_bytes += nbytes
        if not self.settings.measured:
            self.restore_seconds += seconds
        self.unpin(entry)
        if entry.live_forks == 0 and entry.value.resident:
            self._drop(entry)
        fetched: float | None = entry.value.fetched
        if fetched is None:
            return seconds
        self.store_hit_tokens += fork_point
        return fetched + seconds  # the store's copy to host memory came first

    def stats(self) -> HostTierStats:
        """The tier's counters and occupancy."""
        return HostTierStats(
            self.hit_tokens,
            self.restore_bytes,
            self.restore_seconds,
            self.offload_bytes,
            self.offload_seconds,
            len(self.index),
            self.used_bytes,
            self.settings.budget_bytes,
            self.store_hit_tokens,
        )

    def _victim(self, salt: bytes | None) -> CacheEntry[HostCopy] | None:
        """The entry to drop for room for one of partition `salt`: the least recently used of
        a partition over its fair share, else the least recently used; never one a waiting
        prompt counts on."""
        pins = self.pins
        idle = [
            entry
            for entry in self.index.eviction_order()
            if entry.live_forks == 0 and (pins is None or not pins.pinned(entry))
        ]
        if not idle:
            return None
        partitions = set(self._partition_bytes) | {salt}
        share = self.settings.budget_bytes / len(partitions)
        over = {key for key, held in self._partition_bytes.items() if held > share}
        return next((entry for entry in idle if entry.salt in over), idle[0])

    def _drop(self, entry: CacheEntry[HostCopy]) -> None:
        self.index.remove(entry)
        entry.value.resident = False
        self.used_bytes -= entry.value.nbytes
        left = self._partition_bytes[entry.salt] - entry.value.nbytes
        if left:
            self._partition_bytes[entry.salt] = left
        else:
            del self._partition_bytes[entry.salt]

    def clear(self) -> None:
        """Drop every entry no waiting prompt counts on."""
        for entry in self.index.eviction_order():
            if entry.live_forks == 0:
                self._drop(entry)

    def entries(self) -> Iterable[CacheEntry[HostCopy]]:
        """The entries held, least recently used first."""
        return iter(self.index)
