"""The grammar-abuse set (tests/grammar_abuse.py) against the simulated engine: each case gets
one of its outcomes, and the engine keeps serving a plain request beside it (a
`{"$ref": "#"}` schema once raised inside step() and killed the rank)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from deepinfer_server.engines.simulated.engine import LLMEngine
from deepinfer_server.engines.simulated.sequence import FINISH_SO_FAILED
from deepinfer_server.grammar import GrammarBounds, GrammarCompiler, GrammarError, chat_constraint
from deepinfer_server.grammar._xgr import Vocab
from deepinfer_server.grammar.matcher import PLAN_TRIALS, SimulatedMatcher
from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from tests.grammar_abuse import CASES, ENDLESS, GrammarAbuseCase, describe
from tests.lanes import require_grammar
from tests.unit.engines.test_simulated_engine import make_engine, prompt, read

require_grammar()
pytestmark = pytest.mark.grammar

#: Small bounds keep the expensive cases cheap: what matters is that they are bounded.
TEST_BOUNDS = GrammarBounds(
    max_grammar_bytes=64 * 1024, compile_timeout_s=3.0, max_compiled_bytes=64 * 1024**2
)
#: How long a case may take (compile workers start in seconds; steps last 5 ms).
_CASE_SECONDS = 120.0


@pytest.fixture(scope="module")
def api_compiler() -> Iterator[GrammarCompiler]:
    """The API process's check, with the test bounds."""
    compiler = GrammarCompiler(
        Vocab.from_tokenizer_json(embedded_tokenizer_json()), bounds=TEST_BOUNDS
    )
    yield compiler
    compiler.close()


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    """One engine for every case: each must leave it serving."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEEPINFER_XGRAMMAR_TIMEOUT", "6")
        built = make_engine(itl_ms=5.0)
        yield built
        built.close()


def _run(engine: LLMEngine, ids: set[str]) -> dict[str, str]:
    """Step until every request in `ids` finished; their finish reasons."""
    finished: dict[str, str] = {}
    deadline = time.monotonic() + _CASE_SECONDS
    while time.monotonic() < deadline:
        if not engine.has_unfinished_requests():
            break
        for request_id, _, reason in read(engine.step()):
            if reason:
                finished[request_id] = reason
    for request_id, _, reason in read(engine.flush_inflight_reqs()):
        if reason:
            finished[request_id] = reason
    assert set(finished) == ids, f"unfinished after {_CASE_SECONDS:g}s: {ids - set(finished)}"
    return finished


@pytest.mark.e2e  # the simulated engine with real compile workers, each case to its bound
@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_case_ends_alone_and_the_engine_keeps_serving(
    case: GrammarAbuseCase, api_compiler: GrammarCompiler, engine: LLMEngine
) -> None:
    try:
        constraint = chat_constraint(case.body)
        assert constraint is not None
        so_args = api_compiler.so_args_for(constraint)
    except GrammarError:
        assert "refused" in case.outcomes, describe(case)
        return
    grammar_id, plain_id = f"{case.name}-grammar", f"{case.name}-plain"
    engine.add_request("u", grammar_id, {"max_tokens": 48, "so_args": so_args}, prompt("hi"))
    engine.add_request("u", plain_id, {"max_tokens": 8}, prompt("plain"))
    finished = _run(engine, {grammar_id, plain_id})
    assert finished[plain_id] in ("stop", "length")
    outcome = "grammar_failed" if finished[grammar_id] == FINISH_SO_FAILED else "answered"
    assert outcome in case.outcomes, f"{describe(case)} -> {finished[grammar_id]}"


@pytest.mark.parametrize("case", ENDLESS, ids=str)
def test_the_planner_does_bounded_work_per_token(
    case: GrammarAbuseCase, api_compiler: GrammarCompiler
) -> None:
    """Endless grammars once ran xgrammar's jump-forward (100 MB for `a{100000000}`) or a plan
    walk proportional to max_tokens inside the rank loop."""
    constraint = chat_constraint(case.body)
    assert constraint is not None
    try:
        so_args = api_compiler.so_args_for(constraint)
        matcher = SimulatedMatcher.from_so_args(so_args, api_compiler, max_tokens=10_000)
    except GrammarError as exc:
        # Refused within the grammar bounds (on a slow machine, by the compile-time bound):
        # then no planner ever runs for it.
        assert "refused" in case.outcomes, f"{describe(case)}: {exc.message}"
        pytest.skip(f"refused on this machine: {exc.message}")
    preferred = api_compiler.vocab.encode("Hello there, this is free text")
    tokens = 0
    try:
        for position in range(64):
            matcher.choose(preferred[position % len(preferred)])
            tokens += 1
    except Exception:
        assert "grammar_failed" in case.outcomes, describe(case)
    assert matcher.stats.plan_trials <= PLAN_TRIALS * matcher.stats.plans
    assert matcher.stats.plans <= 2 * tokens + 1  # at most an initial plan and a re-plan a token
