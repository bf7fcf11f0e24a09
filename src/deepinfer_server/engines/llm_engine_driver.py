"""LLMEngineDriver: the EngineCore of every engine with DeepInfer 0.1.0's LLMEngine contract.

Both the real DeepInfer engine and the simulated one implement that contract, so this is the
one place that calls it. It turns wire requests into `add_request` calls with a fresh
sampling-params dict, and turns the uint64 handles of `step()` / `flush_inflight_reqs()` into
one `RequestDelta` per request, reading every handle before the next `step()` (they die there).
It keeps the set of live request IDs, so outputs that arrive after an abort or after the end of
a request are discarded, and it hides tokens that are not real output: the EOS of a "stop"
finish and the repeated token of "ignored"-class finishes (abort, prompt_length_exceeded, ...).
An EOS generated under `ignore_eos` is real output that is never rendered: it is counted in
`GeneratedTokens.hidden_tokens`. Any exception from `add_request` fails that request alone (a
400 for DeepInfer's input errors, else a 500 that names the cause), never the rank. An abort
DeepInfer cannot place (a grammar still compiling: the sequence is in no queue until the
builder enqueues it, and `abort_request` returns (0, 0)) is sent again every iteration until
the engine finds the request or the request ends.
Right after `add_request` it reads the returned sequence's `num_cached_tokens` (the prompt
tokens a prefix cache reused; DeepInfer's Sequence has the attribute, 0 without a hit) and sends
it in the request's first delta, in the next iteration, whether or not that has tokens. An
engine with a prefix cache exposes `prefix_cache_stats()` -> (query tokens, hit tokens, cached
sequences); the driver passes those on. Such an engine's `add_request` also takes the request's
`cache_salt` (its prefix-cache partition) as a keyword; an engine without a prefix cache is
never given one (DeepInfer's own `add_request` has no such argument, and without a cache there
is nothing to partition).
DeepInfer's finish strings become `Finish` values here and nowhere else.
A request with a reasoning budget (`SamplingOptions.thinking_budget`) is followed while it
reasons; when the budget is spent, `</think>` is forced by ending its engine request and adding
one that continues from the prompt, the reasoning and `</think>` (`thinking_budget.py`).
Prefill/decode disaggregation: a decode request's `kv_transfer_params` go to `add_request` in
`extra`; a PROMPT engine's handoff of a finished request (`pop_kv_handoff`) rides on its
finishing delta; a failed transfer's finish string, "kv_transfer_failed:<reason>", becomes
`Finish.KV_TRANSFER_FAILED` with the reason as the delta's detail; an engine that ends requests
outside its scheduler (DeepInfer's COMPLETION engine, whose pulls fail before the sequence
exists for DeepInfer) reports them through `take_ended_requests()`. `counters()` reports the
prompt tokens the engine computed (its `prompt_tokens_computed` when it counts them, else the
prompt tokens past each request's cached ones) and a decode engine's transfer statistics.
With speculative decoding (`count_drafts`) it also counts, from each step's `draft_tok` and
`accept_tok` (drafts + 1 and accepted + 1 on a request's last entry of a step, 1 and 1 on a
step without drafts), the drafts verified and accepted, as vLLM's spec_decode counters do;
DeepInfer accepts a prefix of the drafts, so the accepted count also gives the positions.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from deepinfer_server.engines.abilities import EngineAbilities
from deepinfer_server.engines.thinking_budget import BudgetedRequest, ThinkingBudgets
from deepinfer_server.errors import ErrorKind
from deepinfer_server.ipc.codec import unpack_token_ids
from deepinfer_server.ipc.messages import (
    AddRequest,
    EngineCounters,
    Finish,
    GeneratedTokens,
    PrefixCacheStats,
    RequestDelta,
    RequestRejected,
    SamplingOptions,
)

logger = logging.getLogger(__name__)

#: DeepInfer's finish-reason strings (csrc/engine/sequence.hpp `get_finished_reason`) as the
#: server's outcomes; anything else (for example "ve_error") is an engine error.
FINISH_REASONS: dict[str, Finish] = {
    "stop": Finish.STOP,
    "length": Finish.LENGTH,
    "abort": Finish.ABORTED,
    "prompt_length_exceeded": Finish.PROMPT_TOO_LONG,
    "insufficient_system_resource": Finish.OUT_OF_RESOURCES,
    "xgrammar runtime errors or timeout": Finish.GRAMMAR_FAILED,
}


class LLMEngine(Protocol):
    """The subset of DeepInfer 0.1.0's LLMEngine that the server drives."""

    eos_id: int

    def add_request(
        self,
        user_id: str,
        request_id: str,
        sampling_params: dict[str, Any] | None,
        prompt_token_ids: npt.NDArray[np.int32],
        multi_modal_data: dict[str, Any] | None = None,
        arrival_time: float | None = None,
        extra: dict[str, Any] | None = None,
    ) -> object | None: ...

    def abort_request(self, request_id: list[str]) -> tuple[int, int]: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> npt.NDArray[np.uint64]: ...

    def flush_inflight_reqs(self) -> npt.NDArray[np.uint64]: ...

    def close(self) -> None: ...


