"""Compile and validate so_args in the API process, with the engine's xgrammar version.

Bounded input size, bounded compile time (DeepInfer's DEEPINFER_XGRAMMAR_TIMEOUT, default 20 s)
and a bounded LRU cache of compiled grammars keyed by (schema_type, schema). xgrammar's own cache
is off here; the engine's is bounded through `engine_env_defaults()` (CVE-2025-32381: xgrammar's
cache grows without limit unless given one; DeepInfer's default limit is 10 GiB).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from deepinfer_server.grammar._xgr import Vocab, clean_error, xgrammar
from deepinfer_server.grammar.constraint import Constraint
from deepinfer_server.grammar.errors import GrammarError
from deepinfer_server.grammar.so_args import SCHEMA_TYPES, build_so_args

TIMEOUT_ENV = "DEEPINFER_XGRAMMAR_TIMEOUT"
CACHE_LIMIT_ENV = "DEEPINFER_XGRAMMAR_CACHE_LIMIT_BYTES"
DEEPINFER_DEFAULT_TIMEOUT_S = 20
DEEPINFER_DEFAULT_CACHE_LIMIT_BYTES = 10 * 1024**3
ENGINE_CACHE_LIMIT_BYTES = 512 * 1024**2
DEFAULT_MAX_SCHEMA_BYTES = 256 * 1024
DEFAULT_CACHE_BYTES = 256 * 1024**2
DEFAULT_CACHE_ENTRIES = 512


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
    """Per-process compiler: `so_args_for(constraint)` -> validated so_args; `compile()` ->
    an xgrammar CompiledGrammar (cached). Thread-safe."""

    def __init__(
        self,
        vocab: Vocab,
        *,
        max_schema_bytes: int = DEFAULT_MAX_SCHEMA_BYTES,
        timeout_s: float | None = None,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
        threads: int = 2,
    ) -> None:
        xgr = xgrammar()
        self.vocab = vocab
        self.max_schema_bytes = max_schema_bytes
        self.timeout_s = compile_timeout_s() if timeout_s is None else timeout_s
        self._cache_bytes = cache_bytes
        self._cache_entries = cache_entries
        self._inner = xgr.GrammarCompiler(vocab.info, max_threads=threads, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()

    def so_args_for(self, constraint: Constraint) -> dict[str, Any]:
        """Build the so_args for a request's constraint and compile them once (400 if bad)."""
        so_args = build_so_args(constraint, self.vocab)
        self.compile(so_args, constraint.param)
        return so_args

    def compile(self, so_args: Mapping[str, Any], param: str = "response_format") -> Any:
        """The CompiledGrammar for so_args, as DeepInfer would compile it; GrammarError if the
        schema is too large, invalid, or takes longer than the timeout."""
        check_so_args(so_args, param)
        key = (str(so_args["schema_type"]), str(so_args["schema"]))
        size = len(key[1].encode())
        if size > self.max_schema_bytes:
            raise GrammarError(
                f"the {key[0]} grammar is {size} bytes; the limit is {self.max_schema_bytes}", param
            )
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit[0]
        future = self._pool.submit(self._compile, key[0], key[1])
        try:
            compiled = future.result(timeout=self.timeout_s)
        except FutureTimeout as exc:
            future.cancel()
            raise GrammarError(
                f"compiling the {key[0]} grammar took longer than {self.timeout_s:g} s", param
            ) from exc
        except GrammarError:
            raise
        except Exception as exc:
            raise GrammarError(f"invalid {key[0]} grammar: {clean_error(exc)}", param) from exc
        self._store(key, compiled)
        return compiled

    def cache_info(self) -> tuple[int, int]:
        """(entries, estimated bytes) held by the cache."""
        with self._lock:
            return len(self._cache), self._used

    def close(self) -> None:
        """Drop the cache and stop the compile threads."""
        with self._lock:
            self._cache.clear()
            self._used = 0
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, schema_type: str, schema: str) -> Any:
        if schema_type == "json":
            return self._inner.compile_json_schema(schema, strict_mode=True)
        if schema_type == "regex":
            return self._inner.compile_regex(schema)
        return self._inner.compile_grammar(schema)

    def _store(self, key: tuple[str, str], compiled: Any) -> None:
        size = int(compiled.memory_size_bytes) + len(key[1])
        if size > self._cache_bytes:
            return
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = (compiled, size)
            self._used += size
            while self._used > self._cache_bytes or len(self._cache) > self._cache_entries:
                _, (_, dropped) = self._cache.popitem(last=False)
                self._used -= dropped
