"""StoreTier: a prefix-cache tier shared by every replica, on Mooncake Store.

Beside each rank's pool and host tier (`HostTier`), `--kv-offload-store mooncake` puts
every cached prompt's KV in a distributed store that replicas and prefill servers share
(its master, `mooncake_master`, runs as a process of its own), so a conversation that moves to
another replica reuses what any of them computed, as SGLang's HiCache does on the same store.

The store holds pages: one per whole KV block (128 tokens) of a prompt, keyed by a chained
digest of the rows' layout and model (`identity`: rows of another layout are never read), the
request's prefix-cache partition (its API-key scope and `cache_salt`, or none) and every token
up to the page's end, so no page is found from another partition, model or prefix. In the
simulated engine a page's value is its block's token ids (a lookup checks them against the
prompt); the bytes moved are accounted at the model's size (`HostTierSettings.copy_bytes`).

Nothing here runs in a step. A write (`write`: an entry the pool keeps) goes to a bounded
queue that a thread drains (a full queue drops it: a write never waits); a lookup
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

from deepinfer_server.engines.simulated.kv_blocks import BLOCK_SIZE
from deepinfer_server.engines.simulated.store_pages import page_keys, page_value

logger = logging.getLogger(__name__)

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


class StoreTier:
    """One rank's client of the shared store; its loop's thread calls `write` and `lookup`."""

    def __init__(self, settings: StoreTierSettings, connect: Callable[[], StoreClient]) -> None:
        self.settings = settings
        self._connect = connect
        self._client: StoreClient | None = None
        self._failed_at = -RETRY_SECONDS
        self._lock = threading.Lock()
        self._writes: queue.Queue[tuple[npt.NDArray[np.int32], bytes | None]] = queue.Queue(
            maxsize=settings.queue_depth
        )
        self._lookups: queue.Queue[_Lookup] = queue.Queue()
        #: The last lookup that timed out: until it is answered, lookups miss at once.
        self._unanswered: Future[int] | None = None
        #: Store errors and timed-out lookups, writes dropped for a full queue, pages written.
        self.errors = 0
        self.dropped = 0
        self.pages_written = 0
        self._logged = False
        for target, name in ((self._write_loop, "writer"), (self._lookup_loop, "lookups")):
            threading.Thread(target=target, name=f"kv-store-{name}", daemon=True).start()

    def write(self, tokens: npt.NDArray[np.int32], salt: bytes | None) -> None:
        """Put the whole-block pages of a cached prompt the store lacks, in the background."""
        if len(tokens) < BLOCK_SIZE:
            return
        try:
            self._writes.put_nowait((tokens, salt))
        except queue.Full:
            self.dropped += 1

    def lookup(self, prompt: npt.NDArray[np.int32], limit: int, salt: bytes | None) -> int:
        """The tokens of `prompt`'s longest prefix of at most `limit` tokens the store holds
        in pages of partition `salt` (a multiple of the block size; 0 on a miss, an error or
        no answer within the timeout)."""
        if limit < BLOCK_SIZE:
            return 0
        if self._unanswered is not None and not self._unanswered.done():
            # A stuck store would otherwise cost every request the whole timeout.
            self._failed("a lookup is still unanswered")
            return 0
        pending = _Lookup(prompt[: limit - limit % BLOCK_SIZE], salt, Future())
        self._lookups.put(pending)
        try:
            return pending.answer.result(timeout=self.settings.lookup_timeout)
        except TimeoutError:
            self._unanswered = pending.answer
            self._failed("a lookup timed out")
            return 0

    def drain(self) -> None:
        """Wait until every queued write has been handled (for tests and shutdown)."""
        self._writes.join()

    def transfer_seconds(self, nbytes: int) -> float:
        """How long bringing `nbytes` from the store to host memory takes."""
        return nbytes / self.settings.bandwidth

    # The threads

    def _write_loop(self) -> None:
        while True:
            tokens, salt = self._writes.get()
            try:
                self._put(tokens, salt)
            except Exception as error:  # a store failure costs this write, never the loop
                self._failed(f"a write failed: {error}")
            finally:
                self._writes.task_done()

    def _put(self, tokens: npt.NDArray[np.int32], salt: bytes | None) -> None:
        client = self._client_or_none()
        if client is None:
            return
        keys = page_keys(self.settings.identity, salt, tokens)
        present = _checked(client.batch_is_exist(keys))
        for page, (key, found) in enumerate(zip(keys, present, strict=True)):
            if not found:
                code = client.put(key, page_value(tokens, page))
                if code != 0:
                    raise StoreError(f"put returned {code}")
                self.pages_written += 1

    def _lookup_loop(self) -> None:
        self._client_or_none()  # connect now: the first lookup must not wait for the setup
        while True:
            pending = self._lookups.get()
            try:
                found = self._find(pending.prompt, pending.salt)
            except Exception as error:
                self._failed(f"a lookup failed: {error}")
                found = 0
            pending.answer.set_result(found)

    def _find(self, prompt: npt.NDArray[np.int32], salt: bytes | None) -> int:
        """The pages of `prompt` present in a row from its start, checked token by token."""
        client = self._client_or_none()
        if client is None:
            return 0
        keys = page_keys(self.settings.identity, salt, prompt)
        present = _checked(client.batch_is_exist(keys)) if keys else []
        pages = next((page for page, found in enumerate(present) if not found), len(present))
        values = client.get_batch(keys[:pages]) if pages else []
        for page, value in enumerate(values):
            if value != page_value(prompt, page):
                return page * BLOCK_SIZE  # evicted meanwhile (or a foreign value): stop here
        return pages * BLOCK_SIZE

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


#: The memory each client gives the store's pool, and its transfer buffer: in the simulated
#: engine a page is its 512 bytes of token ids, so 64 MiB holds some 16 million tokens' pages.
SEGMENT_BYTES = 64 * 1024 * 1024
BUFFER_BYTES = 16 * 1024 * 1024


def mooncake_client(master: str, hostname: str) -> StoreClient:
    """A Mooncake Store client of the master at `master` (host:port), over TCP, peers meeting
    by handshake (no metadata server); raises when it cannot be set up."""
    from mooncake.store import MooncakeDistributedStore  # the disaggregation extra

    store = MooncakeDistributedStore()
    code = store.setup(hostname, "P2PHANDSHAKE", SEGMENT_BYTES, BUFFER_BYTES, "tcp", "", master)
    if code != 0:
        raise StoreError(f"setup with the master at {master} returned {code}")
    return store  # type: ignore[no-any-return]


@dataclass(frozen=True)
class _Lookup:
    prompt: npt.NDArray[np.int32]
    salt: bytes | None
    answer: Future[int]


def _checked(codes: list[int]) -> list[bool]:
    """Whether each key is present; raises for an error code."""
    if any(code < 0 for code in codes):
        raise StoreError(f"batch_is_exist returned {min(codes)}")
    return [code == 1 for code in codes]