class OutputReader(Protocol):
    """DeepInfer's RequestOutput class: static getters that take a uint64 handle."""

    @staticmethod
    def get_request_id(handle: int) -> str: ...

    @staticmethod
    def get_token_id(handle: int) -> int: ...

    @staticmethod
    def get_finish_reason(handle: int) -> str: ...

    @staticmethod
    def get_token_logprobs(handle: int) -> float: ...

    @staticmethod
    def get_top_logprobs(handle: int) -> list[float]: ...

    @staticmethod
    def get_top_token_ids(handle: int) -> list[int]: ...

    @staticmethod
    def get_prompt_logprobs(handle: int) -> list[float]: ...

    @staticmethod
    def get_draft_tok(handle: int) -> int: ...

    @staticmethod
    def get_accept_tok(handle: int) -> int: ...


#: The finish string of a failed KV transfer, before ":<reason>".
KV_TRANSFER_FAILED = "kv_transfer_failed"


def finish_of(reason: str) -> Finish:
    """The outcome of a DeepInfer finish string (unknown strings are engine errors)."""
    if reason.startswith(KV_TRANSFER_FAILED):
        return Finish.KV_TRANSFER_FAILED
    return FINISH_REASONS.get(reason, Finish.ENGINE_ERROR)


class LLMEngineDriver:
    """Drives one LLMEngine for the rank loop. Not thread-safe: the loop's thread owns it."""

    def __init__(
        self,
        engine: LLMEngine,
        reader: type[OutputReader],
        abilities: EngineAbilities | None = None,
        *,
        count_drafts: bool = False,
    ) -> None:
        self._engine = engine
        self._reader = reader
        #: What the engine has beyond `LLMEngine` (nothing, unless its builder says so).
        self._abilities = abilities if abilities is not None else EngineAbilities()
        self._connector = self._abilities.connector
        self._eos_id = int(engine.eos_id)
        #: Live requests and what per-token data each asked for.
        self._live: dict[str, SamplingOptions] = {}
        self._prompt_logprobs_sent: set[str] = set()
        #: Aborted requests the engine did not find yet (their grammar was still compiling).
        self._unplaced_aborts: set[str] = set()
        #: Requests added since the last read, with the prompt tokens the engine reused.
        self._started: dict[str, int] = {}
        self._last_stats: PrefixCacheStats | None = None
        #: Prompt tokens computed, counted here for an engine that does not count them.
        self._counts_computed = self._abilities.prompt_tokens_computed() is not None
        self._computed = 0
        self._last_counters = EngineCounters()
        self._budgets = ThinkingBudgets()
        #: Requests whose `</think>` is forced before any output (a budget of 0).
        self._forced_first: set[str] = set()
        #: Requests whose budget ran out in the last read: their continuation is added after
        #: the next step, once DeepInfer has finalized the aborted sequence (and a prefix cache
        #: has kept its prompt for the continuation to fork from).
        self._due_continuations: list[tuple[str, str, BudgetedRequest, int]] = []
        #: Speculative decoding's totals (`EngineCounters.spec_*`), read only when it is on:
        #: without drafts every step reports 1 and 1, two getter calls per token for nothing.
        self._count_drafts = count_drafts
        self._drafts = DraftCounts()

    @property
    def num_live(self) -> int:
        """Requests admitted and not yet finished or aborted."""
        return len(self._live)

    def add(self, request: AddRequest) -> RequestRejected | None:
        """Start a request; a request the engine refuses comes back as a rejection message."""
        sampling = request.sampling
        prompt = unpack_token_ids(request.prompt_token_ids)
        engine_id = request.request_id
        params = _params(sampling)
        if self._budgets.track(request, prompt):  # a budget of 0: `</think>` comes first
            tracked = self._budgets.reasoning(request.request_id)
            assert tracked is not None
            if sampling.max_tokens < 2:
                # `</think>` is the whole output: no engine request (`_emit_forced_first`).
                self._budgets.forget(request.request_id)
                self._live[request.request_id] = sampling
                self._started[request.request_id] = 0
                self._forced_first.add(request.request_id)
                return None
            else:
                engine_id, tracked = self._budgets.continue_after_budget(request.request_id)
                prompt = tracked.continuation_prompt()
                params = _params(sampling, after_reasoning=1)
                self._forced_first.add(request.request_id)
        try:
            # Text requests pass no multi_modal_data: any dict, even empty, goes to DeepInfer's
            # multimodal processor and holds the sequence back until a later step's fetch
            # (`LLMEngine.add_request` and `multi_modal_fetch` in engine/llm_engine.py).
            multi_modal_data = request.images.as_multi_modal_data() if request.images else None
            extra_args: dict[str, Any] = {}
            if request.cache_salt is not None and self._abilities.prefix_caching:
                extra_args["cache_salt"] = request.cache_salt
            if request.kv_transfer_params is not None:
                extra_args["extra"] = {"kv_transfer_params": request.kv_transfer_params}
            sequence = self._engine.add_request(
                "0",
                engine_id,
                params,
                prompt,
                multi_modal_data=multi_modal_data,
                **extra_args,
            )
        except (ValueError, TypeError) as exc:
            self._budgets.forget(request.request_id)
            self._forced_first.discard(request.request_id)
            return RequestRejected(
                request.request_id,
                ErrorKind.ENGINE_REJECTED,
                f"the engine rejected the request: {exc}",
            )
        except Exception as exc:
            # DeepInfer can raise more than input errors here (its grammar worker pool's CPU
            # binding, internal assertions): the request fails, the rank goes on serving.
            logger.exception("add_request failed for request %s", request.request_id)
            self._budgets.forget(request.request_id)
            self._forced_first.discard(request.request_id)
            return RequestRejected(
                request.request_id,
                ErrorKind.ENGINE_ERROR,
                f"the engine could not start the request: {type(exc).__name__}: {exc}",
            )
        if sequence is None:
            self._budgets.forget(request.request_id)
            self._forced_first.discard(request.request_id)
            return RequestRejected(
                request.request_id,
                ErrorKind.ENGINE_REJECTED,
                "the prompt holds token IDs outside the model's vocabulary",
            )
        self._live[request.request_id] = sampling
        cached = int(getattr(sequence, "num_cached_tokens", 0))
        self._started[request.request_id] = cached
        if not self._counts_computed and request.kv_transfer_params is None:
            self._computed += max(0, prompt.size - cached)
        return None

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests; anything the engine still emits for them is discarded."""
        live = [rid for rid in request_ids if rid in self._live]
        if not live:
            return
        for request_id in live:
            sampling = self._live.pop(request_id)
            self._prompt_logprobs_sent.discard(request_id)
            self._started.pop(request_id, None)
            if request_id in self._forced_first:
                self._forced_first.discard(request_id)
                if sampling.max_tokens < 2:  # the engine never had it
                    continue
            engine_id = self._budgets.engine_id(request_id)
            self._budgets.forget(request_id)
            due = [entry for entry in self._due_continuations if entry[0] == request_id]
            if due:  # its engine request already ended and its continuation is not added yet
                self._due_continuations.remove(due[0])
                continue
            self._abort_one(engine_id)

    def _abort_one(self, request_id: str) -> None:
        found, _ = self._engine.abort_request([request_id])
        if found:
            self._unplaced_aborts.discard(request_id)
        else:
            self._unplaced_aborts.add(request_id)

    def iterate(self) -> tuple[bool, list[RequestDelta]]:
        """One lockstep iteration: the collective work check, then step() or flush()."""
        if self._unplaced_aborts:  # rare; the loop runs every few milliseconds
            for request_id in list(self._unplaced_aborts):
                self._abort_one(request_id)
        unfinished = self._engine.has_unfinished_requests()
        due, self._due_continuations = self._due_continuations, []
        handles = self._engine.step() if unfinished else self._engine.flush_inflight_reqs()
        deltas = self._read(handles)
        if due:
            deltas.extend(self._continue_after_budgets(due))
        # A continuation just added or still to be added is work: no idle wait before the
        # next iteration.
        return unfinished or bool(due) or bool(self._due_continuations), deltas

    def kv_cache_usage(self) -> float | None:
        """Used KV blocks over allocatable ones, as DeepInfer's stats logger computes it.

        From `scheduler.get_num_free_gpu_blocks()` and `cache_config.num_gpu_blocks`; block 0
        is never allocatable. None for an engine without them.
        """
        blocks = self._abilities.kv_blocks()
        if blocks is None or blocks.total < 2:
            return None
        usable = blocks.total - 1
        return min(1.0, max(0.0, (usable - blocks.free) / usable))

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The engine's prefix-cache counters, or None when it has no prefix cache."""
        stats = self._abilities.prefix_cache_stats()
        if stats is None:
            return None
        queries, hits, sequences = stats
        last = self._last_stats
        if last is None or (last.queries, last.hits, last.sequences) != (queries, hits, sequences):
            last = self._last_stats = PrefixCacheStats(int(queries), int(hits), int(sequences))
        return last

    def counters(self) -> EngineCounters | None:
        """The engine's disaggregation counters, or None when nothing changed since the last
        call."""
        counted = self._abilities.prompt_tokens_computed()
        computed = self._computed if counted is None else counted
        stats = self._connector.transfer_stats()
        counters = EngineCounters(computed, held_kv=self._connector.held_count())
        self._drafts.fill(counters)
        if stats is not None:
            counters.kv_transfer_bytes = stats.bytes
            counters.kv_transfer_failures = dict(stats.failures)
            counters.kv_transfer_seconds, stats.seconds = stats.seconds, []
            counters.kv_transfer_wait_seconds, stats.wait_seconds = stats.wait_seconds, []
        if counters == self._last_counters:
            return None
        self._last_counters = EngineCounters(
            counters.prompt_tokens_computed,
            counters.kv_transfer_bytes,
            counters.kv_transfer_failures,
            held_kv=counters.held_kv,
        )
        self._drafts.fill(self._last_counters)
        return counters

    def close(self) -> None:
        self._engine.close()

    def _read(self, handles: npt.NDArray[np.uint64]) -> list[RequestDelta]:
        reader = self._reader
        by_request: dict[str, RequestDelta] = {}
        if self._forced_first:
            self._emit_forced_first(by_request)
        if self._count_drafts:
            self._drafts.count(reader, handles)
        for handle in handles.tolist():
            engine_id = reader.get_request_id(handle)
            request_id = self._budgets.request_of(engine_id)
            sampling = self._live.get(request_id) if request_id is not None else None
            if request_id is None or sampling is None:
                if engine_id in self._unplaced_aborts and reader.get_finish_reason(handle):
                    self._unplaced_aborts.discard(engine_id)  # it ended before it was found
                continue
            delta = by_request.get(request_id)
            if delta is None:
                delta = by_request[request_id] = RequestDelta(request_id, _empty_tokens(sampling))
            reason = reader.get_finish_reason(handle)
            finish = finish_of(reason) if reason else None
            if sampling.prompt_logprobs and request_id not in self._prompt_logprobs_sent:
                # Only the first generated token's entry carries them; the others hold [].
                prompt_logprobs = reader.get_prompt_logprobs(handle)
                if prompt_logprobs:
                    delta.tokens.prompt_logprobs = list(prompt_logprobs)
                    self._prompt_logprobs_sent.add(request_id)
            token = reader.get_token_id(handle)
            # Tokens that are not output (EOS, the repeat of an "ignored" finish) are left out
            # together with their per-token data, so that both stay aligned.
            if token == self._eos_id:
                # Under ignore_eos the engine generates EOS as an ordinary token that counts
                # toward max_tokens (no finish, or "length"): count it, never render it.
                if finish is None or finish is Finish.LENGTH:
                    delta.tokens.hidden_tokens += 1
            elif finish is None or finish.is_normal:
                delta.tokens.token_ids.append(token)
                if delta.tokens.logprobs is not None:
                    self._read_logprobs(delta.tokens, handle)
            if finish is None and (tracked := self._budgets.reasoning(request_id)) is not None:
                if token == tracked.end_id:
                    self._budgets.reasoning_ended(request_id)
                elif tracked.push(token):
                    finish = self._end_reasoning(request_id, tracked, delta)
            if finish is not None:
                delta.finish = finish
                if finish is Finish.KV_TRANSFER_FAILED:
                    delta.detail = reason.partition(":")[2] or None
                else:
                    delta.kv_transfer_params = self._connector.pop_handoff(request_id)
                del self._live[request_id]
                self._prompt_logprobs_sent.discard(request_id)
                self._budgets.forget(request_id)
        self._read_ended(by_request)
        if self._started:
            self._report_started(by_request)
        return list(by_request.values())

    def _read_ended(self, by_request: dict[str, RequestDelta]) -> None:
        """Finish the requests the engine ended outside its scheduler (a failed KV pull on a
        COMPLETION engine: DeepInfer's output pool makes no handle for those)."""
        for engine_id, reason in self._connector.take_ended():
            request_id = self._budgets.request_of(engine_id)
            sampling = self._live.pop(request_id, None) if request_id is not None else None
            if request_id is None or sampling is None:
                continue
            self._prompt_logprobs_sent.discard(request_id)
            self._budgets.forget(request_id)
            delta = by_request.get(request_id)
            if delta is None:
                delta = by_request[request_id] = RequestDelta(request_id, _empty_tokens(sampling))
            delta.finish = finish_of(reason)
            if delta.finish is Finish.KV_TRANSFER_FAILED:
                delta.detail = reason.partition(":")[2] or None

    def _report_started(self, by_request: dict[str, RequestDelta]) -> None:
        """Give every request added since the last read its first delta, with its cached
        tokens (a delta of its own when this step produced nothing for it)."""
        for request_id, cached in self._started.items():
            delta = by_request.get(request_id)
            if delta is None:
                sampling = self._live.get(request_id)
                if sampling is None:  # it ended without output: nothing more to say
                    continue
                delta = by_request[request_id] = RequestDelta(request_id, _empty_tokens(sampling))
            delta.cached_tokens = cached
        self._started.clear()

    def _emit_forced_first(self, by_request: dict[str, RequestDelta]) -> None:
        """The forced `</think>` of requests with a budget of 0, before their first output."""
        for request_id in self._forced_first:
            sampling = self._live.get(request_id)
            if sampling is not None:
                delta = by_request[request_id] = RequestDelta(request_id, _empty_tokens(sampling))
                _append_forced(delta.tokens, sampling.thinking_end_id)
                if sampling.max_tokens < 2:  # nothing left for an answer
                    delta.finish = Finish.LENGTH
                    del self._live[request_id]
        self._forced_first.clear()

    def _end_reasoning(
        self, request_id: str, tracked: BudgetedRequest, delta: RequestDelta
    ) -> Finish | None:
        """The budget is spent: force `</think>` (a token of this delta) and end the engine
        request; the one that continues after `</think>` is added after the next step. The
        request's finish when no output token is left for an answer."""
        continuation, tracked = self._budgets.continue_after_budget(request_id)
        self._abort_one(request_id)
        _append_forced(delta.tokens, tracked.end_id)
        left = tracked.request.sampling.max_tokens - len(tracked.generated) - 1
        if left < 1:
            return Finish.LENGTH
        self._due_continuations.append((request_id, continuation, tracked, left))
        return None

    def _continue_after_budgets(
        self, due: list[tuple[str, str, BudgetedRequest, int]]
    ) -> list[RequestDelta]:
        """Add the continuations of requests whose budget ran out; a finishing delta for each
        one the engine refuses."""
        failed: list[RequestDelta] = []
        for request_id, continuation, tracked, left in due:
            sampling = self._live.get(request_id)
            if sampling is None:  # aborted meanwhile
                continue
            detail = self._add_continuation(continuation, tracked, left)
            if detail is not None:
                delta = RequestDelta(request_id, _empty_tokens(sampling), Finish.ENGINE_ERROR)
                delta.detail = detail
                failed.append(delta)
                del self._live[request_id]
                self._prompt_logprobs_sent.discard(request_id)
                self._budgets.forget(request_id)
        return failed

    def _add_continuation(
        self, continuation: str, tracked: BudgetedRequest, left: int
    ) -> str | None:
        """Add the engine request that continues after a forced `</think>`; why it failed."""
        request = tracked.request
        sampling = request.sampling
        extra_args: dict[str, Any] = {}
        if request.cache_salt is not None and self._abilities.prefix_caching:
            extra_args["cache_salt"] = request.cache_salt
        prompt = tracked.continuation_prompt()
        try:
            sequence = self._engine.add_request(
                "0",
                continuation,
                _params(sampling, after_reasoning=sampling.max_tokens - left),
                prompt,
                multi_modal_data=request.images.as_multi_modal_data() if request.images else None,
                **extra_args,
            )
        except Exception as exc:
            logger.exception("continuing request %s after its reasoning budget", request.request_id)
            return f"the engine could not continue after the reasoning budget: {exc}"
        if sequence is None:
            return "the engine could not continue after the reasoning budget"
        if not self._counts_computed:
            self._computed += max(0, prompt.size - int(getattr(sequence, "num_cached_tokens", 0)))
        return None

    def _read_logprobs(self, tokens: GeneratedTokens, handle: int) -> None:
        """The logprob of the token just appended, and its alternatives if asked for."""
        reader = self._reader
        assert tokens.logprobs is not None
        tokens.logprobs.append(float(reader.get_token_logprobs(handle)))
        if tokens.top_logprobs is not None:
            ids = reader.get_top_token_ids(handle)
            values = reader.get_top_logprobs(handle)
            tokens.top_logprobs.append(list(zip(ids, values, strict=True)))


