"""MatcherBuilds: the simulated engine's structured-output builder (DeepInfer's SOMatcherBuilder).

A request's grammar compiles off the loop (in a killable worker process, waited for on a
builder thread) while the request waits outside the scheduler; each step picks up the
requests whose matcher is ready, in arrival order. A grammar that fails to compile or times
out marks its request, which then ends at its prefill with "xgrammar runtime errors or
timeout". The builder thread also fits the request's echo to its grammar (`echo_fitter`), so
that this work stays off the loop as well. Everything but the builder threads' own work runs
on the engine's thread.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from deepinfer_server.engines.simulated.echo_fitter import EchoFitter
from deepinfer_server.engines.simulated.inputs import SoArgs
from deepinfer_server.engines.simulated.sequence import Sequence
from deepinfer_server.grammar import (
    GrammarBounds,
    GrammarCompiler,
    GrammarError,
    SimulatedMatcher,
    Vocab,
)
from deepinfer_server.grammar._xgr import load_xgrammar
from deepinfer_server.grammar.compiler import compile_timeout_s
from deepinfer_server.grammar.errors import CompileRefused
from deepinfer_server.grammar.fork_server import start_fork_server, stop_fork_server

logger = logging.getLogger(__name__)

#: What the warm-up builds end to end (compiled by the worker, matched, an echo fitted to it).
WARM_SO_ARGS: SoArgs = {"schema_type": "json", "schema": '{"type": "object"}'}


class BuiltMatcher(NamedTuple):
    """A request's matcher and its script, fitted to the grammar (`echo_fitter`)."""

    matcher: SimulatedMatcher
    script: list[int]


