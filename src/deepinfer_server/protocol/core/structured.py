"""Structured outputs and forced tool calls: request options → the engine's grammar (so_args).

Reading what a request asks (`Constraint`) is cheap and done while preparing it. Compiling is
not (xgrammar; from milliseconds to seconds): `StructuredOutputs.compile` awaits it in the fair
queue in front of the compile workers (`grammar.compile_queue`), with the same compiler and
version the engine uses, so a bad schema, regex or grammar is a 400 naming the field before the
engine sees the request; a key over its queued compiles is a 429 and a server out of compile
capacity a 503, both with Retry-After. The vocabulary and the workers are prepared in the
background (`start`, once the server listens: `/health` does not wait for them); a structured
request that arrives first waits for them, then takes its turn in the queue as any other.
xgrammar is the optional [grammar] extra: without it an answer format or a forced tool call in
thinking mode is a 400 that says so, while `strict` tools and forced tool calls outside thinking
mode are served as deepseek-recipe renders them, unconstrained (logged once).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

from deepinfer_server.errors import (
    BadRequestError,
    ErrorKind,
    GrammarCapacityError,
    OverloadedError,
)
from deepinfer_server.grammar import (
    Constraint,
    GrammarCompiler,
    GrammarError,
    GrammarUnavailable,
    VocabSource,
    chat_constraint,
    messages_constraint,
    responses_constraint,
)
from deepinfer_server.grammar.compile_queue import FairCompileQueue, QueueLimits, QueueStats
from deepinfer_server.grammar.compile_workers import STARTUP_TIMEOUT_S
from deepinfer_server.grammar.errors import CompileRefused
from deepinfer_server.grammar.fork_server import start_fork_server, stop_fork_server
from deepinfer_server.ipc.messages import StructuredOutput
from deepinfer_server.protocol.core.field_errors import (
    BodyShape,
    is_shape_refusal,
    name_refused_field,
)
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.recipe import recipe_errors

T = TypeVar("T")

logger = logging.getLogger(__name__)

#: How each protocol's body names its structured-output options.
ConstraintReader = Callable[[Mapping[str, Any]], Constraint | None]
CHAT_CONSTRAINT: ConstraintReader = chat_constraint
RESPONSES_CONSTRAINT: ConstraintReader = responses_constraint
MESSAGES_CONSTRAINT: ConstraintReader = messages_constraint

_FORCED_TOOL_CHOICES = ("required", "named")


def _without_strict(tools: Any) -> Any:
    """The tools with their `strict` flags removed (the grammar enforces their schemas)."""
    if not isinstance(tools, list):
        return tools
    relaxed = []
    for tool in tools:
        if isinstance(tool, dict):
            tool = {k: v for k, v in tool.items() if k != "strict"}
            function = tool.get("function")
            if isinstance(function, dict):
                tool["function"] = {k: v for k, v in function.items() if k != "strict"}
        relaxed.append(tool)
    return relaxed


#: `json_object` as the JSON schema it stands for, in the grammar and in the prompt alike.
_ANY_OBJECT_SCHEMA = {"type": "object"}


def _json_object_as_schema(body: JsonObject, where: str) -> JsonObject:
    """`json_object` without the word "json" in the messages: OpenAI's rule, which the recipe
    keeps and vLLM and Ollama do not (the AI SDK's `createOpenAICompatible` sends exactly this
    for `generateObject`). The grammar enforces JSON anyway: the request is converted with the
    equivalent schema, which the prompt states as the recipe states json_object's."""
    global _warned_json_object
    log = logger.debug if _warned_json_object else logger.warning
    _warned_json_object = True
    log(
        "%s json_object without the word 'json' in the messages (OpenAI refuses it): accepted, "
        "the grammar enforces JSON (logged once at warning level)",
        where,
    )
    if where == "response_format":
        schema = {"name": "json_object", "schema": _ANY_OBJECT_SCHEMA}
        return {**body, "response_format": {"type": "json_schema", "json_schema": schema}}
    given = body.get("text")
    text: JsonObject = given if isinstance(given, dict) else {}
    as_schema = {"type": "json_schema", "name": "json_object", "schema": _ANY_OBJECT_SCHEMA}
    return {**body, "text": {**text, "format": as_schema}}


