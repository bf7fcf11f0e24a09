"""The keys and values of the shared store tier's pages (`store_tier.StoreTier`).

A *block page* holds one whole KV block (128 tokens) of a cached prompt. Its key is a chained
digest of the rows' layout and model (`identity`: rows of another layout are never read), the
request's prefix-cache partition (its API-key scope and `cache_salt`, or none) and every token
up to the page's end, so no page is found from another partition, model or prefix. In the
simulated engine a page's value is its block's token ids (a lookup checks them against the
prompt); an engine with real rows (DeepInfer's) puts its rows after the ids
(`store_tier.PageRows`), so the same check makes a foreign or replaced value a miss.

KV rows alone cannot be resumed from: a fork needs the sequence's state row (every layer's
sliding window and compression rings) at the fork point, and a state exists only where a
snapshot was taken, at a cached entry's P (its prompt's end). So beside its block pages each
cached entry puts a *snapshot page*: its state at P and the rows of its last, partial block,
keyed by the chained digest through its boundary b = (P - 1) // 128 (the whole pages before
its last token), a marker and a slot number: a boundary holds up to `SNAPSHOT_SLOTS` entries
ending in the block after it. Its tail (the tokens from 128 * b to P: 1 to 128 of them, so
that a fork one token before P, a thinking-mode turn's, always finds it) is its simulated
value. A stored object is never replaced (Mooncake keeps the first value put under a key), so
each snapshot takes a slot of its own.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

from deepinfer_server.model.kv_block import BLOCK_SIZE

_PERSON = b"kv-store-page"
_STATE_PERSON = b"kv-store-state"
#: The snapshots a boundary holds: entries ending in the same block beyond them go unstored.
SNAPSHOT_SLOTS = 8


def chain(identity: bytes, salt: bytes | None, tokens: npt.NDArray[np.int32]) -> list[bytes]:
    """The chained digest at every page boundary of `tokens`: item i digests `identity`, the
    partition `salt` and the first i whole pages' tokens (item 0: no token)."""
    seed = identity + (b"\x00" if salt is None else b"\x01" + salt)
    digest = hashlib.blake2b(seed, digest_size=16, person=_PERSON)
    digests = [digest.digest()]
    for page in range(len(tokens) // BLOCK_SIZE):
        digest.update(page_value(tokens, page))
        digests.append(digest.digest())
    return digests


def page_keys(identity: bytes, salt: bytes | None, tokens: npt.NDArray[np.int32]) -> list[str]:
    """The keys of the pages of `tokens`' whole blocks: page i's digests every token up to
    its end, the partition `salt` and `identity`."""
    return [page_key(digest) for digest in chain(identity, salt, tokens)[1:]]


def page_key(digest: bytes) -> str:
    """The key of the page whose chained digest (through its end) is `digest`."""
    return "deepinfer-kv-" + digest.hex()


def page_value(tokens: npt.NDArray[np.int32], page: int) -> bytes:
    """What the simulated engine stores for page `page`: its block's token ids."""
    block = tokens[page * BLOCK_SIZE : (page + 1) * BLOCK_SIZE]
    return np.ascontiguousarray(block, dtype="<i4").tobytes()


def boundary(length: int) -> int:
    """The boundary (whole pages) a snapshot after `length` tokens is filed under."""
    return (length - 1) // BLOCK_SIZE


def snapshot_keys(digest: bytes) -> list[str]:
    """The keys of the snapshot slots at the boundary whose chained digest is `digest`."""
    return [
        "deepinfer-kv-state-"
        + hashlib.blake2b(digest + bytes([slot]), digest_size=16, person=_STATE_PERSON).hexdigest()
        for slot in range(SNAPSHOT_SLOTS)
    ]


def tail_value(tokens: npt.NDArray[np.int32]) -> bytes:
    """What the simulated engine stores for the snapshot after `tokens`: its tail's ids."""
    tail = tokens[boundary(len(tokens)) * BLOCK_SIZE :]
    return np.ascontiguousarray(tail, dtype="<i4").tobytes()


def snapshot_tokens(prompt: npt.NDArray[np.int32], at: int, value: bytes) -> npt.NDArray[np.int32]:
    """The P tokens of a snapshot found at boundary `at` of `prompt` (whose first `at` pages
    were found): those pages' tokens, then its tail."""
    tail = np.frombuffer(value, dtype="<i4").astype(np.int32)
    return np.concatenate([prompt[: at * BLOCK_SIZE], tail])
