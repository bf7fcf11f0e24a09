"""LLMEngine: a CPU implementation of DeepInfer 0.1.0's engine contract.

What it reproduces (deepinfer-contract.md §9): the `add_request` input rules and its `None`
return for out-of-vocabulary IDs; uint64 output handles released by the next `step()`;
zero-overhead scheduling (decode tokens come back one `step()` late, first tokens at once,
`flush_inflight_reqs()` drains); several tokens per decode step (speculative decoding);
DeepInfer's finish-reason strings; running vs waiting abort semantics; `prompt_length_exceeded`
at prefill time; EOS generated as an ordinary token under `ignore_eos`; the prefill cadence
(prompts only at attempt points voted across the DP ranks, a step all prefill or all decode,
the queue served in order: `scheduler.PrefillCadence`); `has_unfinished_requests()` as an
all-reduce MAX and `step()`/`close()` as collectives across the DP ranks; single-thread
ownership; DeepInfer's structured outputs (`SOMatcherBuilder`): a request's grammar compiles
off the loop (here in a killable worker process) while the request waits outside the
scheduler, each step picks up the grammars that are ready, and a grammar that fails to
compile, times out or fails while matching ends that one request with
"xgrammar runtime errors or timeout".

Timing: every step, prompt steps included, lasts `itl_ms` while there is work (host work
overlaps the step: a step computes its outputs as of its end, then waits for that end; a slower
loop slows the steps); a request is schedulable `ttft_ms` after `add_request` (a step with only
waiting requests ends when the first is ready).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from deepinfer_server.engines.simulated.collectives import LockstepGroup
from deepinfer_server.engines.simulated.kv_blocks import AllocStatus, KVBlocks, default_pool
from deepinfer_server.engines.simulated.logprobs import annotate
from deepinfer_server.engines.simulated.outputs import POOL, OutputRecord, RequestOutput
from deepinfer_server.engines.simulated.preemption import schedule_decode
from deepinfer_server.engines.simulated.sampling_params import SamplingParams
from deepinfer_server.engines.simulated.scheduler import (
    DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL,
    DEFAULT_PREFILL_ATTEMPT_INTERVAL,
    KV_WATERMARK,
    PrefillCadence,
)
from deepinfer_server.engines.simulated.script import ScriptWriter
from deepinfer_server.engines.simulated.sequence import (
    FINISH_ABORT,
    FINISH_PROMPT_TOO_LONG,
    FINISH_SO_FAILED,
    Sequence,
)
from deepinfer_server.grammar import (
    GrammarBounds,
    GrammarCompiler,
    GrammarError,
    MatcherFailure,
    SimulatedMatcher,
    Vocab,
)
from deepinfer_server.grammar.compiler import compile_timeout_s
from deepinfer_server.model.tokens import EOS_TOKEN

logger = logging.getLogger(__name__)

#: The end of each step's wait that is spun rather than slept (`_sleep_until`).
_SPIN_SECONDS = 0.0003

__all__ = ["LLMEngine", "RequestOutput", "SamplingParams", "SimEngineArgs"]


@dataclass
class SimEngineArgs:
    """Construction arguments of the simulated engine (the subset of EngineArgs it uses)."""

    tokenizer_json: str
    lockstep: LockstepGroup
    engine_rank: int = 0
    data_parallel_size: int = 1
    max_model_len: int = 32768
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None
    ttft_ms: float = 20.0
    itl_ms: float = 10.0
    tokens_per_step: int = 1
    zero_overhead_scheduling: bool = True
    close_timeout: float = 10.0
    prefill_attempt_interval: int = DEFAULT_PREFILL_ATTEMPT_INTERVAL
    prefill_any_attempt_interval: int = DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL
    fault: str | None = None
    fault_after_steps: int = 0
    kv_blocks: int | None = None


class LLMEngine:
    """The simulated engine. Every method must be called from the thread that built it."""

    def __init__(self, args: SimEngineArgs) -> None:
        if args.fault == "startup":
            raise RuntimeError("simulated engine start-up failure (--sim-fault startup)")
        self._args = args
        self._steps = 0
        self._owner = threading.get_ident()
        self.tokenizer = Tokenizer.from_str(args.tokenizer_json)
        eos = self.tokenizer.token_to_id(EOS_TOKEN)
        self.eos_id = 1 if eos is None else int(eos)
        self._vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._script = ScriptWriter(self.tokenizer)
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []
        self._deferred: list[OutputRecord] = []
        self._pending_terminal: list[OutputRecord] = []
        self._to_release: list[npt.NDArray[np.uint64]] = []
        self._step_deadline = 0.0
        self._closed = False
        self._grammar: GrammarCompiler | None = None
        self._grammar_threads: ThreadPoolExecutor | None = None
        self._grammar_lock = threading.Lock()
        #: Requests whose grammar is compiling (DeepInfer's SOMatcherBuilder pending list).
        self._pending: list[tuple[Sequence, Future[SimulatedMatcher]]] = []
        self._cadence = PrefillCadence(
            args.lockstep,
            args.engine_rank,
            args.prefill_attempt_interval,
            args.prefill_any_attempt_interval,
        )
        # DeepInfer's default max_num_batched_tokens (config.py:219-228); without chunked
        # prefill it bounds both the prompt length and the prompt tokens of one step.
        self._batched_tokens = args.max_num_batched_tokens or max(
            args.max_model_len, 4096, args.max_num_seqs * args.tokens_per_step
        )
        self._prompt_limit = min(args.max_model_len, self._batched_tokens)
        # DeepInfer's KV read-out: `scheduler.get_num_free_gpu_blocks()`, `cache_config`.
        self._kv = KVBlocks(args.kv_blocks or default_pool(args.max_num_seqs, args.max_model_len))
        self.scheduler = self._kv
        self.cache_config = self._kv.cache_config

    @classmethod
    def from_engine_args(cls, args: SimEngineArgs) -> LLMEngine:
        return cls(args)

    # Requests

    def add_request(
        self,
        user_id: str,
        request_id: str,
        sampling_params: dict[str, Any] | SamplingParams | None,
        prompt_token_ids: npt.NDArray[np.int32],
        multi_modal_data: dict[str, Any] | None = None,
        arrival_time: float | None = None,
        extra: dict[str, Any] | None = None,
        enqueue: bool = True,
        chunk_checkpoints: list[int] | None = None,
    ) -> Sequence | None:
        """Queue a request; returns None (and never outputs) for out-of-vocabulary IDs."""
        self._check_thread()
        # The TTFT delay runs from arrival: preparing the script below overlaps it.
        arrived = time.monotonic()
        if sampling_params is None:
            sampling_params = {}
        if isinstance(sampling_params, dict):
            sampling_params = SamplingParams(
                **{k: v for k, v in sampling_params.items() if v is not None}
            )
        sampling_params.eos_id = self.eos_id
        if prompt_token_ids.size == 0:
            raise ValueError("prompt must not be empty")
        if prompt_token_ids.dtype != np.int32 or not prompt_token_ids.flags.c_contiguous:
            raise TypeError("prompt_token_ids must be a C-contiguous numpy int32 array")
        if int(prompt_token_ids.min()) < 0 or int(prompt_token_ids.max()) >= self._vocab_size:
            logger.info("request %s of user %s has invalid token ids; dropped", request_id, user_id)
            return None
        prompt = prompt_token_ids.tolist()
        sequence = Sequence(
            request_id=request_id,
            prompt=prompt,
            params=sampling_params,
            script=self._script.answer_tokens(prompt, multi_modal_data),
            ready_at=arrived + self._args.ttft_ms / 1000.0,
        )
        if sampling_params.so_args and enqueue:
            self._pending.append((sequence, self._build_matcher(sequence)))
        elif sampling_params.so_args:  # DeepInfer builds synchronously here too
            self._attach(sequence, self._build_matcher(sequence))
        elif enqueue:
            self._waiting.append(sequence)
        return sequence

    def abort_request(self, request_id: str | Iterable[str]) -> tuple[int, int]:
        """Abort requests; returns (number aborted, sum of their prompt+output lengths)."""
        self._check_thread()
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        count = 0
        total_len = 0
        pending = [s for s, _ in self._pending if s.request_id in ids]
        self._pending = [(s, f) for s, f in self._pending if s.request_id not in ids]
        for sequence in [*pending, *(s for s in self._waiting if s.request_id in ids)]:
            if sequence in self._waiting:
                self._waiting.remove(sequence)
            count += 1
            total_len += sequence.length
            self._pending_terminal.append(sequence.ignored_output(FINISH_ABORT))
        for sequence in [s for s in self._running if s.request_id in ids]:
            self._running.remove(sequence)
            self._kv.free(sequence.request_id)
            count += 1
            total_len += sequence.length
        # The in-flight (deferred) tokens of an aborted running request are dropped.
        self._deferred = [r for r in self._deferred if r.request_id not in ids]
        return count, total_len

    # The loop

    def has_unfinished_requests(self) -> bool:
        """An all-reduce MAX over the DP ranks of "this rank has waiting or running work"."""
        self._check_thread()
        local = 1 if (self._waiting or self._running or self._pending) else 0
        return bool(self._args.lockstep.all_reduce_max(self._args.engine_rank, local))

    def get_num_unfinished_requests(self) -> int:
        self._check_thread()
        return len(self._waiting) + len(self._running) + len(self._pending)

    def step(self) -> npt.NDArray[np.uint64]:
        """One engine step, collective across the DP ranks; returns one handle per token."""
        self._check_thread()
        self._inject_fault()
        started = time.monotonic()
        self._args.lockstep.barrier(self._args.engine_rank)
        for handles in self._to_release:
            POOL.release(handles)
        self._to_release.clear()
        self._pump_grammars()
        step_end = self._step_end(started)

        terminal, self._pending_terminal = self._pending_terminal, []
        prompt_outputs: list[OutputRecord] = []
        prompt_step = self._schedule_prompts(prompt_outputs, step_end)
        deferred, self._deferred = self._deferred, []
        decoded: list[OutputRecord] = []
        if not prompt_step:
            # Before the deferred outputs leave: a preempted sequence's in-flight tokens go.
            scheduled, deferred = schedule_decode(
                self._kv, self._running, self._waiting, deferred, self._args.tokens_per_step
            )
            for sequence in scheduled:
                decoded.extend(self._decode(sequence))
        returned = deferred + terminal + prompt_outputs
        if self._args.zero_overhead_scheduling:
            self._deferred = decoded
        else:
            returned.extend(decoded)
        self._cadence.advance(prompt_step)
        published = self._publish(returned)
        self._sleep_until(step_end)
        return published

    def flush_inflight_reqs(self) -> npt.NDArray[np.uint64]:
        """Return the outputs of the deferred decode step, if any (local, not collective)."""
        self._check_thread()
        returned = self._deferred + self._pending_terminal
        self._deferred = []
        self._pending_terminal = []
        if not returned:  # the idle loop flushes every few ms: publish nothing to release
            return np.empty(0, dtype=np.uint64)
        return self._publish(returned)

    def close(self) -> None:
        """A world barrier: every DP rank must close together."""
        self._check_thread()
        if self._closed:
            return
        self._args.lockstep.close_barrier(self._args.engine_rank, self._args.close_timeout)
        for handles in self._to_release:
            POOL.release(handles)
        self._to_release.clear()
        if self._grammar_threads is not None:
            self._grammar_threads.shutdown(wait=False, cancel_futures=True)
        if self._grammar is not None:
            self._grammar.close()
        self._closed = True

    # Internals

    def _build_matcher(self, sequence: Sequence) -> Future[SimulatedMatcher]:
        """Start building the sequence's matcher off the loop (compiled in a worker process)."""
        so_args = sequence.params.so_args
        assert so_args is not None
        if self._grammar_threads is None:
            self._grammar_threads = ThreadPoolExecutor(2, thread_name_prefix="grammar-build")
        return self._grammar_threads.submit(
            self._matcher_for, dict(so_args), sequence.params.max_tokens
        )

    def _matcher_for(self, so_args: dict[str, Any], max_tokens: int) -> SimulatedMatcher:
        """(On a builder thread.) DeepInfer's compile, bounded by DEEPINFER_XGRAMMAR_TIMEOUT."""
        with self._grammar_lock:
            if self._grammar is None:
                vocab = Vocab.from_tokenizer_json(self._args.tokenizer_json, self._vocab_size)
                bounds = GrammarBounds(compile_timeout_s=compile_timeout_s())
                self._grammar = GrammarCompiler(vocab, bounds=bounds, workers=1)
            grammar = self._grammar
        return SimulatedMatcher.from_so_args(so_args, grammar, max_tokens)

    def _pump_grammars(self) -> None:
        """Queue the pending requests whose matcher is built (or failed), in arrival order."""
        if not self._pending:
            return
        still: list[tuple[Sequence, Future[SimulatedMatcher]]] = []
        for sequence, future in self._pending:
            if future.done():
                self._attach(sequence, future)
                self._waiting.append(sequence)
            else:
                still.append((sequence, future))
        self._pending = still

    def _attach(self, sequence: Sequence, future: Future[SimulatedMatcher]) -> None:
        """Give the sequence its matcher; a grammar that did not compile ends the request with
        DeepInfer's structured-output failure (at its prefill)."""
        try:
            sequence.matcher = future.result()
        except GrammarError as exc:
            logger.warning("request %s: grammar failed: %s", sequence.request_id, exc.message)
            sequence.grammar_failed = True
        except Exception:
            logger.exception("request %s: building its grammar failed", sequence.request_id)
            sequence.grammar_failed = True

    def _check_thread(self) -> None:
        if threading.get_ident() != self._owner:
            raise RuntimeError("LLMEngine is not thread-safe: call it only from its owner thread")

    def _inject_fault(self) -> None:
        self._steps += 1
        if self._steps <= self._args.fault_after_steps:
            return
        if self._args.fault == "step-error":
            raise RuntimeError("simulated engine failure in step() (--sim-fault step-error)")
        if self._args.fault == "step-hang":
            logger.warning("step() hangs forever (--sim-fault step-hang)")
            threading.Event().wait()

    def _step_end(self, started: float) -> float:
        """When the step that started at `started` ends (`time.monotonic()`)."""
        itl = self._args.itl_ms / 1000.0
        # The step ends one period after the previous one did; after an idle gap (or a loop
        # slower than the period) the cadence restarts from now.
        deadline = self._step_deadline + itl
        if deadline < started:
            deadline = started + itl
        if not self._running and self._waiting:
            first_ready = min(s.ready_at for s in self._waiting)
            deadline = min(deadline, max(started, first_ready))
        return deadline

    def _sleep_until(self, deadline: float) -> None:
        # A GPU step ends on time; an OS timer wakes a sleeper 0.1-0.2 ms late (timer slack,
        # virtual CPUs), which would show as latency the server adds. Sleep most of the wait,
        # then spin the last moment.
        remaining = deadline - time.monotonic()
        if remaining > _SPIN_SECONDS:
            time.sleep(remaining - _SPIN_SECONDS)
        while time.monotonic() < deadline:
            pass
        itl = self._args.itl_ms / 1000.0
        self._step_deadline = max(deadline, time.monotonic() - itl) if itl else deadline

    def _kv_usage(self) -> float:
        """Fraction of usable KV blocks in use (block 0 is never usable, as in DeepInfer)."""
        usable = self.cache_config.num_gpu_blocks - 1
        return (usable - self._kv.get_num_free_gpu_blocks()) / max(1, usable)

    def _schedule_prompts(self, returned: list[OutputRecord], now: float) -> bool:
        """DeepInfer's prefill cadence (scheduler.PrefillCadence): True for a prompt step,
        whose outputs (first tokens, ignored requests) are appended to `returned`; `now` is
        the step's end, as of which requests are ready."""
        head_ready = bool(self._waiting) and self._waiting[0].ready_at <= now
        want = self._kv_usage() <= KV_WATERMARK and head_ready
        if not self._cadence.vote(want):
            return False
        outputs = self._prefill(now) if want else []
        if not self._cadence.anyone_scheduled(bool(outputs)):
            return False
        returned.extend(outputs)  # empty: this rank pads the group's prompt step
        return True

    def _prefill(self, now: float) -> list[OutputRecord]:
        """Schedule the queue's head in order (scheduler.hpp:351-554, chunked prefill off): stop
        at the first request that is not ready or does not fit (no skipping ahead)."""
        outputs: list[OutputRecord] = []
        tokens = 0
        while self._waiting:
            sequence = self._waiting[0]
            if sequence.ready_at > now:
                break
            # A preempted sequence is recomputed: prompt and output so far are prefilled again.
            allocation = self._kv.can_prefill(sequence.length + 1)
            too_long = len(sequence.prompt) > self._prompt_limit
            if too_long or sequence.length > self._args.max_model_len:
                too_long = True
            if too_long or allocation is AllocStatus.NEVER:
                self._waiting.pop(0)
                outputs.append(sequence.ignored_output(FINISH_PROMPT_TOO_LONG))
                continue
            if sequence.grammar_failed:
                self._waiting.pop(0)
                outputs.append(sequence.ignored_output(FINISH_SO_FAILED))
                continue
            if allocation is AllocStatus.LATER or len(self._running) >= self._args.max_num_seqs:
                break
            if tokens and tokens + sequence.length > self._batched_tokens:
                break  # the next prompt step takes it (alone, if it must)
            tokens += sequence.length
            self._waiting.pop(0)
            self._kv.allocate(sequence.request_id, sequence.length + 1)
            self._running.append(sequence)
            outputs.extend(self._decode(sequence, budget=1))
        return outputs

    def _decode(self, sequence: Sequence, budget: int | None = None) -> list[OutputRecord]:
        """Generate up to `budget` tokens (tokens_per_step by default), stopping per token."""
        count = self._args.tokens_per_step if budget is None else budget
        records: list[OutputRecord] = []
        for _ in range(count):
            try:
                token = self._next_token(sequence)
            except MatcherFailure as exc:
                # DeepInfer's update_so_status: a matcher failure ends this request only.
                logger.warning("request %s: %s", sequence.request_id, exc)
                records.append(self._end_with_grammar_failure(sequence))
                break
            sequence.output.append(token)
            reason = sequence.stop_reason(token, self.eos_id, self._args.max_model_len)
            record = OutputRecord(
                request_id=sequence.request_id,
                prompt_len=len(sequence.prompt),
                token_id=token,
                finish_reason=reason,
                finished=bool(reason),
                num_output_tokens=len(sequence.output),
                max_num_batched_tokens=self._args.max_num_batched_tokens or 0,
            )
            annotate(record, sequence.prompt, sequence.params, self._vocab_size)
            records.append(record)
            if reason:
                sequence.finish_reason = reason
                self._running.remove(sequence)
                self._kv.free(sequence.request_id)
                break
        # draft_tok/accept_tok are set only on the last entry of a request in a step.
        records[-1].draft_tok = records[-1].accept_tok = len(records)
        return records

    def _end_with_grammar_failure(self, sequence: Sequence) -> OutputRecord:
        sequence.finish_reason = FINISH_SO_FAILED
        self._running.remove(sequence)
        self._kv.free(sequence.request_id)
        return sequence.ignored_output(FINISH_SO_FAILED)

    def _next_token(self, sequence: Sequence) -> int:
        token = sequence.scripted_token(self.eos_id)
        if sequence.matcher is not None:
            # The grammar decides: the scripted token when it is allowed, else the matcher's
            # deterministic choice that completes the value within max_tokens.
            token = sequence.matcher.choose(token)
        return token

    def _publish(self, records: list[OutputRecord]) -> npt.NDArray[np.uint64]:
        handles = POOL.publish(records)
        self._to_release.append(handles)
        return handles