def _params(sampling: SamplingOptions, after_reasoning: int = 0) -> dict[str, Any]:
    """DeepInfer's SamplingParams of a request; `after_reasoning` > 0 for the engine request
    that continues after a forced `</think>` (that many output tokens already generated):
    the output limit left, no prompt logprobs again, and its grammar from the first token (the
    `</think>` that would trigger it is in the prompt)."""
    # A fresh dict per request: DeepInfer mutates the SamplingParams it is given.
    params: dict[str, Any] = {
        "max_tokens": sampling.max_tokens - after_reasoning,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "ignore_eos": sampling.ignore_eos,
        "seq_seed": sampling.seed,
        "top_k": sampling.top_k,
        "top_logprobs": sampling.top_logprobs,
        "prompt_logprobs": sampling.prompt_logprobs and not after_reasoning,
    }
    if sampling.structured is not None:
        so_args = sampling.structured.as_so_args()
        if after_reasoning:
            so_args.pop("trigger_token_ids", None)
        params["so_args"] = so_args
    return params


def _append_forced(tokens: GeneratedTokens, token: int) -> None:
    """A token the server forced: certain, so logprob 0 and no other alternative."""
    tokens.token_ids.append(token)
    if tokens.logprobs is not None:
        tokens.logprobs.append(0.0)
        if tokens.top_logprobs is not None:
            tokens.top_logprobs.append([(token, 0.0)])


