"""StoreTier: a prefix-cache tier shared by every replica, on Mooncake Store.

Beside each rank's pool and host tier (`HostTier`), `--kv-offload-store mooncake` puts
every cached prompt's KV in a distributed store that replicas and prefill servers share
(its master, `mooncake_master`, runs as a process of its own), so a conversation that moves to
another replica reuses what any of them computed, as SGLang's HiCache does on the same store.

The store holds, for each cached prompt, its whole KV blocks (block pages) and its state
snapshot (a snapshot page), keyed by a chained digest of the rows' layout and model, the
request's prefix-cache partition and the prompt's tokens (`store_pages`), so no page is found
from another partition, model or prefix. A restore starts only where a snapshot was taken, at a
cached prompt's end P: a block boundary alone has no state to resume from (a fork needs the
state row at its fork point). A lookup answers the snapshots filed at the boundaries of the
pages the prompt shares, each as its entry's tokens; the prefix cache decides which one, if
any, the prompt forks from. The bytes moved are accounted at the model's size
(`HostTierSettings.copy_bytes`: the blocks and one state row).

Nothing here runs in a step. A write (`write`: an entry the pool keeps) goes to a bounded
queue that a thread drains (a full queue drops it: a write never waits; racing writers of one
snapshot slot may lose a snapshot, which only costs a later miss); a lookup
(`lookup`: a prompt that the pool and the host tier serve less of) runs in another thread and
is waited for at most `lookup_timeout` when the request is added. A store error or timeout,
including a lost master, is a miss: it is counted (`errors`), logged once, and never fails a
request. A hit is brought into the host tier and restored from there, its prompt step lasting
the store's copy (`bytes / bandwidth`) on top of the host's.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from deepinfer_server.model.kv_block import BLOCK_SIZE
from deepinfer_server.prefix_cache import store_pages

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Found:
    """A snapshot (entry) a lookup found that the prompt may resume from: its P tokens, its
    boundary (the whole pages before its last block) and the rows the engine stored beside
    the token ids (`PageRows`: empty in the simulated engine): those of each page before the
    boundary, then the snapshot's."""

    tokens: npt.NDArray[np.int32]
    at: int
    blocks: list[bytes]
    state: bytes


#: What a lookup finds: each snapshot the prompt may resume from.
Snapshots = list[Found]


class PageRows(Protocol):
    """The rows an engine stores beside a cached prompt's token ids (DeepInfer's KV rows;
    the simulated engine stores none): called on the writer thread, for the pages the store
    lacks."""

    def block(self, page: int) -> bytes:
        """The rows of whole block `page` (`StoreTierSettings.block_rows` bytes)."""

    def snapshot(self) -> bytes:
        """The rows of the snapshot: its last block's and its state's
        (`StoreTierSettings.snapshot_rows` bytes)."""


#: Seconds between two attempts to set a failed client up again.
RETRY_SECONDS = 5.0


class StoreClient(Protocol):
    """The calls of Mooncake's `MooncakeDistributedStore` the tier makes (0/1: ok/found;
    a negative code: an error)."""

    def put(self, key: str, value: bytes) -> int:
        """Store `value` under `key`."""

    def get_batch(self, keys: list[str]) -> list[bytes]:
        """The value under each key (empty when absent or on an error)."""

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        """1 for each key present, 0 absent, negative on an error."""


class StoreError(RuntimeError):
    """The store answered with an error code (its master unreachable, out of space...)."""


@dataclass(frozen=True)
class StoreTierSettings:
    """Where the store is, what identifies this engine's rows, and what a copy costs."""

    #: The layout and model of the rows (`KVLayout` and the checkpoint, encoded).
    identity: bytes
    #: Bytes per second from the store to a rank's host memory (RDMA: ~25 GB/s).
    bandwidth: float
    #: Seconds `add_request` waits for a lookup before it counts as a miss.
    lookup_timeout: float = 0.1
    #: Writes waiting for the writer thread beyond which new ones are dropped.
    queue_depth: int = 256
    #: The bytes of rows a block page and a snapshot page hold after their token ids
    #: (`PageRows`); a value of another size is a miss.
    block_rows: int = 0
    snapshot_rows: int = 0


