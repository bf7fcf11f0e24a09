"""PrefixDirectory: which DP rank holds which prompt prefixes, for prefix-aware routing.

The API process remembers, per rank, the block hashes of the prompts it sent there: what the
rank's prefix cache keeps once those requests end. Per rank it keeps at most as many prompts
as the rank says its cache holds plus what it can be running (the rank's step reports carry
its cached-sequence count), forgetting the least recently routed first, as the engines evict.
It is a guess, as SGLang's and vLLM Router's `cache_aware` trees are (they too record what
they routed, without the engine's word): the engine's cache alone decides a hit, comparing
tokens, so a stale or missing entry here costs a worse rank choice, never a wrong answer.

A prompt's prefix of `i` full blocks (128 tokens, the engines' KV block) hashes to the sum of
`token[p] * weight[p]` over its positions, modulo 2**64, with random odd weights drawn once per
process: one vectorised pass over the packed prompt gives every depth's hash (about 0.1 ms for
14k tokens on a busy 2-core machine, a tenth of packing the prompt). Each API server process
has its own directory (`--api-server-count`): a conversation whose turns reach different
processes is routed by load there. A request's cache salt (`AddRequest.cache_salt`) is added to
its first block's sum, as the engines' index does: a prefix another partition sent to a rank
never draws a request there.
"""

from __future__ import annotations

import hashlib
import secrets
from collections import OrderedDict

import numpy as np

from deepinfer_server.config import ResolvedConfig
from deepinfer_server.coordinator.prefix_routing import PrefixHint, PrefixRouting
from deepinfer_server.model.kv_block import BLOCK_SIZE, blocks_for

#: The most prompts remembered per rank, whatever the rank reports.
MAX_ENTRIES_PER_RANK = 4096


class _RankPrefixes:
    """The prompts routed to one rank: their hashes, least recently routed first."""

    def __init__(self) -> None:
        #: Prefix hash -> how many remembered prompts have that prefix.
        self.counts: dict[int, int] = {}
        self.entries: OrderedDict[str, list[int]] = OrderedDict()
        self.limit = 0

    def add(self, key: str, hashes: list[int]) -> None:
        self.entries[key] = hashes
        counts = self.counts
        for value in hashes:
            counts[value] = counts.get(value, 0) + 1
        self.evict_to(self.limit)

    def evict_to(self, limit: int) -> None:
        counts = self.counts
        while len(self.entries) > limit:
            _, hashes = self.entries.popitem(last=False)
            for value in hashes:
                left = counts[value] - 1
                if left:
                    counts[value] = left
                else:
                    del counts[value]

    def held_blocks(self, hashes: list[int]) -> int:
        """The number of leading blocks of the prompt some remembered prompt shares: every
        remembered prompt adds all its prefixes, so presence is monotone in depth."""
        counts = self.counts
        low, high = 0, len(hashes)
        while low < high:
            middle = (low + high + 1) // 2
            if hashes[middle - 1] in counts:
                low = middle
            else:
                high = middle - 1
        return low


class PrefixDirectory:
    """Per-rank prefix hashes of routed prompts. Use from the event loop thread only."""

    def __init__(self, ranks: int, max_model_len: int, running_slots: int) -> None:
        self._ranks = [_RankPrefixes() for _ in range(ranks)]
        self._running_slots = running_slots
        positions = blocks_for(max_model_len) * BLOCK_SIZE
        generator = np.random.default_rng(secrets.randbits(128))
        self._weights = generator.integers(0, 2**64, size=positions, dtype=np.uint64) | 1
        self._salt_key = secrets.token_bytes(32)

    def block_hashes(self, packed_prompt: bytes, salt: bytes | None = None) -> list[int]:
        """The hash of each prefix of whole blocks of a prompt packed by `ipc.codec`, under the
        cache salt `salt`."""
        blocks = min(len(packed_prompt) // (4 * BLOCK_SIZE), len(self._weights) // BLOCK_SIZE)
        if blocks == 0:
            return []
        count = blocks * BLOCK_SIZE
        tokens = np.frombuffer(packed_prompt, dtype="<i4", count=count).astype(np.uint64)
        weighted = (tokens * self._weights[:count]).reshape(blocks, BLOCK_SIZE)
        sums = weighted.sum(axis=1, dtype=np.uint64)
        if salt is not None:
            digest = hashlib.blake2b(salt, digest_size=8, key=self._salt_key).digest()
            sums[:1] += np.uint64(int.from_bytes(digest, "little"))  # an array add wraps
        hashes: list[int] = sums.cumsum(dtype=np.uint64).tolist()
        return hashes

    def hint(
        self, packed_prompt: bytes, prompt_tokens: int, salt: bytes | None, routing: PrefixRouting
    ) -> tuple[list[int], PrefixHint | None]:
        """The prompt's block hashes and where its prefix is held, for the rank choice; none
        for a prompt too short to route by its prefix."""
        if prompt_tokens < routing.min_tokens:
            return [], None
        hashes = self.block_hashes(packed_prompt, salt)
        return hashes, PrefixHint(self.held_tokens(hashes), prompt_tokens, routing)

    def held_tokens(self, hashes: list[int]) -> list[int]:
        """Per rank, the prompt tokens of the longest prefix it is believed to hold."""
        return [rank.held_blocks(hashes) * BLOCK_SIZE for rank in self._ranks]

    def record(self, rank: int, key: str, hashes: list[int]) -> None:
        """`rank` got the prompt with these hashes (`key`: its request ID)."""
        if hashes:
            self._ranks[rank].add(key, hashes)

    def rank_holds(self, rank: int, sequences: int) -> None:
        """`rank` reports `sequences` in its prefix cache: remember no more prompts there than
        those and the requests it can be running."""
        prefixes = self._ranks[rank]
        prefixes.limit = min(MAX_ENTRIES_PER_RANK, sequences + self._running_slots)
        prefixes.evict_to(prefixes.limit)

    def entries(self, rank: int) -> int:
        """Prompts remembered for `rank`."""
        return len(self._ranks[rank].entries)


def directory_for(config: ResolvedConfig) -> PrefixDirectory | None:
    """The prefix directory, with prefix caching and a choice of ranks to make; else None."""
    if config.enable_prefix_caching and config.data_parallel_size > 1:
        return PrefixDirectory(config.data_parallel_size, config.max_model_len, config.max_num_seqs)
    return None
