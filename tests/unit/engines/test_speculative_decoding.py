"""Speculative decoding on the simulated engine, as DeepInfer's MTP emits it (contract §3.5):
several tokens per decode step, stops inside the drafts, draft_tok/accept_tok on a step's last
entry, and the driver's acceptance counters."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver
from deepinfer_server.engines.simulated.abilities import SimulatedAbilities
from deepinfer_server.engines.simulated.engine import LLMEngine
from deepinfer_server.engines.simulated.outputs import RequestOutput
from deepinfer_server.engines.simulated.token_generator import accepted_drafts
from deepinfer_server.ipc.codec import pack_token_ids
from deepinfer_server.ipc.messages import AddRequest, Finish, SamplingOptions
from tests.unit.engines.test_simulated_engine import EOS, make_engine, prompt

TEXT = "one two three four five six seven eight nine ten eleven twelve"

#: (request_id, token_id, finish_reason, draft_tok, accept_tok) of one output entry.
Entry = tuple[str, int, str, int, int]


def _steps(engine: LLMEngine) -> list[list[Entry]]:
    """Every step's entries until the engine is idle (the flush's last)."""

    def read(handles: np.ndarray) -> list[Entry]:
        return [
            (
                RequestOutput.get_request_id(h),
                RequestOutput.get_token_id(h),
                RequestOutput.get_finish_reason(h),
                RequestOutput.get_draft_tok(h),
                RequestOutput.get_accept_tok(h),
            )
            for h in handles
        ]

    steps = []
    while engine.has_unfinished_requests():
        steps.append(read(engine.step()))
    steps.append(read(engine.flush_inflight_reqs()))
    return [step for step in steps if step]


def _tokens(steps: list[list[Entry]]) -> list[int]:
    return [entry[1] for step in steps for entry in step]


def _answer(speculative_tokens: int, params: dict[str, object]) -> list[list[Entry]]:
    engine = make_engine(speculative_tokens=speculative_tokens)
    engine.add_request("0", "r1", dict(params), prompt(TEXT))
    return _steps(engine)


def test_the_acceptance_pattern_cycles_from_all_drafts_to_none() -> None:
    assert [accepted_drafts(3, k) for k in range(9)] == [3, 2, 1, 0, 3, 2, 1, 0, 3]


@pytest.mark.parametrize("drafts", [1, 3, 5])
def test_speculation_emits_the_same_tokens_in_fewer_steps(drafts: int) -> None:
    plain = _answer(0, {"max_tokens": 100})
    speculative = _answer(drafts, {"max_tokens": 100})
    assert _tokens(speculative) == _tokens(plain)
    assert _tokens(plain)[-1] == EOS
    assert len(speculative) < len(plain)
    # The prompt step emits one token without drafts; each decode step then emits its
    # accepted drafts and its own token, following the pattern, the counts on its last entry.
    first, *decode = speculative
    assert [(e[3], e[4]) for e in first] == [(1, 1)]
    for k, step in enumerate(decode[:-1]):
        accepted = accepted_drafts(drafts, k)
        assert len(step) == accepted + 1
        assert [(e[3], e[4]) for e in step] == [(0, 0)] * accepted + [(drafts + 1, accepted + 1)]


def test_eos_inside_the_drafts_ends_the_sequence_there() -> None:
    steps = _answer(5, {"max_tokens": 100})
    last = steps[-1]
    # The step that reached EOS accepted more drafts than it emitted: nothing after the EOS.
    assert last[-1][1:3] == (EOS, "stop")
    assert len(last) < last[-1][4]
    entries = [entry for step in steps for entry in step]
    assert all(entry[2] == "" for entry in entries[:-1])
    assert _tokens(steps).count(EOS) == 1


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7])
def test_max_tokens_inside_the_drafts_ends_with_exactly_max_tokens(max_tokens: int) -> None:
    steps = _answer(4, {"max_tokens": max_tokens, "ignore_eos": True})
    tokens = _tokens(steps)
    assert len(tokens) == max_tokens
    assert tokens == _tokens(_answer(0, {"max_tokens": max_tokens, "ignore_eos": True}))
    assert steps[-1][-1][2] == "length"


def test_the_driver_counts_drafts_and_accepted_tokens_by_position() -> None:
    engine = make_engine(speculative_tokens=3)
    driver = LLMEngineDriver(engine, RequestOutput, SimulatedAbilities(engine), count_drafts=True)
    options = SamplingOptions(max_tokens=24, ignore_eos=True)
    assert driver.add(AddRequest("r1", pack_token_ids(prompt(TEXT).tolist()), options)) is None
    finished = False
    while not finished:
        _, deltas = driver.iterate()
        finished = any(delta.finish is Finish.LENGTH for delta in deltas)
    counters = driver.counters()
    assert counters is not None
    # 23 tokens after the prompt's first: steps accepting 3, 2, 1, 0 drafts emit 4+3+2+1 = 10
    # tokens a cycle, so two cycles and a step accepting 3 (of which one token is emitted).
    assert (counters.spec_drafts, counters.spec_draft_tokens) == (9, 27)
    assert counters.spec_accepted_tokens == 2 * (3 + 2 + 1) + 3
    assert counters.spec_accepted_per_position == [2 * 3 + 1, 2 * 2 + 1, 2 * 1 + 1]
    assert driver.counters() is None  # unchanged since


def test_a_driver_not_told_to_count_reports_no_drafts() -> None:
    engine = make_engine(speculative_tokens=3)
    driver = LLMEngineDriver(engine, RequestOutput, SimulatedAbilities(engine))
    options = SamplingOptions(max_tokens=8, ignore_eos=True)
    driver.add(AddRequest("r1", pack_token_ids(prompt(TEXT).tolist()), options))
    while driver.iterate()[0]:
        pass
    counters = driver.counters()
    assert counters is not None and counters.spec_draft_tokens == 0
