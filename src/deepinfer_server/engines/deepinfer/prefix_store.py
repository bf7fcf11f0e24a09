"""StorePath: the shared store tier (`--kv-offload-store mooncake`) on DeepInfer's LLMEngine.

The store's machinery is the simulated engine's (`prefix_cache.store_tier.StoreTier`: the
pages' keys, the writer and lookup threads, errors and timeouts as misses); here a page's value
holds real rows after its token ids: a block page the KV block row, a snapshot page the rows of
its entry's last block and its state row (`store_tier.PageRows`). Every page is keyed by the
rows' layout (`cache_memory.rows_layout`: sizes, dtype, backtracking depth, speculative tokens,
checkpoint, DeepInfer's version), so rows of another layout are never read, and a read checks
the ids a value begins with, so a foreign or replaced value is a miss.

- Write: when the cache keeps an entry the server placed (`HostPath.kept`), its rows are copied
  to host memory (asynchronously on a GPU, `host_rows.RowCopier`; the writer thread waits for
  that copy, never the step) and queued for the writer (a full queue drops them).
- Lookup: when a prompt is added and the store may serve more than the pool and the host tier,
  the store is asked (waited for at most its timeout); the best snapshot found, when restoring
  it is worth its fetch, is brought into the host tier as an entry with those rows, from which
  the host path restores it like any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from deepinfer_server.engines.deepinfer.cache_memory import rows_layout
from deepinfer_server.engines.deepinfer.host_rows import HostRows, RowCopier, row_bytes
from deepinfer_server.model.kv_block import BLOCK_SIZE, blocks_for
from deepinfer_server.prefix_cache.host_tier import HostTier
from deepinfer_server.prefix_cache.index import Match, PrefixIndex
from deepinfer_server.prefix_cache.store_pages import boundary
from deepinfer_server.prefix_cache.store_tier import (
    BUFFER_BYTES,
    SEGMENT_BYTES,
    Found,
    StoreClient,
    StoreTier,
    StoreTierSettings,
    mooncake_client,
)


@dataclass(frozen=True)
class StoreOptions:
    """Where the store's master is, what the rows come from, and the store's rates."""

    #: The master's host:port and the host this rank's client is reached at.
    master: str
    hostname: str
    #: The checkpoint's identity (`disaggregation.layout.checkpoint_identity`) and the
    #: speculative tokens the rows are sized for.
    checkpoint: str | None
    speculative_tokens: int = 0
    #: Bytes per second from the store to host memory, and how long a lookup is waited for.
    bandwidth: float = 25e9
    lookup_timeout: float = 0.1
    #: The memory this rank's client gives the store's pool, and its transfer buffer.
    segment_bytes: int = SEGMENT_BYTES
    buffer_bytes: int = BUFFER_BYTES


class _Pages:
    """The store pages' rows of one kept entry (`store_tier.PageRows`), read on the writer
    thread once its copy to host memory is done."""

    def __init__(self, rows: HostRows, tokens: int) -> None:
        self._rows = rows
        self._last = boundary(tokens)

    def _ready(self) -> HostRows:
        if self._rows.ready is not None:
            self._rows.ready.synchronize()
        return self._rows

    def block(self, page: int) -> bytes:
        """The KV row of whole block `page`."""
        return row_bytes(self._ready().blocks[page])

    def snapshot(self) -> bytes:
        """The KV row of the entry's last block, then its state row."""
        rows = self._ready()
        return row_bytes(rows.blocks[self._last]) + row_bytes(rows.state)


#: Kept entries waiting for the writer thread: each holds its prompt's rows in host memory that
#: no tier's budget counts (a 15k-token prompt's are some 16 MB of V4.1-Flash's), so few.
WRITE_QUEUE_DEPTH = 16


class StorePath:
    """One rank's store tier: its writes of kept entries and its lookups into the host tier."""

    def __init__(self, store: StoreTier, copier: RowCopier, tier: HostTier) -> None:
        self.store = store
        self._copier = copier
        self._tier = tier

    def kept(
        self, tokens: npt.NDArray[np.int32], salt: bytes | None, blocks: list[int], slot: int
    ) -> None:
        """The cache keeps an entry of `tokens` in `blocks` and state row `slot`: write its
        pages the store lacks, in the background."""
        if len(tokens) < BLOCK_SIZE:
            return
        if self.store.writes_full():
            self.store.dropped += 1  # before the copy: queued rows are host memory no tier counts
            return
        rows = self._copier.offload(blocks[: blocks_for(len(tokens))], slot, counted=False)
        self.store.write(tokens, salt, _Pages(rows, len(tokens)))

    def bring(
        self, prompt: npt.NDArray[np.int32], limit: int, salt: bytes | None, served: int
    ) -> None:
        """Bring into the host tier the store's best snapshot for `prompt` (forked at most at
        `limit`), when it reuses more than the `served` tokens the pool and the host tier
        serve and restoring it is worth its fetch."""
        if limit <= served:
            return  # nothing beyond them can be restored: no round trip
        rollback = self._tier.index.max_rollback
        candidates: PrefixIndex[Found] = PrefixIndex(max_rollback=rollback)
        for found in self.store.lookup(prompt[: limit + rollback], salt):
            candidates.add(found, found.tokens, salt)
        best = candidates.match(prompt, limit=limit, salt=salt)
        if best is None or best.fork_point <= served:
            return
        settings, found = self._tier.settings, best.entry.value
        seconds = self.store.transfer_seconds(settings.copy_bytes(len(found.tokens)))
        if not settings.worth_restoring(best.fork_point, best.fork_point - served, seconds):
            return
        split = self._copier.block_bytes
        last, state = found.state[:split], found.state[split:]
        if len(state) != self._copier.state_bytes:
            return  # sized for other rows: the layout in the key rules this out
        rows = self._copier.rows_from(b"".join([*found.blocks, last]), state)
        self._tier.offload(found.tokens, salt, fetched=seconds, copy=lambda: rows)

    def served(
        self, prompt: npt.NDArray[np.int32], salt: bytes | None, match: Match[Any] | None
    ) -> int:
        """The tokens of `prompt` the pool's `match` and the host tier's best entry reuse."""
        pool = 0 if match is None else match.fork_point
        host = self._tier.index.match(prompt, limit=int(prompt.size) - 2, salt=salt)
        return max(pool, 0 if host is None else host.fork_point)


def store_path(engine: Any, copier: RowCopier, tier: HostTier, options: StoreOptions) -> StorePath:
    """The store tier of a rank whose host tier is `tier` (its rows copied by `copier`)."""
    cache_engine = engine.driver_worker.cache_engine
    layout = rows_layout(
        cache_engine.gpu_blocks,
        cache_engine.gpu_states,
        options.checkpoint,
        options.speculative_tokens,
    )
    settings = StoreTierSettings(
        identity=msgspec.json.encode(layout),
        bandwidth=options.bandwidth,
        lookup_timeout=options.lookup_timeout,
        block_rows=copier.block_bytes,
        snapshot_rows=copier.block_bytes + copier.state_bytes,
        queue_depth=WRITE_QUEUE_DEPTH,
    )

    def connect() -> StoreClient:
        return mooncake_client(
            options.master, options.hostname, options.segment_bytes, options.buffer_bytes
        )

    return StorePath(StoreTier(settings, connect), copier, tier)
