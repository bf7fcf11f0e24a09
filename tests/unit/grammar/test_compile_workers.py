"""Grammars compile in worker processes within bounds: a runaway compile is killed
with its worker, which is replaced; a compile over the memory bound is refused; a grammar that
passed is never compiled again; the simulated engine's loop never waits for a compile."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import psutil
import pytest

from deepinfer_server.engines.simulated.sequence import FINISH_SO_FAILED
from deepinfer_server.grammar import GrammarBounds, GrammarCompiler, GrammarError
from deepinfer_server.grammar._xgr import Vocab
from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from tests.lanes import require_grammar
from tests.unit.engines.test_simulated_engine import make_engine, prompt, read

require_grammar()

#: Real compile worker processes, killed at their time and memory bounds: seconds per test.
pytestmark = [pytest.mark.e2e, pytest.mark.grammar]

TRIVIAL = {"schema_type": "regex", "schema": "(yes|no)"}
#: Minutes to compile, and gigabytes (measured: 4 KiB of it takes 15 s and 145 MB of RSS).
SLOW = {"schema_type": "regex", "schema": "\\w{1,5}-" * 2048}
#: Over a gigabyte of address space to compile (std::bad_alloc under a 64 MiB bound).
HUNGRY = {"schema_type": "regex", "schema": "\\w{1,5}-" * 1000}


def _vocab() -> Vocab:
    return Vocab.from_tokenizer_json(embedded_tokenizer_json())


@pytest.fixture
def compiler() -> Iterator[GrammarCompiler]:
    compiler = GrammarCompiler(_vocab(), bounds=GrammarBounds(compile_timeout_s=1.0))
    yield compiler
    compiler.close()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_runaway_compiles_are_killed_and_a_trivial_grammar_does_not_wait_behind_them(
    compiler: GrammarCompiler,
) -> None:
    compiler.check(TRIVIAL)  # both workers are up
    started = compiler.workers.pids
    assert len(started) == 2
    errors: list[str] = []

    def slow(index: int) -> None:
        schema = {**SLOW, "schema": SLOW["schema"] + "x" * index}  # two distinct grammars
        try:
            compiler.check(schema)
        except GrammarError as exc:
            errors.append(exc.message)

    threads = [threading.Thread(target=slow, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(errors) == 2 and all("took longer than 1 s" in e for e in errors), errors
    assert not any(_alive(pid) for pid in started), "a timed-out compile kept running"
    compiler.check({**TRIVIAL, "schema": "(maybe|so)"})  # on a replacement worker
    assert len(compiler.workers.pids) == 2 and not compiler.workers.pids & started


def test_a_compile_over_the_memory_bound_is_refused_and_the_next_one_compiles() -> None:
    bounds = GrammarBounds(compile_timeout_s=60.0, compile_memory_bytes=64 * 1024**2)
    compiler = GrammarCompiler(_vocab(), bounds=bounds, workers=1)
    try:
        with pytest.raises(GrammarError, match="needs more than 64 MiB"):
            compiler.check(HUNGRY)
        compiler.check(TRIVIAL)
    finally:
        compiler.close()


def test_a_grammar_that_passed_is_not_compiled_again(compiler: GrammarCompiler) -> None:
    # 6.8 MB compiled: more than the old cache kept for an entry of this size estimate.
    large = {
        "schema_type": "regex",
        "schema": "(" + "|".join(f"w{i:05d}" for i in range(9000)) + ")",
    }
    for _ in range(3):
        compiler.check(large)
    assert compiler.workers.compiles == 1


def test_a_compiled_grammar_over_the_size_bound_is_refused() -> None:
    bounds = GrammarBounds(compile_timeout_s=60.0, max_compiled_bytes=1024**2)
    compiler = GrammarCompiler(_vocab(), bounds=bounds, workers=1)
    try:
        with pytest.raises(GrammarError, match=r"compiles to \d+ bytes; the limit is 1048576"):
            compiler.check({"schema_type": "regex", "schema": "[a-z]+," * 300})
    finally:
        compiler.close()


def test_the_engine_steps_other_requests_while_a_grammar_compiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DeepInfer's SOMatcherBuilder: the request waits outside the scheduler while its grammar
    compiles; the loop goes on, and a compile over DEEPINFER_XGRAMMAR_TIMEOUT ends only it."""
    monkeypatch.setenv("DEEPINFER_XGRAMMAR_TIMEOUT", "2")
    engine = make_engine(itl_ms=5.0)
    try:
        engine.add_request("u", "slow", {"max_tokens": 8, "so_args": SLOW}, prompt("hi"))
        engine.add_request("u", "plain", {"max_tokens": 8}, prompt("plain"))
        order: list[tuple[str, str]] = []
        while engine.has_unfinished_requests():
            order.extend((rid, reason) for rid, _, reason in read(engine.step()) if reason)
        order.extend(
            (rid, reason) for rid, _, reason in read(engine.flush_inflight_reqs()) if reason
        )
        assert [rid for rid, _ in order] == ["plain", "slow"]
        assert dict(order)["slow"] == FINISH_SO_FAILED
    finally:
        engine.close()


def test_workers_started_by_a_thread_that_ended_still_compile(compiler: GrammarCompiler) -> None:
    """The workers' parent-death signal follows the thread that started them: a request's
    worker thread that starts them and ends must not take them along."""
    first = threading.Thread(target=compiler.check, args=(TRIVIAL,))
    first.start()
    first.join()
    started = compiler.workers.pids
    assert len(started) == 2
    assert all(_alive(pid) for pid in started)
    compiler.check({"schema_type": "regex", "schema": "(maybe|perhaps)"})  # not "died"
    assert compiler.workers.pids == started
