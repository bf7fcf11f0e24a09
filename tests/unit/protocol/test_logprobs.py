"""Logprobs through the seams: the simulated engine's model, the driver, GeneratedTokens."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver
from deepinfer_server.engines.simulated.logprobs import CLAMPED, context_key, token_logprobs
from deepinfer_server.engines.simulated.sampling_params import SamplingParams
from deepinfer_server.ipc.messages import GeneratedTokens
from tests.unit.engines.test_llm_engine_driver import PROMPT, add, make_adapter

VOCAB = 129_280


def test_sampled_token_logprob_matches_its_rank_in_a_normalised_top_k() -> None:
    params = SamplingParams(temperature=0.7, top_k=8, top_logprobs=8)
    for position in range(50):
        values = token_logprobs(123, position, 4242, params, VOCAB)
        assert len(values.top_token_ids) == len(values.top_logprobs) == 8
        assert values.top_logprobs == sorted(values.top_logprobs, reverse=True)
        rank = values.top_token_ids.index(4242)
        assert values.logprob == values.top_logprobs[rank]
        assert len(set(values.top_token_ids)) == 8
        # top_k=8: the eight candidates hold all the probability mass.
        assert math.isclose(sum(math.exp(v) for v in values.top_logprobs), 1.0, rel_tol=1e-6)


def test_greedy_is_degenerate_and_top_p_clamps_the_tail() -> None:
    greedy = token_logprobs(1, 0, 77, SamplingParams(temperature=0.0, top_logprobs=3), VOCAB)
    assert greedy.top_token_ids[0] == 77 and greedy.logprob == pytest.approx(0.0)
    assert greedy.top_logprobs[1:] == [CLAMPED, CLAMPED]
    nucleus = token_logprobs(1, 0, 77, SamplingParams(top_p=0.5, top_logprobs=32), VOCAB)
    assert CLAMPED in nucleus.top_logprobs and nucleus.logprob > CLAMPED


_IN_ANOTHER_INTERPRETER = """
import json, sys
from deepinfer_server.engines.simulated.logprobs import context_key, token_logprobs
from deepinfer_server.engines.simulated.sampling_params import SamplingParams
values = token_logprobs(context_key([9, 8, 7]), 3, 500, SamplingParams(top_logprobs=5), 129_280)
print(json.dumps([values.logprob, values.top_token_ids, values.top_logprobs]))
"""


def test_logprobs_are_the_same_in_every_run() -> None:
    """Another interpreter, with another string-hash seed, computes the same values: nothing in
    the model depends on the process (a global random state, a salted `hash`)."""
    values = token_logprobs(context_key([9, 8, 7]), 3, 500, SamplingParams(top_logprobs=5), VOCAB)
    other = subprocess.run(
        [sys.executable, "-c", _IN_ANOTHER_INTERPRETER],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        check=True,
    )
    assert json.loads(other.stdout) == [values.logprob, values.top_token_ids, values.top_logprobs]
    assert 500 in values.top_token_ids
    other_context = token_logprobs(
        context_key([9, 8, 6]), 3, 500, SamplingParams(top_logprobs=5), VOCAB
    )
    assert other_context != values  # the values follow the request's context


def _drain_tokens(adapter: LLMEngineDriver, request_id: str) -> GeneratedTokens:
    collected = GeneratedTokens()
    for _ in range(1000):
        _, outputs = adapter.iterate()
        for output in outputs:
            collected.extend(output.tokens)
            if output.finish is not None:
                return collected
    raise AssertionError("the request never finished")


def test_driver_keeps_logprobs_aligned_when_eos_is_hidden() -> None:
    adapter = make_adapter(tokens_per_step=3)
    add(adapter, "r1", PROMPT, logprobs=True, top_logprobs=4, prompt_logprobs=True)
    tokens = _drain_tokens(adapter, "r1")
    assert tokens.token_ids == [19923]  # "Hello"; the EOS of the stop finish is hidden
    assert tokens.logprobs is not None and len(tokens.logprobs) == 1
    assert tokens.top_logprobs is not None and len(tokens.top_logprobs[0]) == 4
    assert (19923, tokens.logprobs[0]) in tokens.top_logprobs[0]
    assert tokens.prompt_logprobs is not None and len(tokens.prompt_logprobs) == len(PROMPT) - 1


def test_driver_reads_no_logprobs_unless_asked() -> None:
    adapter = make_adapter()
    add(adapter, "r1", PROMPT)
    tokens = _drain_tokens(adapter, "r1")
    assert tokens.logprobs is None and tokens.top_logprobs is None
    assert tokens.prompt_logprobs is None


def test_extend_keeps_per_token_fields_aligned() -> None:
    first = GeneratedTokens([1, 2], [-0.1, -0.2], [[(1, -0.1)], [(2, -0.2)]], [-3.0])
    merged = GeneratedTokens()
    merged.extend(first)
    merged.extend(GeneratedTokens())  # a bare finish carries nothing
    merged.extend(GeneratedTokens([3], [-0.3], [[(3, -0.3)]]))
    assert merged.logprob_pairs() == [(-0.1, [(1, -0.1)]), (-0.2, [(2, -0.2)]), (-0.3, [(3, -0.3)])]
    assert merged.prompt_logprobs == [-3.0]
    with pytest.raises(ValueError):
        merged.extend(GeneratedTokens([4]))
