"""The fields Chat Completions and Completions bodies share besides sampling (OpenAI's and
vLLM's): choices, the output cap, streaming options and the prefix cache's partition and
session."""

from __future__ import annotations

from deepinfer_server.protocol.core.body import CacheSalt, StreamOptions, UInt32
from deepinfer_server.protocol.core.choices import Choices
from deepinfer_server.protocol.core.sampling import OpenAISampling


class OpenAIGenerationBody(OpenAISampling, kw_only=True, frozen=True):
    """What `/v1/chat/completions` and `/v1/completions` both read, typed."""

    n: Choices | None = None
    max_tokens: UInt32 | None = None
    ignore_eos: bool | None = None
    stream_options: StreamOptions | None = None
    cache_salt: CacheSalt | None = None
    #: Names the request's session for the rank choice (`protocol/core/session_key.py`).
    prompt_cache_key: str | None = None
