"""CompileWorkers: grammars are compiled in worker processes that can be killed.

xgrammar's compile cannot be interrupted, and with some grammars its time and memory grow
faster than linearly with their size (issue 24), so no grammar is compiled in a server or rank
process. A small pool of spawned worker processes, each with its own xgrammar compiler over the
vocabulary, compiles one grammar at a time under an address-space limit (`resource.setrlimit`);
a compile that outlives its deadline is killed together with its worker, which is replaced in
the background. A worker whose memory grew by more than `recycle_bytes` leaves after answering,
which gives that memory back to the system. Thread-safe; blocking (call it off event loops).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import queue
import resource
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Literal

logger = logging.getLogger(__name__)

#: How long a new worker may take to import xgrammar and build its vocabulary.
STARTUP_TIMEOUT_S = 180.0
_PR_SET_PDEATHSIG = 1

Outcome = Literal["ok", "invalid", "memory", "timeout", "died"]


#: Why a grammar that allows no text at all is invalid.
NO_TEXT = (
    "it matches no text: no token can start it (a rule that only refers to itself, "
    'as {"$ref": "#"} is)'
)


@dataclass(frozen=True)
class CompileOutcome:
    """What compiling one grammar gave: `ok` with the compiled grammar's size (and its
    serialized form when asked), or why not (`invalid` with xgrammar's message, `memory`,
    `timeout`, `died`)."""

    outcome: Outcome
    message: str = ""
    memory_bytes: int = 0
    serialized: str | None = None


@dataclass(frozen=True)
class WorkerLimits:
    """The bounds every compile runs under."""

    #: Address space a worker may take beyond what it had once ready (RLIMIT_AS).
    memory_bytes: int
    #: Growth of a worker's resident memory after which it is replaced once it has answered.
    recycle_bytes: int


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _admits_text(xgr: Any, compiled: Any) -> bool:
    """Whether the grammar allows a first token (the stop token, for an empty text). One that
    allows none, as `{"$ref": "#"}` (`root ::= root`), matches no text: an engine's sampler
    would then draw from a mask of nothing, and DeepInfer ends the request when its matcher
    rejects that token (or, in thinking mode, once the reasoning ends)."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