_warned_json_object = False

#: What deepseek-recipe refuses that the grammar honours, and how to convert the request instead:
#: a forced tool_choice in thinking mode (DeepSeek's hosted API refuses it too) is converted as
#: `auto` and the grammar forces the call after `</think>`; strict tools with an answer format
#: are converted without `strict` and one grammar allows a valid call or valid JSON; json_object
#: without the word "json" is converted as the schema `{"type": "object"}` (the grammar reads
#: json_object from the body as given, the same schema).
_RELAXATIONS: dict[str, Callable[[JsonObject, object], JsonObject]] = {
    "to use 'response_format' of type 'json_object'": lambda body, auto: _json_object_as_schema(
        body, "response_format"
    ),
    "to use 'text.format' of type 'json_object'": lambda body, auto: _json_object_as_schema(
        body, "text.format"
    ),
    "Thinking mode does not support this tool_choice": lambda body, auto: {
        **body,
        "tool_choice": auto,
    },
    "response_format should not be used with tools": lambda body, auto: {
        **body,
        "tools": _without_strict(body.get("tools")),
    },
}


_INVALID_SCHEMA = "Invalid json schema"


def convert_honouring_tool_choice(
    convert: Callable[[JsonObject], T],
    body: JsonObject,
    auto_choice: object,
    format_param: str,
    *,
    shape: BodyShape,
) -> T:
    """Convert a request with the recipe, relaxing what the recipe refuses but the grammar
    (read from the original body) enforces; `auto_choice` is the protocol's `auto` tool_choice
    and `format_param` the field that holds its answer format (named when the recipe rejects a
    schema without saying where); `shape` finds the field of a refusal of the body's shape
    (`field_errors`)."""
    relaxed = body
    for _ in range(len(_RELAXATIONS) + 1):
        try:
            with recipe_errors():
                return convert(relaxed)
        except BadRequestError as exc:
            if exc.message.startswith(_INVALID_SCHEMA) and exc.param is None:
                exc.param = format_param
                raise
            if is_shape_refusal(exc):
                raise name_refused_field(exc, relaxed, shape) from exc
            relax = next((f for m, f in _RELAXATIONS.items() if m in exc.message), None)
            if relax is None:
                raise
            relaxed = relax(relaxed, auto_choice)
    with recipe_errors():
        return convert(relaxed)


class _GrammarErrors:
    """GrammarError → 400 naming the field; a missing xgrammar → 400 saying how to install it;
    a compile refused for want of capacity → 429 (the key's own backlog) or 503, Retry-After.

    A class rather than a generator-based context manager: every request enters it, and this
    costs a fifth as much."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, trace: object) -> None:
        if isinstance(exc, CompileRefused):
            if exc.per_key:
                raise OverloadedError(exc.message, retry_after_seconds=exc.retry_after) from exc
            raise GrammarCapacityError(exc.message, retry_after_seconds=exc.retry_after) from exc
        if isinstance(exc, GrammarUnavailable):
            raise BadRequestError(exc.message, param=exc.param, kind=ErrorKind.UNSUPPORTED) from exc
        if isinstance(exc, GrammarError):
            raise BadRequestError(exc.message, param=exc.param) from exc


_GRAMMAR_ERRORS = _GrammarErrors()


def grammar_errors() -> _GrammarErrors:
    """A context that turns the grammar layer's errors into the server's ApiErrors."""
    return _GRAMMAR_ERRORS


def read_constraint(reader: ConstraintReader, body: Mapping[str, Any]) -> Constraint | None:
    """What the request asks to constrain (no compilation); 400 for malformed options.

    Read before the recipe converts the request, so that malformed options are a 400 naming
    their field rather than the recipe's unnamed one; the thinking mode is not known yet
    (`in_thinking_mode` sets it once the recipe has converted the request).
    """
    with grammar_errors():
        return reader(body)


def is_forced_tool_call(constraint: Constraint | None) -> bool:
    """True when the whole answer must be a tool call (tool_choice required or named)."""
    return (
        constraint is not None
        and constraint.tools is not None
        and constraint.tools.mode in _FORCED_TOOL_CHOICES
    )


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