class DraftCounts:
    """Speculative decoding's totals since the engine started."""

    def __init__(self) -> None:
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_position: list[int] = []

    def count(self, reader: type[OutputReader], handles: npt.NDArray[np.uint64]) -> None:
        """Count the drafts of one step's outputs (every handle, even of an aborted request:
        the engine verified its drafts all the same)."""
        for handle in handles.tolist():
            drafted = reader.get_draft_tok(handle) - 1
            if drafted <= 0:  # not a step's last entry (0), or a step without drafts (1)
                continue
            accepted = reader.get_accept_tok(handle) - 1
            self.drafts += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            per_position = self.accepted_per_position
            if len(per_position) < drafted:
                per_position.extend([0] * (drafted - len(per_position)))
            for position in range(accepted):
                per_position[position] += 1

    def fill(self, counters: EngineCounters) -> None:
        """Copy the totals into `counters`."""
        counters.spec_drafts = self.drafts
        counters.spec_draft_tokens = self.draft_tokens
        counters.spec_accepted_tokens = self.accepted_tokens
        counters.spec_accepted_per_position = list(self.accepted_per_position)


def _empty_tokens(sampling: SamplingOptions) -> GeneratedTokens:
    """A batch that carries the per-token data this request asked for."""
    tokens = GeneratedTokens()
    if sampling.logprobs:
        tokens.logprobs = []
        if sampling.top_logprobs:
            tokens.top_logprobs = []
    return tokens
