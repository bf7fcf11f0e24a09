"""Several choices per request (`n > 1`, or several completion prompts): one engine request
each, merged back into one OpenAI response.

Each choice runs as its own engine request with its own parser, so its output is a complete
single-choice response or stream; `ChoiceMerger` renumbers the choices and sums the usage.
"""

from __future__ import annotations

import hashlib
from typing import Annotated

import msgspec
import orjson
from msgspec import Meta

from deepinfer_server.errors import BadRequestError
from deepinfer_server.ipc.messages import SamplingOptions
from deepinfer_server.protocol.core.body import Said
from deepinfer_server.protocol.core.json_types import JsonObject

#: vLLM has no limit; each choice takes an admission slot, so keep a sane bound.
MAX_N = 128
_SEED_MASK = 2**63 - 1


#: `n`: how many choices to generate (1 when absent).
Choices = Annotated[
    int, Meta(ge=1, le=MAX_N), Said(f"'n' must be an integer between 1 and {MAX_N}")
]


def reject_n(body: JsonObject, api: str) -> None:
    """400 for `n` other than 1 in an API that has no several choices (Responses, Messages)."""
    if body.get("n") not in (None, 1):
        raise BadRequestError(f"{api} has no 'n': send one request per answer", param="n")


def seeds_for(seed: int | None, n: int) -> list[int | None]:
    """One seed per choice: the request's seed first, then seeds derived from it, so that a
    seeded request is reproducible; without a seed each engine request draws its own."""
    if seed is None:
        return [None] * n
    seeds: list[int | None] = [seed]
    for index in range(1, n):
        digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
        seeds.append(int.from_bytes(digest, "little") & _SEED_MASK)
    return seeds


def with_seed(sampling: SamplingOptions, seed: int | None) -> SamplingOptions:
    """The sampling options with another seed."""
    return msgspec.structs.replace(sampling, seed=seed)


def _sum_usage(usages: list[JsonObject], prompt_groups: list[int]) -> JsonObject:
    """Completion counts summed over the choices, prompt counts over the distinct prompts."""
    merged = orjson.loads(orjson.dumps(usages[0]))
    seen = {prompt_groups[0]}
    for usage, group in zip(usages[1:], prompt_groups[1:], strict=True):
        _add(merged, usage, prompt_side=group not in seen)
        seen.add(group)
    merged["total_tokens"] = merged.get("prompt_tokens", 0) + merged.get("completion_tokens", 0)
    return dict(merged)


def _add(total: JsonObject, usage: JsonObject, prompt_side: bool) -> None:
    for key, value in usage.items():
        counts = prompt_side or key.startswith("completion")
        if isinstance(value, dict) and isinstance(total.get(key), dict):
            if counts:
                _add(total[key], value, prompt_side=True)
        elif isinstance(value, int) and isinstance(total.get(key), int) and counts:
            total[key] += value


class ChoiceMerger:
    """Merges single-choice OpenAI bodies and stream chunks (chat and completions shapes)."""

    def __init__(self, indices: list[int], prompt_groups: list[int]) -> None:
        self._indices = indices
        self._prompt_groups = prompt_groups
        self._usages: list[JsonObject | None] = [None] * len(indices)
        self._last_usage_chunk: JsonObject | None = None

    def merge_bodies(self, bodies: list[bytes]) -> bytes:
        """One response with every choice, in index order, and the summed usage."""
        parsed = [orjson.loads(body) for body in bodies]
        merged = parsed[0]
        choices = []
        for index, body in zip(self._indices, parsed, strict=True):
            for choice in body["choices"]:
                choice["index"] = index
                choices.append(choice)
        merged["choices"] = sorted(choices, key=lambda choice: choice["index"])
        if all(body.get("usage") for body in parsed):
            merged["usage"] = _sum_usage([body["usage"] for body in parsed], self._prompt_groups)
        return orjson.dumps(merged)

    def renumber(self, branch: int, payloads: list[str]) -> list[str]:
        """A branch's stream chunks with its choice index; its usage-only chunk is held back
        (`final_usage()` sends one for all branches)."""
        renumbered: list[str] = []
        for payload in payloads:
            chunk = orjson.loads(payload)
            if not chunk.get("choices") and chunk.get("usage"):
                self._usages[branch] = chunk["usage"]
                self._last_usage_chunk = chunk
                continue
            for choice in chunk.get("choices", ()):
                choice["index"] = self._indices[branch]
            renumbered.append(orjson.dumps(chunk).decode())
        return renumbered

    def final_usage(self) -> list[str]:
        """The one usage chunk of the merged stream (when the client asked for usage)."""
        chunk = self._last_usage_chunk
        usages = self._usages
        if chunk is None or any(usage is None for usage in usages):
            return []
        chunk["usage"] = _sum_usage([u for u in usages if u is not None], self._prompt_groups)
        return [orjson.dumps(chunk).decode()]
