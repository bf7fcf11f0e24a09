"""Validate and compile so_args with the engine's xgrammar version, within bounds.

Every compile runs in a worker process (`compile_workers`) under the grammar bounds: the
grammar's size, the compile time (half of DeepInfer's DEEPINFER_XGRAMMAR_TIMEOUT, so that a
grammar that passes here compiles in time in the engine too), the compile's memory (an
address-space limit per worker) and the compiled grammar's size (so that the engine's cache,
bounded through `engine_env_defaults()`, holds several; CVE-2025-32381: xgrammar's cache grows
without limit unless given one, and DeepInfer's default limit is 10 GiB). `so_args_for()` (the API
process) has a worker build a request's so_args from its constraint and compile them, and keeps
the so_args of the constraints that passed; `check()` keeps only digests of the grammars that
passed; `compile()` (the simulated engine) keeps the compiled grammars in an LRU bounded in bytes
by their own size estimate. Building so_args needs xgrammar too (a JSON schema becomes grammar
text for some), so the API process never imports it: the workers' fork server does.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deepinfer_server.grammar._xgr import Vocab, VocabSource, xgrammar
from deepinfer_server.grammar.compile_job import CompileOutcome, WorkerLimits
from deepinfer_server.grammar.compile_workers import CompileWorkers
from deepinfer_server.grammar.constraint import Constraint
from deepinfer_server.grammar.errors import CompileRefused, GrammarError
from deepinfer_server.grammar.so_args import SoArgs, check_size, check_so_args, own_schema_type

TIMEOUT_ENV = "DEEPINFER_XGRAMMAR_TIMEOUT"
CACHE_LIMIT_ENV = "DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES"
DEEPINFER_DEFAULT_TIMEOUT_S = 20
ENGINE_CACHE_LIMIT_BYTES = 512 * 1024**2


@dataclass(frozen=True)
class GrammarBounds:
    """What a grammar may cost; the docs (API, structured output: "Limits on grammars") state the
    defaults and what they mean."""

    #: The grammar text (schema, regex or EBNF) in UTF-8 bytes.
    max_grammar_bytes: int = 64 * 1024
    #: Compile time; None: half of DEEPINFER_XGRAMMAR_TIMEOUT.
    compile_timeout_s: float | None = None
    #: Memory one compile may take (the worker's address space beyond its start).
    compile_memory_bytes: int = 1024**3
    #: xgrammar's size estimate of the compiled grammar.
    max_compiled_bytes: int = 64 * 1024**2
    #: A worker whose resident memory grew by this much is replaced after answering.
    recycle_bytes: int = 256 * 1024**2


def engine_env_defaults() -> dict[str, str]:
    """Environment the server should set (setdefault) for the DeepInfer engine process."""
    return {CACHE_LIMIT_ENV: str(ENGINE_CACHE_LIMIT_BYTES)}


def compile_timeout_s() -> float:
    """DEEPINFER_XGRAMMAR_TIMEOUT as DeepInfer reads it (integer seconds, default 20)."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        return float(int(raw)) if raw else float(DEEPINFER_DEFAULT_TIMEOUT_S)
    except ValueError:
        return float(DEEPINFER_DEFAULT_TIMEOUT_S)


