"""CompileWorkers: grammars are compiled in worker processes that can be killed.

xgrammar's compile cannot be interrupted, and with some grammars its time and memory grow
faster than linearly with their size, so no grammar is compiled in a server or rank
process. A small pool of worker processes, each with its own xgrammar compiler over the
vocabulary, compiles one grammar at a time under an address-space limit (`resource.setrlimit`);
a compile that outlives its deadline is killed together with its worker, which is replaced in
the background. The workers fork from a fork server that imported xgrammar and built the
vocabulary once (`fork_server`), so a start or a replacement is a fork, not seconds of loading;
what each runs is `compile_job`.
A worker whose memory grew by more than `recycle_bytes` leaves after answering, which gives
that memory back to the system. `start()` starts the workers ahead of the first compile (the
API process does at start-up), and `ready` says how many can take a compile now, which the fair
queue in front of them (`compile_queue`) reads. Thread-safe; blocking (call it off event
loops).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from deepinfer_server.grammar.compile_job import CompileOutcome, WorkerLimits, worker_main
from deepinfer_server.grammar.constraint import Constraint
from deepinfer_server.grammar.fork_server import PRELOAD, remove_shared_file, share_vocabulary

logger = logging.getLogger(__name__)

#: How long a new worker may take to import xgrammar and build its vocabulary.
STARTUP_TIMEOUT_S = 180.0


@dataclass
class _Worker:
    process: BaseProcess
    connection: Connection
    ready: bool = False


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
        self._context.set_forkserver_preload([PRELOAD])
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
        remove_shared_file()

    def _start_worker(self) -> None:
        with self._lock:
            self._starting += 1
        self._launch()

    def _launch(self) -> None:
        """Spawn one worker, already counted in `_starting`, and await its readiness."""
        try:
            worker = self._spawner.submit(self._spawn).result()
        except Exception:
            with self._lock:
                closed = self._closed
            # Closed meanwhile: its spawner shut down, or the fork server it was forking from
            # was stopped (a stop during the warm-up). No new worker, and nothing went wrong.
            if closed:
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
        share_vocabulary(self._tokenizer_json, self._vocab_size)
        parent_end, child_end = self._context.Pipe()
        process = self._context.Process(
            target=worker_main,
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
            self._stop(worker, kill=True)
            return
        remove_shared_file()  # a worker was forked: the fork server has read it
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