def _worker_main(
    connection: Connection, tokenizer_json: str, vocab_size: int | None, limits: WorkerLimits
) -> None:
    """The body of one worker process: compile what the pool sends until it closes the pipe."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle
    from deepinfer_server.grammar._xgr import Vocab, clean_error, xgrammar

    xgr = xgrammar()
    vocab = Vocab.from_tokenizer_json(tokenizer_json, vocab_size)
    compiler = xgr.GrammarCompiler(vocab.info, max_threads=1, cache_enabled=False)
    if sys.platform.startswith("linux"):
        ceiling = _status_kib("VmSize") * 1024 + limits.memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (ceiling, resource.RLIM_INFINITY))
    resident = _status_kib("VmRSS") * 1024
    connection.send(os.getpid())
    while True:
        try:
            schema_type, schema, serialize = connection.recv()
        except (EOFError, OSError):
            return
        try:
            if schema_type == "json":
                compiled = compiler.compile_json_schema(schema, strict_mode=True)
            elif schema_type == "regex":
                compiled = compiler.compile_regex(schema)
            else:
                compiled = compiler.compile_grammar(schema)
            if not _admits_text(xgr, compiled):
                outcome = CompileOutcome("invalid", NO_TEXT)
            else:
                text = compiled.serialize_json() if serialize else None
                outcome = CompileOutcome("ok", "", int(compiled.memory_size_bytes), text)
            del compiled
        except MemoryError:
            outcome = CompileOutcome("memory")
        except Exception as exc:  # xgrammar reports a failed allocation as std::bad_alloc
            memory = "bad_alloc" in str(exc)
            outcome = CompileOutcome("memory" if memory else "invalid", clean_error(exc))
        grown = _status_kib("VmRSS") * 1024 - resident
        leave = outcome.outcome == "memory" or grown > limits.recycle_bytes
        connection.send((outcome, leave))
        if leave:
            return


@dataclass
class _Worker:
    process: BaseProcess
    connection: Connection


class CompileWorkers:
    """A pool of `count` compile worker processes over one vocabulary."""

    def __init__(
        self, tokenizer_json: str, vocab_size: int | None, count: int, limits: WorkerLimits
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._limits = limits
        self._context = multiprocessing.get_context("spawn")
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._live: dict[int, _Worker] = {}
        self._closed = False
        self._starting = 0
        self._count = count
        self._started = False
        # Workers die with the thread that started them (the parent-death signal follows the
        # thread, not the process): start every one from this thread, which lives as long as
        # the pool, never from a request's short-lived worker thread.
        self._spawner = ThreadPoolExecutor(1, thread_name_prefix="grammar-spawner")
        #: How many grammars the workers compiled (for tests and logs).
        self.compiles = 0

    @property
    def pids(self) -> set[int]:
        """The process IDs of the live workers."""
        with self._lock:
            return set(self._live)

    def compile(
        self, schema_type: str, schema: str, timeout: float, serialize: bool
    ) -> CompileOutcome:
        """Compile on the next free worker: at most `timeout` seconds waiting for one (more
        while the first ever starts), then at most `timeout` seconds compiling."""
        with self._lock:
            start, self._started = not self._started, True
        for _ in range(self._count if start else 0):  # on the first compile: none may be needed
            self._start_worker()
        with self._lock:
            starting = self._starting
        # A worker that is starting (the first ones, or one replacing a killed worker) takes
        # seconds: a grammar is not refused for that.
        wait = max(timeout, STARTUP_TIMEOUT_S) if starting else timeout
        try:
            worker = self._idle.get(timeout=wait)
        except queue.Empty:
            return CompileOutcome("timeout", f"no grammar compile worker was free within {wait:g}s")
        try:
            worker.connection.send((schema_type, schema, serialize))
            if not worker.connection.poll(timeout):
                self._replace(worker, kill=True)
                return CompileOutcome("timeout")
            outcome, leave = worker.connection.recv()
        except (EOFError, OSError):
            self._replace(worker, kill=True)
            return CompileOutcome("died")
        with self._lock:
            self.compiles += 1
        if leave:
            self._replace(worker, kill=False)
        else:
            self._idle.put(worker)
        assert isinstance(outcome, CompileOutcome)
        return outcome

    def close(self) -> None:
        """Stop every worker (a compile in progress ends with its worker)."""
        with self._lock:
            self._closed = True
            workers = list(self._live.values())
        for worker in workers:
            self._stop(worker, kill=True)
        self._spawner.shutdown(wait=False)

    def _start_worker(self) -> None:
        try:
            worker = self._spawner.submit(self._spawn).result()
        except RuntimeError:
            with self._lock:
                closed = self._closed
            if closed:  # the pool was closed meanwhile (its spawner shut down): no new worker
                return
            raise
        with self._lock:
            self._starting += 1
            if worker.process.pid is not None:
                self._live[worker.process.pid] = worker
        threading.Thread(
            target=self._await_ready, args=(worker,), name="grammar-worker-start", daemon=True
        ).start()

    def _spawn(self) -> _Worker:
        """Start one worker process (on the spawner thread)."""
        parent_end, child_end = self._context.Pipe()
        process = self._context.Process(
            target=_worker_main,
            args=(child_end, self._tokenizer_json, self._vocab_size, self._limits),
            name="grammar-compile",
            daemon=True,
        )
        process.start()
        child_end.close()
        return _Worker(process, parent_end)

    def _await_ready(self, worker: _Worker) -> None:
        try:
            ready = worker.connection.poll(STARTUP_TIMEOUT_S) and worker.connection.recv()
        except (EOFError, OSError):
            ready = False
        with self._lock:
            closed = self._closed
            self._starting -= 1
        if not ready and not closed:
            logger.error(
                "a grammar compile worker failed to start (exit %s)", worker.process.exitcode
            )
        if not ready:
            self._stop(worker, kill=True)
            return
        if closed:
            self._stop(worker, kill=False)
            return
        self._idle.put(worker)

    def _replace(self, worker: _Worker, kill: bool) -> None:
        self._stop(worker, kill)
        with self._lock:
            closed = self._closed
        if not closed:
            self._start_worker()

    def _stop(self, worker: _Worker, kill: bool) -> None:
        with contextlib.suppress(OSError):
            worker.connection.close()
        if kill:
            worker.process.kill()
        deadline = time.monotonic() + 5.0
        worker.process.join(max(0.0, deadline - time.monotonic()))
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join(5.0)
        with self._lock:
            self._live.pop(worker.process.pid or -1, None)