class GrammarCompiler:
    """Per-process compiler: `so_args_for(constraint)` -> validated so_args; `check()` and
    `compile()` (an xgrammar CompiledGrammar) for so_args. Thread-safe; blocking.

    Over a `VocabSource` (the API process) it never loads xgrammar itself: the workers build
    and check each constraint's so_args (`so_args_for`). Over a `Vocab` (a rank, a test) it also
    compiles for a matcher (`compile`)."""

    def __init__(
        self,
        vocab: Vocab | VocabSource,
        *,
        bounds: GrammarBounds | None = None,
        cache_bytes: int = 256 * 1024**2,
        cache_entries: int = 512,
        workers: int = 2,
        spare_workers: int = 0,
    ) -> None:
        self._vocab = vocab if isinstance(vocab, Vocab) else None
        self._source = vocab.source if isinstance(vocab, Vocab) else vocab
        self.bounds = bounds or GrammarBounds()
        timeout = self.bounds.compile_timeout_s
        self.timeout_s = compile_timeout_s() / 2 if timeout is None else timeout
        self._cache_bytes = cache_bytes
        self._cache_entries = cache_entries
        limits = WorkerLimits(self.bounds.compile_memory_bytes, self.bounds.recycle_bytes)
        #: Worker processes in all: the compiles that may run at once. The fair queue gives a
        #: key already compiling all but the last free one (`compile_queue`), so `workers` is
        #: what one key runs at once with `spare_workers` 1; a spare takes another key's
        #: compile meanwhile, and stands in for a worker killed at the time bound.
        count = workers + spare_workers
        self.processes = count
        source = self._source
        self._workers = CompileWorkers(source.tokenizer_json, source.vocab_size, count, limits)
        self._checked: OrderedDict[bytes, None] = OrderedDict()
        #: The so_args of constraints that passed, by the constraint's digest.
        self._built: OrderedDict[bytes, SoArgs] = OrderedDict()
        self._compiled: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    @property
    def vocab(self) -> Vocab:
        """The vocabulary as xgrammar sees it (built, with xgrammar, on first use)."""
        if self._vocab is None:
            self._vocab = self._source.build()
        return self._vocab

    @property
    def workers(self) -> CompileWorkers:
        """The compile worker processes."""
        return self._workers

    def so_args_for(self, constraint: Constraint) -> SoArgs:
        """The so_args for a request's constraint, built and compiled once within the bounds
        by a worker (GrammarError, a 400, if they do not compile); cached by the constraint."""
        key = _constraint_key(constraint)
        known = self._known_constraint(key)
        if known is not None:
            return known
        self.precheck(constraint)
        param = constraint.param
        outcome = self._workers.build(constraint, self.bounds.max_grammar_bytes, self.timeout_s)
        if outcome.outcome == "rejected":  # as building them raised it, naming its field
            raise GrammarError(outcome.message, outcome.param or param)
        if outcome.outcome == "error":  # the server's fault, not the request's: a 500
            raise RuntimeError(f"building so_args failed in a compile worker:\n{outcome.message}")
        so_args = outcome.so_args
        # A build that gave no so_args back (killed, out of memory) names what they would be.
        schema_type = str(so_args["schema_type"]) if so_args else own_schema_type(constraint)
        self._judge(outcome, schema_type or "ebnf", param)
        assert so_args is not None
        with self._lock:
            self._built[key] = so_args
            while len(self._built) > self._cache_entries:
                self._built.popitem(last=False)
        return so_args.copy()

    def precheck(self, constraint: Constraint) -> None:
        """What can be refused without a worker: an answer format whose grammar is the
        request's own text, over the size bound (GrammarError)."""
        schema_type = own_schema_type(constraint)
        if schema_type is not None:
            limit = self.bounds.max_grammar_bytes
            check_size(schema_type, constraint.spec, limit, constraint.param)

    def known_so_args(self, constraint: Constraint) -> SoArgs | None:
        """The so_args of a constraint that passed `so_args_for()` before, or None."""
        return self._known_constraint(_constraint_key(constraint))

    def check(self, so_args: Mapping[str, Any], param: str = "response_format") -> None:
        """Raise GrammarError unless so_args compile, as DeepInfer would, within the bounds."""
        schema_type, schema, key = self._key(so_args, param)
        with self._lock:
            if key in self._checked:
                self._checked.move_to_end(key)
                return
        self._run(schema_type, schema, param, serialize=False)
        with self._lock:
            self._checked[key] = None
            while len(self._checked) > self._cache_entries:
                self._checked.popitem(last=False)

    def compile(self, so_args: Mapping[str, Any], param: str = "response_format") -> Any:
        """The CompiledGrammar for so_args (cached); GrammarError as `check()`."""
        schema_type, schema, key = self._key(so_args, param)
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit[0]
        outcome = self._run(schema_type, schema, param, serialize=True)
        assert outcome.serialized is not None
        xgr = xgrammar()
        compiled = xgr.CompiledGrammar.deserialize_json(outcome.serialized, self.vocab.info)
        self._store(key, compiled, outcome.memory_bytes)
        return compiled

    def cache_info(self) -> tuple[int, int]:
        """(compiled grammars held, their estimated bytes)."""
        with self._lock:
            return len(self._compiled), self._used

    def close(self) -> None:
        """Drop the caches and stop the compile workers."""
        with self._lock:
            self._compiled.clear()
            self._checked.clear()
            self._built.clear()
            self._used = 0
        self._workers.close()

    def _known_constraint(self, key: bytes) -> SoArgs | None:
        with self._lock:
            so_args = self._built.get(key)
            if so_args is None:
                return None
            self._built.move_to_end(key)
            return so_args.copy()

    def _key(self, so_args: Mapping[str, Any], param: str) -> tuple[str, str, bytes]:
        check_so_args(so_args, param)
        schema_type, schema = str(so_args["schema_type"]), str(so_args["schema"])
        check_size(schema_type, schema, self.bounds.max_grammar_bytes, param)
        digest = hashlib.sha256(f"{schema_type}\0{schema}".encode()).digest()
        return schema_type, schema, digest

    def _run(self, schema_type: str, schema: str, param: str, serialize: bool) -> CompileOutcome:
        outcome = self._workers.compile(schema_type, schema, self.timeout_s, serialize)
        self._judge(outcome, schema_type, param)
        return outcome

    def _judge(self, outcome: CompileOutcome, schema_type: str, param: str) -> None:
        """Raise what a failed compile (or one over the compiled-size bound) means."""
        if outcome.outcome == "ok":
            limit = self.bounds.max_compiled_bytes
            if outcome.memory_bytes > limit:
                raise GrammarError(
                    f"the {schema_type} grammar compiles to {outcome.memory_bytes} bytes; "
                    f"the limit is {limit}",
                    param,
                )
            return
        if outcome.outcome == "invalid":
            raise GrammarError(f"invalid {schema_type} grammar: {outcome.message}", param)
        if outcome.outcome == "memory":
            raise GrammarError(
                f"compiling the {schema_type} grammar needs more than "
                f"{self.bounds.compile_memory_bytes // 1024**2} MiB",
                param,
            )
        if outcome.outcome == "busy":
            raise CompileRefused(f"{outcome.message}; retry later", max(1, round(self.timeout_s)))
        if outcome.outcome == "timeout":
            raise GrammarError(
                f"compiling the {schema_type} grammar took longer than {self.timeout_s:g} s",
                param,
            )
        reason = outcome.message or "its compile worker died"
        raise GrammarError(f"the {schema_type} grammar could not be compiled: {reason}", param)

    def _store(self, key: bytes, compiled: Any, size: int) -> None:
        if size > self._cache_bytes:
            return
        with self._lock:
            if key in self._compiled:
                return
            self._compiled[key] = (compiled, size)
            self._used += size
            while self._used > self._cache_bytes or len(self._compiled) > self._cache_entries:
                _, (_, dropped) = self._compiled.popitem(last=False)
                self._used -= dropped


def _constraint_key(constraint: Constraint) -> bytes:
    """A digest of everything the constraint holds (frozen dataclasses of text, numbers and
    tuples: their repr is canonical)."""
    return hashlib.sha256(repr(constraint).encode()).digest()