class StoreTier:
    """One rank's client of the shared store; its loop's thread calls `write` and `lookup`."""

    def __init__(self, settings: StoreTierSettings, connect: Callable[[], StoreClient]) -> None:
        self.settings = settings
        self._connect = connect
        self._client: StoreClient | None = None
        self._failed_at = -RETRY_SECONDS
        self._lock = threading.Lock()
        self._writes: queue.Queue[_Write] = queue.Queue(maxsize=settings.queue_depth)
        self._lookups: queue.Queue[_Lookup] = queue.Queue()
        #: The last lookup that timed out: until it is answered, lookups miss at once.
        self._unanswered: Future[Snapshots] | None = None
        #: Store errors and timed-out lookups, writes dropped for a full queue, block pages
        #: and snapshot pages written.
        self.errors = 0
        self.dropped = 0
        self.pages_written = 0
        self.snapshots_written = 0
        self._logged = False
        for target, name in ((self._write_loop, "writer"), (self._lookup_loop, "lookups")):
            threading.Thread(target=target, name=f"kv-store-{name}", daemon=True).start()

    def write(
        self, tokens: npt.NDArray[np.int32], salt: bytes | None, rows: PageRows | None = None
    ) -> None:
        """Put the whole-block pages of a cached prompt and its snapshot page, those the
        store lacks, in the background (with `rows`: each page's rows after its ids)."""
        if len(tokens) < BLOCK_SIZE:
            return
        try:
            self._writes.put_nowait((tokens, salt, rows))
        except queue.Full:
            self.dropped += 1

    def writes_full(self) -> bool:
        """Whether a write now would be dropped (its queue is full)."""
        return self._writes.full()

    def lookup(self, prompt: npt.NDArray[np.int32], salt: bytes | None) -> Snapshots:
        """The snapshots of partition `salt` the store holds with every whole page before
        them shared with `prompt`, each as its entry's tokens (the caller decides which one,
        if any, `prompt` forks from); none on a miss, an error or no answer in time."""
        if len(prompt) < BLOCK_SIZE:
            return []
        if self._unanswered is not None and not self._unanswered.done():
            # A stuck store would otherwise cost every request the whole timeout.
            self._failed("a lookup is still unanswered")
            return []
        pending = _Lookup(prompt, salt, Future())
        self._lookups.put(pending)
        try:
            return pending.answer.result(timeout=self.settings.lookup_timeout)
        except TimeoutError:
            self._unanswered = pending.answer
            self._failed("a lookup timed out")
            return []

    def drain(self) -> None:
        """Wait until every queued write has been handled (for tests and shutdown)."""
        self._writes.join()

    def transfer_seconds(self, nbytes: int) -> float:
        """How long bringing `nbytes` from the store to host memory takes."""
        return nbytes / self.settings.bandwidth

    # The threads

    def _write_loop(self) -> None:
        while True:
            tokens, salt, rows = self._writes.get()
            try:
                self._put(tokens, salt, rows)
            except Exception as error:  # a store failure costs this write, never the loop
                self._failed(f"a write failed: {error}")
            finally:
                self._writes.task_done()

    def _put(
        self, tokens: npt.NDArray[np.int32], salt: bytes | None, rows: PageRows | None
    ) -> None:
        client = self._client_or_none()
        if client is None:
            return
        digests = store_pages.chain(self.settings.identity, salt, tokens)
        keys = [store_pages.page_key(digest) for digest in digests[1:]]
        slots = store_pages.snapshot_keys(digests[store_pages.boundary(len(tokens))])
        present = _checked(client.batch_is_exist(keys + slots))
        for page, (key, found) in enumerate(zip(keys, present[: len(keys)], strict=True)):
            if not found:
                value = store_pages.page_value(tokens, page)
                _put(client, key, value if rows is None else value + rows.block(page))
                self.pages_written += 1
        taken = list(zip(slots, present[len(keys) :], strict=True))
        self._put_snapshot(client, taken, tokens, rows)

    def _put_snapshot(
        self,
        client: StoreClient,
        slots: list[tuple[str, bool]],
        tokens: npt.NDArray[np.int32],
        rows: PageRows | None,
    ) -> None:
        """Put the snapshot after `tokens` in the first free one of its boundary's `slots`
        (each key and whether it is taken), unless a slot holds it already. Two writers may
        take the same slot at once: the store keeps the first one's value and the other's
        snapshot is lost (a later lookup misses it, nothing worse); with every slot taken it
        goes unstored too."""
        tail, extra = store_pages.tail_value(tokens), self.settings.snapshot_rows
        taken = [key for key, found in slots if found]
        if tail in [_ids(value, extra) for value in (client.get_batch(taken) if taken else [])]:
            return
        free = next((key for key, found in slots if not found), None)
        if free is not None:
            _put(client, free, tail if rows is None else tail + rows.snapshot())
            self.snapshots_written += 1

    def _lookup_loop(self) -> None:
        self._client_or_none()  # connect now: the first lookup must not wait for the setup
        while True:
            pending = self._lookups.get()
            try:
                found = self._find(pending.prompt, pending.salt)
            except Exception as error:
                self._failed(f"a lookup failed: {error}")
                found = []
            pending.answer.set_result(found)

    def _find(self, prompt: npt.NDArray[np.int32], salt: bytes | None) -> Snapshots:
        """The snapshots at the boundaries of the pages of `prompt` present in a row from its
        start (checked token by token): one existence check, then one fetch."""
        client = self._client_or_none()
        if client is None:
            return []
        digests = store_pages.chain(self.settings.identity, salt, prompt)
        keys = [store_pages.page_key(digest) for digest in digests[1:]]
        slots = [
            (at, key)
            for at, digest in enumerate(digests)
            for key in store_pages.snapshot_keys(digest)
        ]
        present = _checked(client.batch_is_exist(keys + [key for _, key in slots]))
        pages = next((page for page in range(len(keys)) if not present[page]), len(keys))
        found = present[len(keys) :]
        wanted = [
            slot for slot, here in zip(slots, found, strict=True) if here and slot[0] <= pages
        ]
        fetched, read = pages, keys[:pages] + [key for _, key in wanted]
        if not read:
            return []  # Mooncake answers a get_batch of no key with one empty value
        values = client.get_batch(read)
        if len(values) != len(read):
            raise StoreError(f"get_batch answered {len(values)} values for {len(read)} keys")
        block_rows, extra = self.settings.block_rows, self.settings.snapshot_rows
        for page, value in enumerate(values[:fetched]):
            if _ids(value, block_rows) != store_pages.page_value(prompt, page):
                pages = page  # evicted meanwhile (or a foreign value): stop here
                break
        blocks = [value[BLOCK_SIZE * 4 :] for value in values[:pages]]
        return [
            Found(
                store_pages.snapshot_tokens(prompt, at, tail), at, blocks[:at], value[len(tail) :]
            )
            for (at, _), value in zip(wanted, values[fetched:], strict=True)
            # An empty value: evicted since the existence check.
            if at <= pages and (tail := _ids(value, extra))
        ]

    def _client_or_none(self) -> StoreClient | None:
        """The connected client; None while a failed connection waits for its retry."""
        with self._lock:
            if self._client is not None:
                return self._client
            if time.monotonic() - self._failed_at < RETRY_SECONDS:
                return None
            try:
                self._client = self._connect()
            except Exception as error:
                self._failed_at = time.monotonic()
                self._failed(f"cannot connect: {error}")
            return self._client

    def _failed(self, what: str) -> None:
        self.errors += 1
        if not self._logged:
            self._logged = True
            logger.warning("KV store: %s; its lookups count as misses", what)
        else:
            logger.debug("KV store: %s", what)


