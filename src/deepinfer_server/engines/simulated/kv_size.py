"""KVSize: the bytes DeepInfer 0.1.0 keeps for DeepSeek-V4.1, per KV block and per sequence.

Read from a checkpoint's config.json (its `text_config`) and laid out as DeepInfer's cache engine
lays them out (`deepinfer/worker/cache_engine.py`, `hugging_face/config.py`):

- A KV block (`gpu_blocks`, 128 tokens) holds a row of bytes per KV-source layer only (the
  layers of `kv_source_layer_ids`; every other compressed layer reads its source's rows): a
  source of compression ratio r keeps 128 / r compressed tokens of main KV (`head_dim` values:
  FP4 with an E4M3 scale per 16, 288 bytes; MXFP8 with a UE8M0 scale per 32, 528 bytes, when
  `use_fp4_sparse_kv` is false) and of indexer K (`index_head_dim` FP4 values and a UE8M0
  scale per 32) when it is also an index-K source, each part padded to 32 bytes; the block to
  a multiple of lcm(128, main bytes). Sliding-window layers keep nothing per block.
- A state slot (`gpu_states`, one per running sequence) holds every attention layer's sliding
  window (`sliding_window` plus the tokens a step can roll back, 528-byte MXFP8 records, each
  layer padded to 32 bytes; the speculative layers' too) and the fp32 compression ring of each
  source layer of ratio 2 (`[ratio + rollback - 1, 2, head_dim]`), padded to lcm(32, 528).

A prefill/decode transfer moves the prompt's blocks and its state slot. Without a checkpoint
the released DeepSeek-V4.1-Flash's figures stand in (`RELEASED_TEXT_CONFIG`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, cast

from deepinfer_server.model.kv_block import BLOCK_SIZE, blocks_for

#: An MXFP8 record of 512 values (SWA, main KV without FP4): data and a UE8M0 scale per 32.
_MXFP8_RECORD = 512 + 512 // 32
#: An FP4 record of 512 values (main KV): data and an E4M3 scale per 16.
_FP4_RECORD = 512 // 2 + 512 // 16
_FLOAT32 = 4


class TextConfig(TypedDict, total=False):
    """The fields of a V4.1 checkpoint's `text_config` that size its KV."""

    num_hidden_layers: int
    num_nextn_predict_layers: int
    compress_ratios: list[int]
    kv_source_layer_ids: list[int]
    index_k_source_layer_ids: list[int]
    index_topk: int
    index_head_dim: int
    head_dim: int
    sliding_window: int
    use_fp4_sparse_kv: bool


#: DeepSeek-V4.1-Flash-1017's config.json, the fields that size its KV.
RELEASED_TEXT_CONFIG: TextConfig = {
    "num_hidden_layers": 40,
    "num_nextn_predict_layers": 3,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_topk": 512,
    "index_head_dim": 128,
    "head_dim": 512,
    "sliding_window": 128,
}


def _pad(amount: int, multiple: int) -> int:
    return -(-amount // multiple) * multiple


def _owners(layers: int, sources: list[int] | None) -> set[int]:
    """The layers that keep rows of their own, given the source layers of those rows: a layer
    before the first source, or a source; the others read the nearest source before them."""
    if not sources:
        return set(range(layers))
    return set(range(min(sources))) | set(sources)


@dataclass(frozen=True)
class KVSize:
    """Bytes of one KV block (128 tokens) and of one sequence's state slot."""

    block_bytes: int
    state_bytes: int

    @property
    def bytes_per_token(self) -> float:
        """The block's bytes over its tokens (the state slot is per sequence, not per token)."""
        return self.block_bytes / BLOCK_SIZE

    def transfer_bytes(self, prompt_tokens: int) -> int:
        """What a PE-to-CE transfer of a `prompt_tokens` prompt moves: its blocks and slot."""
        return blocks_for(prompt_tokens) * self.block_bytes + self.state_bytes

    @classmethod
    def of_config(cls, text: TextConfig, backtracking_tokens: int = 1) -> KVSize:
        """The sizes DeepInfer allocates for `text`; `backtracking_tokens` is the tokens a
        state can roll back (DEEPINFER_MAX_BACKTRACKING_TOKENS: the draft tokens plus one)."""
        layers = text["num_hidden_layers"]
        ratios = text["compress_ratios"][:layers]
        main_record = _FP4_RECORD if text.get("use_fp4_sparse_kv", True) else _MXFP8_RECORD
        index_dim = text.get("index_head_dim", 0)
        index_record = index_dim // 2 + index_dim // 32
        sparse = text.get("index_topk", 0) > 0
        kv_sources = text.get("kv_source_layer_ids")
        kv_owners = _owners(layers, kv_sources)
        index_owners = _owners(layers, text.get("index_k_source_layer_ids") or kv_sources)
        block = 0
        for layer, ratio in enumerate(ratios):
            if ratio == 0:
                continue  # a sliding-window layer keeps its window in the state slot
            tokens = BLOCK_SIZE // ratio
            if sparse and layer in index_owners:
                block += _pad(tokens * index_record, 32)
            if layer in kv_owners:
                block += _pad(tokens * main_record, 32)
        block = _pad(block, math.lcm(128, main_record))
        windows = layers + text.get("num_nextn_predict_layers", 0)
        window = _pad((text["sliding_window"] + backtracking_tokens) * _MXFP8_RECORD, 32)
        ring = (2 + max(0, backtracking_tokens - 1)) * 2 * text["head_dim"] * _FLOAT32
        rings = sum(1 for layer, r in enumerate(ratios) if r == 2 and layer in kv_owners)
        state = _pad(windows * window + rings * ring, math.lcm(32, _MXFP8_RECORD))
        return cls(block_bytes=block, state_bytes=state)

    @classmethod
    def of_checkpoint(cls, checkpoint: str | None, backtracking_tokens: int = 1) -> KVSize:
        """The sizes of the checkpoint directory's config.json; the released
        DeepSeek-V4.1-Flash's without a checkpoint (or one without a V4.1 config)."""
        return cls.of_config(read_text_config(checkpoint), backtracking_tokens)


def read_text_config(checkpoint: str | None) -> TextConfig:
    """The checkpoint's `text_config` (RELEASED_TEXT_CONFIG when there is none to read)."""
    if checkpoint is None:
        return RELEASED_TEXT_CONFIG
    try:
        config = json.loads((Path(checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return RELEASED_TEXT_CONFIG
    text = config.get("text_config") if isinstance(config, dict) else None
    if not isinstance(text, dict) or "compress_ratios" not in text:
        return RELEASED_TEXT_CONFIG
    return cast(TextConfig, text)


def valid_kv_bytes(option: str | None) -> bool:
    """Whether `option` is a `--sim-kv-bytes-per-token` value: auto, or a positive integer."""
    return option is None or option == "auto" or (option.isdigit() and int(option) > 0)


def kv_size_option(
    option: str | None, checkpoint: str | None, speculative_tokens: int
) -> KVSize | None:
    """The rows `--sim-kv-bytes-per-token` asks for: None (the provenance alone), the
    checkpoint's (auto: its state slots roll back the draft tokens and one more, as DeepInfer's
    DEEPINFER_MAX_BACKTRACKING_TOKENS does), or N bytes a token with the state slot as small
    as it can be."""
    if option is None:
        return None
    if option == "auto":
        return KVSize.of_checkpoint(checkpoint, speculative_tokens + 1)
    return KVSize(block_bytes=int(option) * BLOCK_SIZE, state_bytes=0)
