"""Deterministic, plausible logprobs for the simulated engine's RequestOutput fields.

DeepInfer reports natural logs of the processed distribution: logits ×1/temperature, then top-p
and top-k, then log_softmax; filtered values are clamped to -9999 (`csrc/engine/outputs.hpp`). This
model builds such a distribution per generated token from a hash of (request context, position,
token): a support of `top_k` candidates (32 without top_k) with descending logits, the sampled
token at a small rank (always rank 0 when greedy), top-p applied to the sorted probabilities.
The same request gets the same values in every run.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from deepinfer_server.engines.simulated.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer_server.engines.simulated.outputs import OutputRecord

#: DeepInfer's value for filtered (or -inf) logprobs (outputs.hpp).
CLAMPED = -9999.0
#: Candidates of the distribution when top_k is off.
_SUPPORT = 32
#: Alternatives are drawn from ordinary (non-special) token IDs.
_FIRST_ORDINARY_ID = 100
_GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One generated token's logprob and its `top_logprobs` alternatives (descending)."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


def _seed(*keys: int) -> int:
    digest = hashlib.blake2b(repr(keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def context_key(prompt: list[int]) -> int:
    """A key of the request's prompt: the same prompt gives the same logprobs."""
    return _seed(len(prompt), *prompt[-64:])


def _log_softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    total = math.log(sum(math.exp(value - top) for value in logits))
    return [max(value - top - total, CLAMPED) for value in logits]


def _apply_top_p(values: list[float], top_p: float) -> list[float]:
    """Keep the smallest prefix holding `top_p` of the mass, renormalised; clamp the rest."""
    if top_p >= 1.0:
        return values
    mass = 0.0
    kept = len(values)
    for index, value in enumerate(values):
        mass += math.exp(value)
        if mass >= top_p:
            kept = index + 1
            break
    renormalised = _log_softmax(values[:kept])
    return renormalised + [CLAMPED] * (len(values) - kept)


def token_logprobs(
    key: int, position: int, token: int, params: SamplingParams, vocab_size: int
) -> TokenLogprobs:
    """The logprobs of `token` generated at `position` of the request with context `key`."""
    rng = random.Random(_seed(key, position, token))
    support = min(params.top_k if params.top_k > 0 else _SUPPORT, vocab_size)
    greedy = params.temperature <= _GREEDY_TEMPERATURE
    logits = [0.0]
    for _ in range(support - 1):
        logits.append(logits[-1] - rng.uniform(0.2, 2.0))
    values = _apply_top_p(_log_softmax([v / params.temperature for v in logits]), params.top_p)
    kept = sum(1 for value in values if value > CLAMPED)
    rank = 0 if greedy else min(rng.choices((0, 1, 2), (0.8, 0.15, 0.05))[0], kept - 1)
    wanted = params.top_logprobs
    ids = _alternatives(rng, token, max(support, wanted) - 1, vocab_size)
    ids.insert(rank, token)
    values += [CLAMPED] * (len(ids) - len(values))
    return TokenLogprobs(values[rank], ids[:wanted], values[:wanted])


def _alternatives(rng: random.Random, token: int, count: int, vocab_size: int) -> list[int]:
    low = min(_FIRST_ORDINARY_ID, vocab_size - 1)
    chosen: list[int] = []
    seen = {token}
    while len(chosen) < count and len(seen) < vocab_size - low:
        candidate = rng.randrange(low, vocab_size)
        if candidate not in seen:
            seen.add(candidate)
            chosen.append(candidate)
    return chosen


def prompt_logprobs(prompt: list[int]) -> list[float]:
    """`prompt_len - 1` logprobs: one per prompt token after the first."""
    rng = np.random.default_rng(_seed(len(prompt), *prompt[:64]))
    count = max(len(prompt) - 1, 0)
    return [float(v) for v in np.round(-rng.gamma(1.2, 2.0, size=count), 6)]


def annotate(record: OutputRecord, prompt: list[int], params: SamplingParams, vocab: int) -> None:
    """Give a generated token's record its logprob fields as DeepInfer does (always, whatever
    was asked). They are computed when first read: most requests never read them."""
    record.deferred = partial(_fill, prompt, params, vocab)


def _fill(prompt: list[int], params: SamplingParams, vocab: int, record: OutputRecord) -> None:
    position = record.num_output_tokens - 1
    values = token_logprobs(context_key(prompt), position, record.token_id, params, vocab)
    record.token_logprobs = values.logprob
    record.top_token_ids = values.top_token_ids
    record.top_logprobs = values.top_logprobs
    if position == 0 and params.prompt_logprobs:
        record.prompt_logprobs = prompt_logprobs(prompt)
