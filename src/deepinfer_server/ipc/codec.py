"""Packing of token ID lists for the wire: int32 little-endian bytes, both directions."""

from __future__ import annotations

import array
import sys

import numpy as np
import numpy.typing as npt


def pack_token_ids(token_ids: list[int]) -> bytes:
    """Token IDs as int32 little-endian bytes (one copy, no per-item msgpack work)."""
    packed = array.array("i", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_token_ids(data: bytes) -> npt.NDArray[np.int32]:
    """The C-contiguous int32 array DeepInfer's add_request wants, from `pack_token_ids` bytes."""
    return np.frombuffer(data, dtype="<i4").astype(np.int32, copy=True)
