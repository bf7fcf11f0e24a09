"""The shapes of `add_request`'s dict arguments, as DeepInfer 0.1.0 takes them.

They stay mappings (DeepInfer's own signature, and what the engine driver passes): the
keys each one is read for are named here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

#: SamplingParams keywords; None values are dropped, an unknown key is a TypeError.
SamplingParamsDict = Mapping[str, object]
#: `multi_modal_data`: "image_sizes" (width, height) pairs and "image_bytes", one per image.
MultiModalData = Mapping[str, object]
#: `extra`: the server's "kv_transfer_params" for a COMPLETION engine's request.
Extra = Mapping[str, object]
#: `SamplingParams.so_args`: "schema_type", "schema" and maybe "trigger_token_ids".
SoArgs = Mapping[str, object]


class SamplingParamsKwargs(TypedDict, total=False):
    """The keywords `SamplingParams` takes (a dict of others raises its TypeError)."""

    temperature: float
    top_p: float
    top_k: int
    ignore_eos: bool
    max_tokens: int
    logprobs: bool
    prompt_logprobs: bool
    top_logprobs: int
    first_n_token_no_eos: int
    eos_id: int
    so_args: SoArgs | None
    golden_token_ids: list[int] | None
    seq_seed: int | None
