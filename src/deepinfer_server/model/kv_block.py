"""The checkpoint's KV block in DeepInfer: the one place its size is spelled.

DeepInfer pages a V4.1 sequence's KV in blocks of `ModelMetadata.resolved_tokens_per_block`
positions (deepinfer/model_executor/model_metadata_utils.py: 128 for every V4 checkpoint); its
scheduler, the prefix caches, the handoff's block ids and the KV sizes all count in them.
"""

from __future__ import annotations

#: Positions per KV block.
BLOCK_SIZE = 128


def blocks_for(tokens: int) -> int:
    """The KV blocks that hold `tokens` positions (`sequence.hpp` get_num_blocks)."""
    return -(-tokens // BLOCK_SIZE)
