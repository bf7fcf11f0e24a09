"""The keys and values of the shared store tier's pages (`store_tier.StoreTier`).

A page holds one whole KV block (128 tokens) of a cached prompt. Its key is a chained digest of
the rows' layout and model (`identity`: rows of another layout are never read), the request's
prefix-cache partition (its API-key scope and `cache_salt`, or none) and every token up to the
page's end, so no page is found from another partition, model or prefix. In the simulated
engine a page's value is its block's token ids (a lookup checks them against the prompt).
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

from deepinfer_server.engines.simulated.kv_blocks import BLOCK_SIZE

_PERSON = b"kv-store-page"


def page_keys(identity: bytes, salt: bytes | None, tokens: npt.NDArray[np.int32]) -> list[str]:
    """The keys of the pages of `tokens`' whole blocks: page i's digests every token up to
    its end, the partition `salt` and `identity`."""
    seed = identity + (b"\x00" if salt is None else b"\x01" + salt)
    digest = hashlib.blake2b(seed, digest_size=16, person=_PERSON)
    keys = []
    for page in range(len(tokens) // BLOCK_SIZE):
        digest.update(page_value(tokens, page))
        keys.append("deepinfer-kv-" + digest.copy().hexdigest())
    return keys


def page_value(tokens: npt.NDArray[np.int32], page: int) -> bytes:
    """What the simulated engine stores for page `page`: its block's token ids."""
    block = tokens[page * BLOCK_SIZE : (page + 1) * BLOCK_SIZE]
    return np.ascontiguousarray(block, dtype="<i4").tobytes()
