"""CompileWorkers: grammars are compiled in worker processes that can be killed.

xgrammar's compile cannot be interrupted, and with some grammars its time and memory grow
faster than linearly with their size, so no grammar is compiled in a server or rank
process. A small pool of worker processes, each with its own xgrammar compiler over the
vocabulary, compiles one grammar at a time under an address-space limit (`resource.setrlimit`);
a compile that outlives its deadline is killed together with its worker, which is replaced in
the background. The workers fork from a fork server that imported xgrammar and built the
vocabulary once (`_xgr_preload`), so a start or a replacement is a fork, not seconds of loading.
A worker whose memory grew by more than `recycle_bytes` leaves after answering, which gives
that memory back to the system. `start()` starts the workers ahead of the first compile (the
API process does at start-up), and `ready` says how many can take a compile now, which the fair
queue in front of them (`compile_queue`) reads. Thread-safe; blocking (call it off event
loops).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import logging
import multiprocessing
import os
import queue
import resource
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Literal

from deepinfer_server.grammar._xgr import clean_error
from deepinfer_server.grammar.constraint import Constraint
from deepinfer_server.grammar.errors import GrammarError
from deepinfer_server.grammar.so_args import SoArgs, build_so_args, check_size, check_so_args

logger = logging.getLogger(__name__)

#: How long a new worker may take to import xgrammar and build its vocabulary.
STARTUP_TIMEOUT_S = 180.0
_PR_SET_PDEATHSIG = 1
#: What the workers' fork server imports before forking them (xgrammar, PyTorch with it).
_PRELOAD = "deepinfer_server.grammar._xgr_preload"
#: "<tokenizer JSON file>:<vocab size or empty>", which the fork server's preload reads.
VOCAB_ENV = "DEEPINFER_GRAMMAR_WORKER_VOCAB"


_vocabulary_shared = False
_share_lock = threading.Lock()
#: The file the fork server reads at its start, removed once it forked a worker (it has read it).
_shared_file: str | None = None


def _share_vocabulary(tokenizer_json: str, vocab_size: int | None) -> None:
    """Have the fork server build the workers' vocabulary once (`_xgr_preload`), if it has not
    started yet: the tokenizer goes into a file it reads."""
    global _vocabulary_shared, _shared_file
    with _share_lock:
        if _vocabulary_shared:  # by an earlier pool of this process: its fork server runs
            return
        _vocabulary_shared = True
    handle, path = tempfile.mkstemp(prefix="deepinfer-grammar-vocab-", suffix=".json")
    with os.fdopen(handle, "w", encoding="utf-8") as file:
        file.write(tokenizer_json)
    os.environ[VOCAB_ENV] = f"{path}:{'' if vocab_size is None else vocab_size}"
    _shared_file = path
    atexit.register(_remove_shared_file)  # in case no worker is ever forked


def _remove_shared_file() -> None:
    global _shared_file
    with _share_lock:
        path, _shared_file = _shared_file, None
    if path is not None:
        with contextlib.suppress(OSError):
            os.remove(path)


Outcome = Literal["ok", "invalid", "rejected", "error", "memory", "timeout", "died", "busy"]


#: Why a grammar that allows no text at all is invalid.
NO_TEXT = (
    "it matches no text: no token can start it (a rule that only refers to itself, "
    'as {"$ref": "#"} is)'
)


@dataclass(frozen=True)
class CompileOutcome:
    """What compiling one grammar gave: `ok` with the compiled grammar's size (and its
    serialized form when asked), or why not (`invalid` with xgrammar's message, `memory`,
    `timeout`, `died`; `busy`: no worker was free in time, which is not the grammar's fault).
    For a constraint (`CompileWorkers.build`), the so_args built from it, or `rejected` with
    the message and field of the GrammarError that building them raised (`error`: building
    them failed otherwise, the server's fault: the message is the traceback)."""

    outcome: Outcome
    message: str = ""
    memory_bytes: int = 0
    serialized: str | None = None
    so_args: SoArgs | None = None
    param: str | None = None


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
    from deepinfer_server.grammar._xgr import Vocab, xgrammar

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
            job = connection.recv()
        except (EOFError, OSError):
            return
        if job[0] == "constraint":
            _, constraint, max_bytes = job
            outcome = _build(xgr, compiler, vocab, constraint, max_bytes)
        else:
            _, schema_type, schema, serialize = job
            outcome = _compile(xgr, compiler, schema_type, schema, serialize)
        grown = _status_kib("VmRSS") * 1024 - resident
        leave = outcome.outcome == "memory" or grown > limits.recycle_bytes
        connection.send((outcome, leave))
        if leave:
            return


def _compile(
    xgr: Any, compiler: Any, schema_type: str, schema: str, serialize: bool
) -> CompileOutcome:
    """(In a worker.) Compile one grammar: its CompileOutcome."""
    try:
        if schema_type == "json":
            compiled = compiler.compile_json_schema(schema, strict_mode=True)
        elif schema_type == "regex":
            compiled = compiler.compile_regex(schema)
        else:
            compiled = compiler.compile_grammar(schema)
        if not _admits_text(xgr, compiled):
            return CompileOutcome("invalid", NO_TEXT)
        text = compiled.serialize_json() if serialize else None
        return CompileOutcome("ok", "", int(compiled.memory_size_bytes), text)
    except Exception as exc:
        if _out_of_memory(exc):
            return CompileOutcome("memory")
        return CompileOutcome("invalid", clean_error(exc))


def _out_of_memory(exc: BaseException | None) -> bool:
    """Whether `exc` is an allocation that failed (xgrammar reports it as std::bad_alloc)."""
    return isinstance(exc, MemoryError) or (exc is not None and "bad_alloc" in str(exc))


def _build(
    xgr: Any, compiler: Any, vocab: Any, constraint: Constraint, max_bytes: int
) -> CompileOutcome:
    """(In a worker.) Build a constraint's so_args (a JSON schema becomes grammar text for
    some: xgrammar's work, with its time and memory, as a compile's), check them as DeepInfer
    would and within `max_bytes`, and compile them: the CompileOutcome, with the so_args."""
    try:
        so_args = build_so_args(constraint, vocab)
        check_so_args(so_args, constraint.param)
        check_size(str(so_args["schema_type"]), so_args["schema"], max_bytes, constraint.param)
    except GrammarError as exc:
        if _out_of_memory(exc.__cause__):  # xgrammar's schema conversion hit the bound
            return CompileOutcome("memory")
        return CompileOutcome("rejected", exc.message, param=exc.param)
    except Exception as exc:
        if _out_of_memory(exc):
            return CompileOutcome("memory")
        return CompileOutcome("error", "".join(traceback.format_exception(exc)))
    outcome = _compile(xgr, compiler, so_args["schema_type"], so_args["schema"], False)
    return dataclasses.replace(outcome, so_args=so_args)


@dataclass
class _Worker:
    process: BaseProcess
    connection: Connection
    ready: bool = False


def start_fork_server(tokenizer_json: str, vocab_size: int | None) -> None:
    """Start the workers' fork server now (it imports xgrammar and builds the vocabulary), so
    that it loads while this process builds its own vocabulary."""
    _share_vocabulary(tokenizer_json, vocab_size)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([_PRELOAD])
    from multiprocessing import forkserver

    forkserver.ensure_running()


class CompileWorkers:
    """A pool of `count` compile worker processes over one vocabulary."""

    def __init__(
        self, tokenizer_json: str, vocab_size: int | None, count: int, limits: WorkerLimits
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._limits = limits
        # Workers fork from a server process that imported xgrammar (and PyTorch) and built
        # the vocabulary once: a worker's start, or a killed worker's replacement, is a fork.
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload([_PRELOAD])
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._live: dict[int, _Worker] = {}
        self._closed = False
        self._starting = 0
        self._count = count
        self._started = False
        #: Workers ready (idle or compiling), and those of the first start still to come.
        self._ready = 0
        self._first_pending = count
        self._first_done = threading.Event()
        #: Called (on a pool thread) whenever a worker becomes ready.
        self.on_ready: Callable[[], None] | None = None
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

    @property
    def ready(self) -> int:
        """How many workers can compile now or once their compile ends (started and alive)."""
        with self._lock:
            return self._ready

    def start(self) -> None:
        """Start every worker now, without waiting for them (`wait_started` does)."""
        with self._lock:
            if self._started:
                return
            self._started = True
            self._starting += self._count
        for _ in range(self._count):
            self._launch()

    def wait_started(self, timeout: float) -> bool:
        """Block until each worker of the first start is ready or failed; False on timeout."""
        return self._first_done.wait(timeout)

    def compile(
        self, schema_type: str, schema: str, timeout: float, serialize: bool
    ) -> CompileOutcome:
        """Compile on the next free worker: at most `timeout` seconds waiting for one (more
        while one starts: `busy` past it), then at most `timeout` seconds compiling."""
        return self._run(("so_args", schema_type, schema, serialize), timeout)

    def build(self, constraint: Constraint, max_bytes: int, timeout: float) -> CompileOutcome:
        """Build a constraint's so_args and compile them on the next free worker, within the
        same bounds as `compile` (the grammar text within `max_bytes`)."""
        return self._run(("constraint", constraint, max_bytes), timeout)

    def _run(self, job: tuple[Any, ...], timeout: float) -> CompileOutcome:
        self.start()  # a no-op once started
        with self._lock:
            starting = self._starting
        # A worker that is starting (the first ones, or one replacing a killed worker) takes
        # seconds: a grammar is not refused for that.
        wait = max(timeout, STARTUP_TIMEOUT_S) if starting else timeout
        try:
            worker = self._idle.get(timeout=wait)
        except queue.Empty:
            return CompileOutcome("busy", f"no grammar compile worker was free within {wait:g} s")
        try:
            worker.connection.send(job)
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
        _remove_shared_file()

    def _start_worker(self) -> None:
        with self._lock:
            self._starting += 1
        self._launch()

    def _launch(self) -> None:
        """Spawn one worker, already counted in `_starting`, and await its readiness."""
        try:
            worker = self._spawner.submit(self._spawn).result()
        except RuntimeError:
            with self._lock:
                closed = self._closed
            if closed:  # the pool was closed meanwhile (its spawner shut down): no new worker
                self._started_one(ready=False)
                return
            raise
        with self._lock:
            if worker.process.pid is not None:
                self._live[worker.process.pid] = worker
        threading.Thread(
            target=self._await_ready, args=(worker,), name="grammar-worker-start", daemon=True
        ).start()

    def _spawn(self) -> _Worker:
        """Start one worker process (on the spawner thread)."""
        _share_vocabulary(self._tokenizer_json, self._vocab_size)
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
        if not ready and not closed:
            logger.error(
                "a grammar compile worker failed to start (exit %s)", worker.process.exitcode
            )
        if not ready or closed:
            self._started_one(ready=False)
            self._stop(worker, kill=not ready)
            return
        _remove_shared_file()  # a worker was forked: the fork server has read it
        worker.ready = True
        self._idle.put(worker)
        self._started_one(ready=True)

    def _started_one(self, ready: bool) -> None:
        """A worker's start ended (`ready` or not): count it and tell the queue."""
        with self._lock:
            self._starting -= 1
            self._ready += ready
            if self._first_pending:
                self._first_pending -= 1
                if not self._first_pending:
                    self._first_done.set()
            on_ready = self.on_ready
        if ready and on_ready is not None:
            on_ready()

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
            if worker.ready:
                worker.ready = False
                self._ready -= 1
