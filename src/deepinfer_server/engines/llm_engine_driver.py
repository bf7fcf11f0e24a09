"""LLMEngineDriver: the EngineCore of every engine with DeepInfer 0.1.0's LLMEngine contract.

Both the real DeepInfer engine and the simulated one implement that contract
(`driver.contract`), so this is the one place that calls it. It turns wire requests into
`add_request` calls with a fresh sampling-params dict, and turns the uint64 handles of
`step()` / `flush_inflight_reqs()` into one `RequestDelta` per request, reading every handle
before the next `step()` (they die there). It keeps the set of live request IDs, so outputs
that arrive after an abort or after the end of a request are discarded, and it hides tokens
that are not real output: the EOS of a "stop" finish and the repeated token of
"ignored"-class finishes (abort, prompt_length_exceeded, ...). An EOS generated under
`ignore_eos` is real output that is never rendered: it is counted in
`GeneratedTokens.hidden_tokens`. Any exception from `add_request` fails that request alone (a
400 for DeepInfer's input errors, else a 500 that names the cause), never the rank. An abort
DeepInfer cannot place is sent again until it lands (`driver.aborts`).
Right after `add_request` it reads the returned sequence's `num_cached_tokens` (the prompt
tokens a prefix cache reused; DeepInfer's Sequence has the attribute, 0 without a hit) and sends
it in the request's first delta, in the next iteration, whether or not that has tokens.
What the engine has beyond the contract it is told by its builder (`abilities.EngineAbilities`,
never probed on the engine): an engine with a prefix cache also takes the request's
`cache_salt` (its prefix-cache partition) in `add_request`; an engine without one is never
given it (DeepInfer's own `add_request` has no such argument, and without a cache there is
nothing to partition). Its counters are read in `driver.readouts`.
Reasoning budgets (`SamplingOptions.thinking_budget`) are followed in `driver.budgets`.
Prefill/decode disaggregation: a decode request's `kv_transfer_params` go to `add_request` in
`extra`; a PROMPT engine's handoff of a finished request (its connector's `pop_handoff`) rides
on its finishing delta; a failed transfer's finish string, "kv_transfer_failed:<reason>",
becomes `Finish.KV_TRANSFER_FAILED` with the reason as the delta's detail; a role that ends
requests outside the engine's scheduler (DeepInfer's COMPLETION engine, whose pulls fail before
the sequence exists for DeepInfer) reports them through its connector's `take_ended()`.
With speculative decoding (`count_drafts`) it also counts the drafts (`driver.drafts`).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import numpy.typing as npt

from deepinfer_server.engines.abilities import EngineAbilities
from deepinfer_server.engines.driver.aborts import UnplacedAborts
from deepinfer_server.engines.driver.budgets import DueContinuation, ReasoningBudgets
from deepinfer_server.engines.driver.contract import (
    LLMEngine,
    OutputReader,
    empty_tokens,
    engine_params,
    finish_of,
    transfer_failure,
)
from deepinfer_server.engines.driver.readouts import Readouts
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
        self._eos_id = int(engine.eos_id)
        #: What the engine has beyond `LLMEngine` (nothing, unless its builder says so).
        self._abilities = abilities if abilities is not None else EngineAbilities()
        self._connector = self._abilities.connector
        #: Live requests and what per-token data each asked for.
        self._live: dict[str, SamplingOptions] = {}
        self._prompt_logprobs_sent: set[str] = set()
        self._aborts = UnplacedAborts(engine)
        #: Requests added since the last read, with the prompt tokens the engine reused and
        #: those it will write to its cache (`EngineAbilities.written_tokens`, an engine's that
        #: honours `retention_seconds`).
        self._started: dict[str, tuple[int, int]] = {}
        self._budgets = ReasoningBudgets()
        self._readouts = Readouts(self._abilities)
        #: Speculative decoding's totals are read only when it is on: without drafts every
        #: step reports 1 and 1, two getter calls per token for nothing.
        self._count_drafts = count_drafts

    @property
    def num_live(self) -> int:
        """Requests admitted and not yet finished or aborted."""
        return len(self._live)

    def add(self, request: AddRequest) -> RequestRejected | None:
        """Start a request; a request the engine refuses comes back as a rejection message."""
        request_id = request.request_id
        start = self._budgets.start(request, unpack_token_ids(request.prompt_token_ids))
        if start is None:  # `</think>` is the whole output: no engine request
            self._live[request_id] = request.sampling
            self._started[request_id] = (0, 0)
            return None
        params = engine_params(request.sampling, start.after_reasoning)
        try:
            sequence = self._add_to_engine(request, start.engine_id, start.prompt, params)
        except (ValueError, TypeError) as exc:
            self._budgets.refused(request_id)
            return RequestRejected(
                request_id, ErrorKind.ENGINE_REJECTED, f"the engine rejected the request: {exc}"
            )
        except Exception as exc:
            # DeepInfer can raise more than input errors here (its grammar worker pool's CPU
            # binding, internal assertions): the request fails, the rank goes on serving.
            logger.exception("add_request failed for request %s", request_id)
            self._budgets.refused(request_id)
            return RequestRejected(
                request_id,
                ErrorKind.ENGINE_ERROR,
                f"the engine could not start the request: {type(exc).__name__}: {exc}",
            )
        if sequence is None:
            self._budgets.refused(request_id)
            return RequestRejected(
                request_id,
                ErrorKind.ENGINE_REJECTED,
                "the prompt holds token IDs outside the model's vocabulary",
            )
        self._live[request_id] = request.sampling
        cached = int(getattr(sequence, "num_cached_tokens", 0))
        written = self._abilities.written_tokens(sequence)
        self._started[request_id] = (cached, written)
        if request.kv_transfer_params is None:
            self._readouts.prompt_added(start.prompt.size, cached)
        return None

    def _add_to_engine(
        self,
        request: AddRequest,
        engine_id: str,
        prompt: npt.NDArray[np.int32],
        params: dict[str, Any],
        handoff: bool = True,
    ) -> object | None:
        """`add_request` for one engine request of `request`: the first, with the request's
        handoff, or the continuation after a forced `</think>` (`handoff` False)."""
        extra_args: dict[str, Any] = {}
        if request.cache_salt is not None and self._abilities.prefix_caching:
            extra_args["cache_salt"] = request.cache_salt
        if request.sampling.retention_seconds and self._abilities.retention:
            extra_args["retention_seconds"] = request.sampling.retention_seconds
        if handoff and request.kv_transfer_params is not None:
            extra_args["extra"] = {"kv_transfer_params": request.kv_transfer_params}
        # Text requests pass no multi_modal_data: any dict, even empty, goes to DeepInfer's
        # multimodal processor and holds the sequence back until a later step's fetch
        # (`LLMEngine.add_request` and `multi_modal_fetch` in engine/llm_engine.py).
        return self._engine.add_request(
            "0",
            engine_id,
            params,
            prompt,
            multi_modal_data=request.images.as_multi_modal_data() if request.images else None,
            **extra_args,
        )

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests; anything the engine still emits for them is discarded."""
        for request_id in request_ids:
            sampling = self._live.pop(request_id, None)
            if sampling is None:
                continue
            self._prompt_logprobs_sent.discard(request_id)
            self._started.pop(request_id, None)
            self._budgets.abort(request_id, sampling, self._aborts)

    def iterate(self) -> tuple[bool, list[RequestDelta]]:
        """One lockstep iteration: the collective work check, then step() or flush()."""
        self._aborts.retry()
        unfinished = self._engine.has_unfinished_requests()
        due = self._budgets.take_due()
        handles = self._engine.step() if unfinished else self._engine.flush_inflight_reqs()
        deltas = self._read(handles)
        if due:
            deltas.extend(self._continue_after_budgets(due))
        # A continuation just added or still to be added is work: no idle wait before the
        # next iteration.
        return unfinished or bool(due) or bool(self._budgets.due), deltas

    def kv_cache_usage(self) -> float | None:
        """Used KV blocks over allocatable ones (`Readouts.kv_cache_usage`)."""
        return self._readouts.kv_cache_usage()

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The engine's prefix-cache counters, or None when it has no prefix cache."""
        return self._readouts.prefix_cache_stats()

    def counters(self) -> EngineCounters | None:
        """The engine's counters, or None when nothing changed since the last call."""
        return self._readouts.counters()

    def close(self) -> None:
        """Close the engine."""
        self._engine.close()

    def _read(self, handles: npt.NDArray[np.uint64]) -> list[RequestDelta]:
        by_request: dict[str, RequestDelta] = {}
        if self._budgets.forced_first:
            self._budgets.emit_forced_first(self._live, by_request)
        if self._count_drafts:
            self._readouts.drafts.count(self._reader, handles)
        for handle in handles.tolist():
            self._read_one(handle, by_request)
        self._read_ended(by_request)
        if self._started:
            self._report_started(by_request)
        return list(by_request.values())

    def _read_one(self, handle: int, by_request: dict[str, RequestDelta]) -> None:
        """One output handle into its request's delta."""
        reader = self._reader
        engine_id = reader.get_request_id(handle)
        request_id = self._budgets.request_of(engine_id)
        sampling = self._live.get(request_id) if request_id is not None else None
        if request_id is None or sampling is None:
            if engine_id in self._aborts and reader.get_finish_reason(handle):
                self._aborts.ended(engine_id)  # it ended before it was found
            return
        delta = by_request.get(request_id)
        if delta is None:
            delta = by_request[request_id] = RequestDelta(request_id, empty_tokens(sampling))
        reason = reader.get_finish_reason(handle)
        finish = finish_of(reason) if reason else None
        if sampling.prompt_logprobs and request_id not in self._prompt_logprobs_sent:
            # Only the first generated token's entry carries them; the others hold [].
            prompt_logprobs = reader.get_prompt_logprobs(handle)
            if prompt_logprobs:
                delta.tokens.prompt_logprobs = list(prompt_logprobs)
                self._prompt_logprobs_sent.add(request_id)
        token = reader.get_token_id(handle)
        self._read_token(delta, handle, token, finish)
        if finish is None and (tracked := self._budgets.reasoning(request_id)) is not None:
            if token == tracked.end_id:
                self._budgets.reasoning_ended(request_id)
            elif tracked.push(token):
                finish = self._budgets.end_reasoning(request_id, tracked, delta, self._aborts)
        if finish is not None:
            self._finish(delta, finish, reason)

    def _read_token(
        self, delta: RequestDelta, handle: int, token: int, finish: Finish | None
    ) -> None:
        """Tokens that are not output (EOS, the repeat of an "ignored" finish) are left out
        together with their per-token data, so that both stay aligned."""
        if token == self._eos_id:
            # Under ignore_eos the engine generates EOS as an ordinary token that counts
            # toward max_tokens (no finish, or "length"): count it, never render it.
            if finish is None or finish is Finish.LENGTH:
                delta.tokens.hidden_tokens += 1
        elif finish is None or finish.is_normal:
            delta.tokens.token_ids.append(token)
            if delta.tokens.logprobs is not None:
                self._read_logprobs(delta.tokens, handle)

    def _finish(self, delta: RequestDelta, finish: Finish, reason: str) -> None:
        """The request of `delta` ended with `finish` (DeepInfer's string `reason`)."""
        request_id = delta.request_id
        delta.finish = finish
        if finish is Finish.KV_TRANSFER_FAILED:
            delta.detail = transfer_failure(reason)
        else:
            delta.kv_transfer_params = self._connector.pop_handoff(request_id)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        """The request ended: nothing more is read for it."""
        del self._live[request_id]
        self._prompt_logprobs_sent.discard(request_id)
        self._budgets.forget(request_id)

    def _read_ended(self, by_request: dict[str, RequestDelta]) -> None:
        """Finish the requests the engine's role ended outside its scheduler (a failed KV
        pull on a COMPLETION engine: DeepInfer's output pool makes no handle for those)."""
        for engine_id, reason in self._connector.take_ended():
            request_id = self._budgets.request_of(engine_id)
            sampling = self._live.get(request_id) if request_id is not None else None
            if request_id is None or sampling is None:
                continue
            delta = by_request.get(request_id)
            if delta is None:
                delta = by_request[request_id] = RequestDelta(request_id, empty_tokens(sampling))
            delta.finish = finish_of(reason)
            if delta.finish is Finish.KV_TRANSFER_FAILED:
                delta.detail = transfer_failure(reason)
            self._forget(request_id)

    def _report_started(self, by_request: dict[str, RequestDelta]) -> None:
        """Give every request added since the last read its first delta, with its cached
        tokens (a delta of its own when this step produced nothing for it)."""
        for request_id, (cached, written) in self._started.items():
            delta = by_request.get(request_id)
            if delta is None:
                sampling = self._live.get(request_id)
                if sampling is None:  # it ended without output: nothing more to say
                    continue
                delta = by_request[request_id] = RequestDelta(request_id, empty_tokens(sampling))
            delta.cached_tokens = cached
            delta.written_tokens = written or None
        self._started.clear()

    def _continue_after_budgets(self, due: list[DueContinuation]) -> list[RequestDelta]:
        """Add the continuations of requests whose budget ran out; a finishing delta for each
        one the engine refuses."""
        failed: list[RequestDelta] = []
        for entry in due:
            sampling = self._live.get(entry.request_id)
            if sampling is None:  # aborted meanwhile
                continue
            detail = self._add_continuation(entry)
            if detail is not None:
                delta = RequestDelta(entry.request_id, empty_tokens(sampling), Finish.ENGINE_ERROR)
                delta.detail = detail
                failed.append(delta)
                self._forget(entry.request_id)
        return failed

    def _add_continuation(self, entry: DueContinuation) -> str | None:
        """Add the engine request that continues after a forced `</think>`; why it failed."""
        request = entry.tracked.request
        prompt = entry.tracked.continuation_prompt()
        try:
            params = engine_params(request.sampling, request.sampling.max_tokens - entry.left)
            sequence = self._add_to_engine(request, entry.engine_id, prompt, params, handoff=False)
        except Exception as exc:
            logger.exception("continuing request %s after its reasoning budget", request.request_id)
            return f"the engine could not continue after the reasoning budget: {exc}"
        if sequence is None:
            return "the engine could not continue after the reasoning budget"
        self._readouts.prompt_added(prompt.size, int(getattr(sequence, "num_cached_tokens", 0)))
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
