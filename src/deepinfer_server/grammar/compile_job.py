"""What a compile worker process runs: `worker_main` compiles what its pool sends, one grammar
at a time, under an address-space limit, and says when it should be replaced; `CompileOutcome`
is what each compile gave.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import resource
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Literal

from deepinfer_server.grammar._xgr import clean_error
from deepinfer_server.grammar.constraint import Constraint
from deepinfer_server.grammar.errors import GrammarError
from deepinfer_server.grammar.so_args import SoArgs, build_so_args, check_size, check_so_args

_PR_SET_PDEATHSIG = 1

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


def worker_main(
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
