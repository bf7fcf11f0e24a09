"""Validate and compile so_args with the engine's xgrammar version, within bounds.

Every compile runs in a worker process (`compile_workers`) under the grammar bounds: the
grammar's size, the compile time (half of DeepInfer's DEEPINFER_XGRAMMAR_TIMEOUT, so that a
grammar that passes here compiles in time in the engine too), the compile's memory (an
address-space limit per worker) and the compiled grammar's size (so that the engine's cache,
bounded through `engine_env_defaults()`, holds several; CVE-2025-32381: xgrammar's cache grows
without limit unless given one, and DeepInfer's default limit is 10 GiB). `check()` (the API
process) keeps only digests of the grammars that passed; `compile()` (the simulated engine)
keeps the compiled grammars in an LRU bounded in bytes by their own size estimate.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deepinfer_server.grammar._xgr import Vocab, xgrammar
from deepinfer_server.grammar.compile_workers import CompileOutcome, CompileWorkers, WorkerLimits
from deepinfer_server.grammar.constraint import Constraint
from deepinfer_server.grammar.errors import CompileRefused, GrammarError
from deepinfer_server.grammar.so_args import SCHEMA_TYPES, build_so_args

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


def check_so_args(so_args: Mapping[str, Any], param: str) -> None:
    """The checks DeepInfer makes (synchronously or as a failed request), as a GrammarError."""
    if "serialized" in so_args or "bound_token_ids" in so_args:
        raise GrammarError("so_args may not hold 'serialized' or 'bound_token_ids'", param)
    if so_args.get("schema_type") not in SCHEMA_TYPES:
        raise GrammarError(f"schema_type must be one of {SCHEMA_TYPES}", param)
    if not isinstance(so_args.get("schema"), str):
        raise GrammarError("so_args needs a string 'schema'", param)
    trigger = so_args.get("trigger_token_ids") or []
    if not isinstance(trigger, list) or any(type(t) is not int or t < 0 for t in trigger):
        raise GrammarError("trigger_token_ids must be a list of non-negative integers", param)
    bound = so_args.get("bound_token_id")
    if bound is not None and (type(bound) is not int or bound < 0 or not trigger):
        raise GrammarError("bound_token_id must be a non-negative integer with a trigger", param)


class GrammarCompiler:
    """Per-process compiler: `so_args_for(constraint)` -> validated so_args; `check()` and
    `compile()` (an xgrammar CompiledGrammar) for so_args. Thread-safe; blocking."""

    def __init__(
        self,
        vocab: Vocab,
        *,
        bounds: GrammarBounds | None = None,
        cache_bytes: int = 256 * 1024**2,
        cache_entries: int = 512,
        workers: int = 2,
        spare_workers: int = 0,
    ) -> None:
        self._xgr = xgrammar()
        self.vocab = vocab
        self.bounds = bounds or GrammarBounds()
        timeout = self.bounds.compile_timeout_s
        self.timeout_s = compile_timeout_s() / 2 if timeout is None else timeout
        self._cache_bytes = cache_bytes
        self._cache_entries = cache_entries
        limits = WorkerLimits(self.bounds.compile_memory_bytes, self.bounds.recycle_bytes)
        #: Compiles at once; `spare_workers` more processes stand by, so that a worker killed
        #: at the time bound is replaced at once while its successor starts.
        self.slots = workers
        count = workers + spare_workers
        self._workers = CompileWorkers(vocab.tokenizer_json, vocab.requested_size, count, limits)
        self._checked: OrderedDict[bytes, None] = OrderedDict()
        self._compiled: OrderedDict[bytes, tuple[Any, int]] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    @property
    def workers(self) -> CompileWorkers:
        """The compile worker processes."""
        return self._workers

    def so_args_for(self, constraint: Constraint) -> dict[str, Any]:
        """Build the so_args for a request's constraint and check that they compile within
        the bounds (GrammarError, a 400, if not)."""
        so_args = build_so_args(constraint, self.vocab)
        self.check(so_args, constraint.param)
        return so_args

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

    def known(self, so_args: Mapping[str, Any], param: str = "response_format") -> bool:
        """Whether so_args passed `check()` before (GrammarError if they are out of bounds
        without compiling)."""
        _, _, key = self._key(so_args, param)
        with self._lock:
            return key in self._checked

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
        compiled = self._xgr.CompiledGrammar.deserialize_json(outcome.serialized, self.vocab.info)
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
            self._used = 0
        self._workers.close()

    def _key(self, so_args: Mapping[str, Any], param: str) -> tuple[str, str, bytes]:
        check_so_args(so_args, param)
        schema_type, schema = str(so_args["schema_type"]), str(so_args["schema"])
        size = len(schema.encode())
        limit = self.bounds.max_grammar_bytes
        if size > limit:
            raise GrammarError(
                f"the {schema_type} grammar is {size} bytes; the limit is {limit}", param
            )
        digest = hashlib.sha256(f"{schema_type}\0{schema}".encode()).digest()
        return schema_type, schema, digest

    def _run(self, schema_type: str, schema: str, param: str, serialize: bool) -> CompileOutcome:
        outcome = self._workers.compile(schema_type, schema, self.timeout_s, serialize)
        if outcome.outcome == "ok":
            limit = self.bounds.max_compiled_bytes
            if outcome.memory_bytes > limit:
                raise GrammarError(
                    f"the {schema_type} grammar compiles to {outcome.memory_bytes} bytes; "
                    f"the limit is {limit}",
                    param,
                )
            return outcome
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