#: The memory a client gives the store's pool by default, and its transfer buffer: in the
#: simulated engine a page is its 512 bytes of token ids, so 64 MiB holds some 16 million
#: tokens' pages (DeepInfer's rows take `--kv-offload-store-segment-gb`).
SEGMENT_BYTES = 64 * 1024 * 1024
BUFFER_BYTES = 16 * 1024 * 1024


def mooncake_client(
    master: str,
    hostname: str,
    segment_bytes: int = SEGMENT_BYTES,
    buffer_bytes: int = BUFFER_BYTES,
) -> StoreClient:
    """A Mooncake Store client of the master at `master` (host:port), over TCP, peers meeting
    by handshake (no metadata server), giving the pool `segment_bytes` and transferring
    through a `buffer_bytes` buffer; raises when it cannot be set up."""
    from mooncake.store import MooncakeDistributedStore  # the disaggregation extra

    store = MooncakeDistributedStore()
    code = store.setup(hostname, "P2PHANDSHAKE", segment_bytes, buffer_bytes, "tcp", "", master)
    if code != 0:
        raise StoreError(f"setup with the master at {master} returned {code}")
    return store  # type: ignore[no-any-return]


@dataclass(frozen=True)
class _Lookup:
    prompt: npt.NDArray[np.int32]
    salt: bytes | None
    answer: Future[Snapshots]


#: A queued write: a cached prompt's tokens, its partition and its rows (None: ids only).
_Write = tuple[npt.NDArray[np.int32], bytes | None, PageRows | None]


def _ids(value: bytes, rows: int) -> bytes:
    """The token ids a page's `value` begins with, before its `rows` bytes of rows (empty
    when it is too short to hold them, or its ids are not whole int32s)."""
    ids = len(value) - rows
    return value[:ids] if ids > 0 and ids % 4 == 0 else b""


def _put(client: StoreClient, key: str, value: bytes) -> None:
    """Store `value` under `key`; raises for an error code."""
    code = client.put(key, value)
    if code != 0:
        raise StoreError(f"put returned {code}")


def _checked(codes: list[int]) -> list[bool]:
    """Whether each key is present; raises for an error code."""
    if any(code < 0 for code in codes):
        raise StoreError(f"batch_is_exist returned {min(codes)}")
    return [code == 1 for code in codes]
