"""StructuredOutputs: the API process's grammar compiler, its compile workers and the fair queue
before them (`protocol/core/structured.py` reads what a request asks).

Compiling is not cheap (xgrammar; from milliseconds to seconds): `compile` awaits it in the fair
queue in front of the compile workers (`grammar.compile_queue`), with the same compiler and
version the engine uses, so a bad schema, regex or grammar is a 400 naming the field before the
engine sees the request; a key over its queued compiles is a 429 and a server out of compile
capacity a 503, both with Retry-After. The vocabulary and the workers are prepared in the
background (`start`, once the server listens; `/health` waits for them, `api/warmup.py`); a
structured request that arrives first waits for them, then takes its turn as any other.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import threading
import time
from concurrent.futures import Future
from typing import TypeVar

from deepinfer_server.grammar import (
    Constraint,
    GrammarCompiler,
    GrammarUnavailable,
    VocabSource,
)
from deepinfer_server.grammar.compile_queue import FairCompileQueue, QueueLimits, QueueStats
from deepinfer_server.grammar.compile_workers import STARTUP_TIMEOUT_S
from deepinfer_server.grammar.fork_server import start_fork_server, stop_fork_server
from deepinfer_server.ipc.messages import StructuredOutput
from deepinfer_server.protocol.core.structured import grammar_errors, is_forced_tool_call

T = TypeVar("T")

logger = logging.getLogger(__name__)


def xgrammar_installed() -> bool:
    """Whether the grammar engine (the [grammar] extra) is installed; not imported here."""
    return importlib.util.find_spec("xgrammar") is not None


class StructuredOutputs:
    """The API process's grammar compiler, its compile workers and the fair queue before them."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int | None = None,
        *,
        limits: QueueLimits | None = None,
        workers: int = 2,
        spare_workers: int = 1,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._limits = limits or QueueLimits()
        self._workers = workers
        self._spare_workers = spare_workers
        self._prepared: Future[GrammarCompiler] | None = None
        self._compiler: GrammarCompiler | None = None
        self._queue: FairCompileQueue | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._warned_unconstrained = False

    def start(self) -> None:
        """Start preparing the vocabulary and the compile workers, on a thread of their own
        (a no-op once started; without xgrammar there is nothing to prepare)."""
        with self._lock:
            if self._prepared is not None:
                return
            self._prepared = Future()
        threading.Thread(target=self._prepare, name="grammar-prepare", daemon=True).start()

    async def wait_ready(self) -> bool:
        """Start if need be, then wait until the workers are ready (or failed to start: False,
        logged; each structured request is then refused on its own)."""
        self.start()
        assert self._prepared is not None
        try:
            await asyncio.wrap_future(self._prepared)
        except GrammarUnavailable:
            return True
        except Exception:
            return False
        return True

    @property
    def warm(self) -> bool:
        """Whether the compile workers are prepared and every one of them is ready (never
        without xgrammar)."""
        compiler, queue = self._compiler, self._queue
        if compiler is None or queue is None:
            return False
        return compiler.workers.ready >= compiler.processes

    @property
    def preparing(self) -> bool:
        """Whether the compile workers are still to be made ready: not started yet, or started
        and neither all ready nor failed to prepare (False without xgrammar)."""
        prepared = self._prepared
        if prepared is not None and prepared.done() and prepared.exception() is not None:
            return False
        return not self.warm

    def queue_stats(self) -> QueueStats | None:
        """The compile queue's counts (None before the workers are prepared)."""
        queue = self._queue
        return None if queue is None else queue.stats()

    async def compile(self, constraint: Constraint, key: str) -> StructuredOutput | None:
        """The so_args for `constraint`, compiled once to validate them, in `key`'s turn
        (`key`: the request's tenant, `api.auth.tenant_of`, never its API key).

        None when the constraint is only `strict` tools under auto and xgrammar is missing.
        """
        self.start()
        assert self._prepared is not None
        with grammar_errors():
            try:
                compiler = await asyncio.wrap_future(self._prepared)
            except GrammarUnavailable:
                # Without a grammar engine, tools are served as deepseek-recipe renders them:
                # strict ones unconstrained, and a forced call outside thinking mode through the
                # prompt (it ends by opening the tool-call block). Thinking mode cannot be forced.
                forced_in_thinking = is_forced_tool_call(constraint) and constraint.thinking
                if constraint.kind is None and not forced_in_thinking:
                    self._warn_unconstrained()
                    return None
                raise
            so_args = compiler.known_so_args(constraint)
            if so_args is None:  # a worker builds and compiles them, in `key`'s turn
                compiler.precheck(constraint)  # a 400 over the size bound needs no turn
                assert self._queue is not None
                so_args = await self._queue.run(key, lambda: compiler.so_args_for(constraint))
        assert so_args is not None
        trigger = so_args.get("trigger_token_ids")
        return StructuredOutput(
            schema_type=str(so_args["schema_type"]),
            schema=str(so_args["schema"]),
            trigger_token_ids=list(trigger) if trigger else None,
        )

    def close(self) -> None:
        """Stop the compile workers (if they were started), even during the warm-up: that ends
        quietly, and its fork server, which may still be loading, stops with it."""
        with self._lock:
            self._closed = True
            compiler = self._compiler
            warming = self._prepared is not None and not self._prepared.done()
        if compiler is not None:
            compiler.close()
        if warming:
            stop_fork_server()
        if self._queue is not None:
            self._queue.close()

    def _closed_meanwhile(self, compiler: GrammarCompiler | None) -> bool:
        """(On the preparing thread.) Whether `close()` came first: then what was started is
        stopped here, and the preparation ends without a word."""
        with self._lock:
            self._compiler = compiler
            closed = self._closed
        if closed and compiler is not None:
            compiler.close()
        if closed:
            stop_fork_server()
        return closed

    def _prepare(self) -> None:
        """(On its own thread.) The vocabulary, the compiler and its ready workers."""
        assert self._prepared is not None
        started = time.perf_counter()
        try:
            if not xgrammar_installed():
                raise GrammarUnavailable()
            # Only the workers' fork server imports xgrammar (and PyTorch): the workers build
            # each request's so_args, so this process never holds either.
            start_fork_server(self._tokenizer_json, self._vocab_size)
            source = VocabSource(self._tokenizer_json, self._vocab_size)
            compiler = GrammarCompiler(
                source, workers=self._workers, spare_workers=self._spare_workers
            )
            if self._closed_meanwhile(compiler):
                self._prepared.set_result(compiler)
                return
        except GrammarUnavailable as exc:
            self._prepared.set_exception(exc)
            return
        except Exception as exc:
            logger.exception("preparing structured outputs failed")
            self._prepared.set_exception(exc)
            return
        queue = FairCompileQueue(
            compiler.processes, lambda: compiler.workers.ready, self._limits, compiler.timeout_s
        )
        compiler.workers.on_ready = queue.worker_ready
        self._queue = queue
        compiler.workers.start()
        all_started = compiler.workers.wait_started(STARTUP_TIMEOUT_S)
        if self._closed_meanwhile(compiler):  # stopped during the warm-up: nothing to report
            pass
        elif all_started:
            logger.info(
                "[startup] grammar compile workers ready (%.1f s in the background)",
                time.perf_counter() - started,
            )
        else:
            logger.error("the grammar compile workers did not start within %g s", STARTUP_TIMEOUT_S)
        self._prepared.set_result(compiler)

    def _warn_unconstrained(self) -> None:
        if not self._warned_unconstrained:
            self._warned_unconstrained = True
            logger.warning(
                "tool calls are served without grammar constraints: install the [grammar] "
                "extra (xgrammar: pip install '.[grammar]' in the deepinfer-server checkout) "
                "to enforce their schemas"
            )