class MatcherBuilds:
    """The requests whose matcher is being built, and the compiler that builds them."""

    def __init__(self, tokenizer_json: str, vocab_size: int) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._grammar: GrammarCompiler | None = None
        self._threads: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        #: Requests whose grammar is compiling (DeepInfer's SOMatcherBuilder pending list).
        self._pending: list[tuple[Sequence, Future[BuiltMatcher]]] = []
        #: Guards `_closed`, `_own_fork_server` and the compiler's publication (`_lock` is
        #: held while the compiler is built, seconds, which `close` must not wait for).
        self._state = threading.Lock()
        self._closed = False
        #: The warm-up started this process's compile workers' fork server (`close` stops it).
        self._own_fork_server = False

    def prepare(self, on_warm: Callable[[], None] | None = None) -> None:
        """Warm the builder now, on a builder thread, ahead of the first grammar: its compiler,
        its worker and one matcher built end to end; `on_warm()` then, on that thread (without
        xgrammar there is nothing to prepare; a warm-up that fails is logged and not reported:
        the first grammar tries again, and fails its request if need be)."""
        if importlib.util.find_spec("xgrammar") is None:
            return
        if self._threads is None:
            self._threads = ThreadPoolExecutor(2, thread_name_prefix="grammar-build")
        self._threads.submit(self._prepare, on_warm)

    def __len__(self) -> int:
        return len(self._pending)

    def submit(self, sequence: Sequence) -> None:
        """Start building the sequence's matcher; `pump()` hands it back once built."""
        self._pending.append((sequence, self._build(sequence)))

    def build_now(self, sequence: Sequence) -> None:
        """Build the sequence's matcher and wait for it (DeepInfer's `enqueue=False` path)."""
        self._attach(sequence, self._build(sequence))

    def pump(self) -> list[Sequence]:
        """The pending requests whose matcher is built (or failed), in arrival order."""
        if not self._pending:
            return []
        ready: list[Sequence] = []
        still: list[tuple[Sequence, Future[BuiltMatcher]]] = []
        for sequence, future in self._pending:
            if future.done():
                self._attach(sequence, future)
                ready.append(sequence)
            else:
                still.append((sequence, future))
        self._pending = still
        return ready

    def abort(self, request_ids: Collection[str]) -> list[Sequence]:
        """Drop the pending requests among `request_ids`; returns them."""
        dropped = [s for s, _ in self._pending if s.request_id in request_ids]
        self._pending = [(s, f) for s, f in self._pending if s.request_id not in request_ids]
        return dropped

    def close(self) -> None:
        """Stop the builder threads (without waiting) and the compiler's workers, and the
        fork server the warm-up started, at once even while it loads."""
        with self._state:
            self._closed = True
            grammar, own_fork_server = self._grammar, self._own_fork_server
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        if grammar is not None:
            grammar.close()
        if own_fork_server:
            stop_fork_server()

    def _build(self, sequence: Sequence) -> Future[BuiltMatcher]:
        """Start building the sequence's matcher off the loop (compiled in a worker process)."""
        so_args = sequence.params.so_args
        assert so_args is not None
        if self._threads is None:
            self._threads = ThreadPoolExecutor(2, thread_name_prefix="grammar-build")
        return self._threads.submit(
            self._matcher_for,
            dict(so_args),
            sequence.params.max_tokens,
            list(sequence.script),
            list(sequence.prompt),
        )

    def _compiler(self) -> GrammarCompiler:
        with self._lock:
            if self._grammar is None:
                load_xgrammar()  # before the vocabulary imports it, in full
                vocab = Vocab.from_tokenizer_json(self._tokenizer_json, self._vocab_size)
                bounds = GrammarBounds(compile_timeout_s=compile_timeout_s())
                grammar = GrammarCompiler(vocab, bounds=bounds, workers=1)
                with self._state:
                    if self._closed:  # no worker may start once closed
                        raise RuntimeError("the grammar builds were closed")
                    self._grammar = grammar
            return self._grammar

    def _is_closed(self) -> bool:
        with self._state:
            return self._closed

    def _prepare(self, on_warm: Callable[[], None] | None) -> None:
        """(On a builder thread.) The compiler, its worker and a first matcher."""
        started = time.perf_counter()
        try:
            # The worker's fork server loads xgrammar and the vocabulary while this process
            # loads its own, rather than after it.
            with self._state:
                if self._closed:
                    return
                self._own_fork_server = True
            start_fork_server(self._tokenizer_json, self._vocab_size)
            if self._is_closed():  # `close` may have come before the fork server was there
                stop_fork_server()
                return
            self._compiler().workers.start()
            self._matcher_for(dict(WARM_SO_ARGS), 16, [], [])
        except Exception:
            if not self._is_closed():  # else stopped during the warm-up: that ends it quietly
                logger.exception("preparing the grammar compiler failed")
            return
        logger.info(
            "[startup] grammar builder warm (%.1f s in the background)",
            time.perf_counter() - started,
        )
        if on_warm is not None:
            on_warm()

    def _matcher_for(
        self, so_args: SoArgs, max_tokens: int, script: list[int], prompt: list[int]
    ) -> BuiltMatcher:
        """(On a builder thread.) DeepInfer's compile, bounded by DEEPINFER_XGRAMMAR_TIMEOUT;
        then the script fitted to the grammar."""
        grammar = self._compiler()
        matcher = SimulatedMatcher.from_so_args(so_args, grammar, max_tokens)
        try:
            fitter = EchoFitter(grammar.compile(so_args), grammar.vocab, so_args)
            fitted = fitter.fit(script, prompt, max_tokens)
        except Exception:  # the echo as it was: the matcher decides every token anyway
            logger.exception("fitting the echo to its grammar failed")
            return BuiltMatcher(matcher, script)
        if fitted.plan is not None:
            matcher.follow(fitted.plan)
        return BuiltMatcher(matcher, fitted.script)

    def _attach(self, sequence: Sequence, future: Future[BuiltMatcher]) -> None:
        """Give the sequence its matcher; a grammar that did not compile ends the request with
        DeepInfer's structured-output failure (at its prefill)."""
        try:
            sequence.matcher, sequence.script = future.result()
        except (GrammarError, CompileRefused) as exc:
            logger.warning("request %s: grammar failed: %s", sequence.request_id, exc.message)
            sequence.grammar_failed = True
        except Exception:
            logger.exception("request %s: building its grammar failed", sequence.request_id)
            sequence.grammar_failed = True
