"""The simulated engine schedules prompts at DeepInfer 0.1.0's prefill attempt points."""

from __future__ import annotations

import copy
import threading

from deepinfer_server.engines.simulated.collectives import new_lockstep_group
from deepinfer_server.engines.simulated.engine import LLMEngine, SimEngineArgs
from deepinfer_server.engines.simulated.outputs import RequestOutput
from tests.unit.engines.test_simulated_engine import _tokenizer_json, prompt

LONG = {"max_tokens": 1000, "ignore_eos": True}


def _engine(rank: int = 0, dp: int = 1, group: object = None, **overrides: object) -> LLMEngine:
    args = SimEngineArgs(
        tokenizer_json=_tokenizer_json(),
        lockstep=group or new_lockstep_group(1, 5.0),  # type: ignore[arg-type]
        engine_rank=rank,
        data_parallel_size=dp,
        ttft_ms=0.0,
        itl_ms=0.0,
        zero_overhead_scheduling=False,
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    return LLMEngine.from_engine_args(args)


def _step(engine: LLMEngine) -> list[str]:
    engine.has_unfinished_requests()
    return [RequestOutput.get_request_id(h) for h in engine.step().tolist()]


def test_a_new_prompt_waits_for_the_next_attempt_point_and_the_step_is_all_prefill() -> None:
    engine = _engine(prefill_attempt_interval=5)
    engine.add_request("0", "busy", LONG, prompt("a"))
    assert _step(engine) == ["busy"]  # step 1: decode_step 0, an ALL point: prefill
    assert _step(engine) == ["busy"]  # decode_step 0 again (reset by the prompt step): decode
    engine.add_request("0", "new", LONG, prompt("b"))
    seen = [_step(engine) for _ in range(5)]  # decode_step 1..5
    # decode steps 1-4 only decode; at decode_step 5 the step is all prefill: "new" gets its
    # first token and "busy" gets none.
    assert seen == [["busy"]] * 4 + [["new"]]
    assert _step(engine) == ["busy", "new"]


def test_interval_one_prefills_at_every_step() -> None:
    engine = _engine(prefill_attempt_interval=1)
    engine.add_request("0", "busy", LONG, prompt("a"))
    _step(engine)
    _step(engine)
    engine.add_request("0", "new", LONG, prompt("b"))
    assert _step(engine) == ["new"]


def test_a_busy_engine_prefills_a_new_prompt_in_its_next_step() -> None:
    # DeepInfer schedules a request added between two steps into the next one. The TTFT
    # delay (here one step period) runs from that step's start: added a moment after the
    # previous step ended, the prompt is still due by the next step's end, not one step later.
    engine = _engine(prefill_attempt_interval=1, ttft_ms=50.0, itl_ms=50.0)
    engine.add_request("0", "busy", LONG, prompt("a"))
    assert _step(engine) == ["busy"]  # an idle engine's prompt step, ending once it is due
    assert _step(engine) == ["busy"]
    engine.add_request("0", "new", LONG, prompt("b"))
    assert _step(engine) == ["new"]


def test_a_lone_rank_waits_for_the_any_point_when_its_peer_wants_no_prefill() -> None:
    group = new_lockstep_group(2, 10.0)
    first_token_step: dict[int, int] = {}
    errors: list[BaseException] = []

    def rank(index: int) -> None:
        try:
            # A copy per thread: each rank process has its own round counter.
            engine = _engine(
                index,
                2,
                copy.copy(group),
                prefill_attempt_interval=3,
                prefill_any_attempt_interval=7,
            )
            if index == 0:
                engine.add_request("0", "r", LONG, prompt("a"))
            for step in range(1, 12):
                engine.has_unfinished_requests()
                handles = engine.step().tolist()
                if handles and index not in first_token_step:
                    first_token_step[index] = step
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    # ALL points (decode_step 0, 3, 6) fail: rank 1 wants nothing. The ANY point at
    # decode_step 7 is the 8th step.
    assert first_token_step == {0: 8}


def test_an_iteration_is_one_rendezvous_even_when_it_votes_and_prefills() -> None:
    # Every step is an attempt point; each rank has a prompt waiting at first and gets a second
    # one later, and rank 1 cannot run it (one running slot): the votes must still agree.
    group = new_lockstep_group(2, 10.0)
    groups = [copy.copy(group) for _ in range(2)]
    first_tokens: dict[int, list[int]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def rank(index: int) -> None:
        try:
            engine = _engine(
                index, 2, groups[index], prefill_attempt_interval=1, max_num_seqs=1 + (index == 0)
            )
            engine.add_request("0", "a", LONG, prompt("a"))
            for step in range(1, 9):
                if step == 4:
                    engine.add_request("0", "b", LONG, prompt("b"))
                assert engine.has_unfinished_requests()
                outputs = [RequestOutput.get_request_id(h) for h in engine.step().tolist()]
                if "b" in outputs and not first_tokens[index]:
                    first_tokens[index].append(step)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    # Step 4 is an ALL point where both ranks want a prefill but only rank 0 can schedule its
    # prompt: rank 0 prefills "b", rank 1 pads the prompt step and never runs its "b".
    assert first_tokens == {0: [4], 1: []}
    # Eight work checks, each carrying that step's votes: eight rendezvous per rank.
    assert [g._round for g in groups] == [8, 8]
