"""LLMEngine: a CPU implementation of DeepInfer 0.1.0's engine contract.

What it reproduces of `deepinfer/engine/llm_engine.py`: the `add_request` input rules and its `None`
return for out-of-vocabulary IDs; uint64 output handles released by the next `step()`;
zero-overhead scheduling (decode tokens come back one `step()` late, first tokens at once,
`flush_inflight_reqs()` drains); several tokens per decode step (speculative decoding);
DeepInfer's finish-reason strings; running vs waiting abort semantics; `prompt_length_exceeded`
at prefill time; EOS generated as an ordinary token under `ignore_eos`; the prefill cadence
(`prompt_scheduler.PromptScheduler`); `has_unfinished_requests()` as an all-reduce MAX (whose
rendezvous also carries the step's prefill votes) and `step()`/`close()` as collectives across
the DP ranks; single-thread ownership; DeepInfer's
structured outputs (`matcher_builds.MatcherBuilds`).

This module is the contract's face and the order of one step; the parts live beside it: the
queues (`request_table`), prompt steps (`prompt_scheduler`), decode preemption (`preemption`),
the tokens (`token_generator`), grammar builds (`matcher_builds`), the prefix cache and state
slots (`prefix_cache`, `state_slots`; DeepInfer's with the server's `--enable-prefix-caching`)
and the timing (`step_clock`: every step lasts `itl_ms` while there is work, a prompt step at
least its computed tokens over `prefill_tokens_per_s`; a request is schedulable `ttft_ms`
after `add_request`, or, while requests run, after the start of the step it can first join).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.disaggregation.transfer.agent import TransferAgent
from deepinfer_server.disaggregation.transfer.stats import TransferStats
from deepinfer_server.engines.simulated.collectives import Ballot, LockstepGroup, Tally
from deepinfer_server.engines.simulated.disaggregation import DecodeRole, PrefillRole
from deepinfer_server.engines.simulated.kv_blocks import KVBlocks, default_pool
from deepinfer_server.engines.simulated.matcher_builds import MatcherBuilds
from deepinfer_server.engines.simulated.outputs import POOL, OutputRecord, RequestOutput
from deepinfer_server.engines.simulated.preemption import schedule_decode
from deepinfer_server.engines.simulated.prefix_cache import PrefixCache
from deepinfer_server.engines.simulated.prompt_scheduler import PromptScheduler
from deepinfer_server.engines.simulated.request_table import RequestTable
from deepinfer_server.engines.simulated.sampling_params import SamplingParams
from deepinfer_server.engines.simulated.scheduler import (
    DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL,
    DEFAULT_PREFILL_ATTEMPT_INTERVAL,
    PrefillCadence,
)
from deepinfer_server.engines.simulated.script import ScriptWriter
from deepinfer_server.engines.simulated.sequence import FINISH_ABORT, Sequence
from deepinfer_server.engines.simulated.state_slots import StateSlots
from deepinfer_server.engines.simulated.step_clock import StepClock
from deepinfer_server.engines.simulated.token_generator import TokenGenerator
from deepinfer_server.model.tokens import EOS_TOKEN

logger = logging.getLogger(__name__)

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
    #: MTP draft tokens verified per sequence per decode step (0: no speculation).
    speculative_tokens: int = 0
    zero_overhead_scheduling: bool = True
    close_timeout: float = 10.0
    prefill_attempt_interval: int = DEFAULT_PREFILL_ATTEMPT_INTERVAL
    prefill_any_attempt_interval: int = DEFAULT_PREFILL_ANY_ATTEMPT_INTERVAL
    fault: str | None = None
    fault_after_steps: int = 0
    kv_blocks: int | None = None
    #: Keep finished prompts' KV and state and fork new prompts from them (DeepInfer's cache).
    enable_prefix_caching: bool = False
    #: Prompt tokens a prompt step computes per second; 0: a prompt step lasts one period.
    prefill_tokens_per_s: float = 0.0
    #: NULL (NORMAL), PREFILL (PROMPT) or DECODE (COMPLETION): `disaggregation.py`.
    disaggregation_mode: DisaggregationRole = DisaggregationRole.NULL
    disaggregation_bootstrap_port: int = 8998
    disaggregation_ib_device: str | None = None
    disaggregation_host: str = "127.0.0.1"
    disaggregation_kv_hold_timeout: float = 60.0
    disaggregation_transfer_timeout: float = 30.0


class LLMEngine:
    """The simulated engine. Every method must be called from the thread that built it."""

    def __init__(self, args: SimEngineArgs) -> None:
        if args.fault == "startup":
            raise RuntimeError("simulated engine start-up failure (--sim-fault startup)")
        self._args = args
        #: The tokens a decode step takes per sequence (KV room, batch size): its own token
        #: and the drafts it verifies (DeepInfer's max_num_seqs * (1 + nextn)).
        self._step_tokens = max(args.tokens_per_step, 1 + args.speculative_tokens)
        self._steps = 0
        self._owner = threading.get_ident()
        self.tokenizer = Tokenizer.from_str(args.tokenizer_json)
        eos = self.tokenizer.token_to_id(EOS_TOKEN)
        self.eos_id = 1 if eos is None else int(eos)
        self._vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._script = ScriptWriter(self.tokenizer)
        self._deferred: list[OutputRecord] = []
        self._pending_terminal: list[OutputRecord] = []
        self._to_release: list[npt.NDArray[np.uint64]] = []
        self._clock = StepClock(args.itl_ms)
        self._closed = False
        self._builds = MatcherBuilds(args.tokenizer_json, self._vocab_size)
        # DeepInfer's KV read-out: `scheduler.get_num_free_gpu_blocks()`, `cache_config`.
        self._kv = KVBlocks(args.kv_blocks or default_pool(args.max_num_seqs, args.max_model_len))
        self.scheduler = self._kv
        self.cache_config = self._kv.cache_config
        # DeepInfer's default max_num_batched_tokens (config.py:219-228); without chunked
        # prefill it bounds both the prompt length and the prompt tokens of one step.
        batched_tokens = args.max_num_batched_tokens or max(
            args.max_model_len, 4096, args.max_num_seqs * self._step_tokens
        )
        prompt_limit = min(args.max_model_len, batched_tokens)
        self._cache = PrefixCache(
            self._kv,
            StateSlots.for_running(args.max_num_seqs),
            enabled=args.enable_prefix_caching,
            max_num_seqs=args.max_num_seqs,
            batched_tokens=batched_tokens,
            prompt_limit=prompt_limit,
        )
        if args.enable_prefix_caching:
            # What the engine driver reads (absent without a cache, as on DeepInfer).
            self.prefix_cache_stats = self._cache.stats
        self._table = RequestTable(self._kv, self._cache)
        self._generator = TokenGenerator(
            self._table,
            self.eos_id,
            self._vocab_size,
            args.max_model_len,
            args.tokens_per_step,
            args.max_num_batched_tokens or 0,
            args.speculative_tokens,
        )
        cadence = PrefillCadence(args.prefill_attempt_interval, args.prefill_any_attempt_interval)
        self._prefill: PrefillRole | None = None
        self._decode: DecodeRole | None = None
        #: Prompt tokens this engine's prompt steps computed (a fork's reused ones excluded).
        self.prompt_tokens_computed = 0
        if args.disaggregation_mode.disaggregated:
            self._start_role(args)
        self._prompts = PromptScheduler(
            self._table,
            self._generator,
            cadence,
            args.max_model_len,
            args.max_num_seqs,
            batched_tokens,
            prompt_limit,
            args.data_parallel_size,
            engine_type=args.disaggregation_mode,
        )
        #: The next step's prefill votes as the last work check cast them: this rank's ballot
        #: and the group's tally (both None off the attempt points).
        self._votes: tuple[Ballot | None, Tally | None] | None = None

    def _start_role(self, args: SimEngineArgs) -> None:
        """A PROMPT or COMPLETION engine: its transfer agent and its role's state."""
        agent = TransferAgent(args.disaggregation_host, args.disaggregation_ib_device)
        if args.disaggregation_mode is DisaggregationRole.PREFILL:
            self._prefill = PrefillRole(
                self._kv,
                self._cache.slots,
                agent,
                args.disaggregation_bootstrap_port,
                args.engine_rank,
                args.disaggregation_kv_hold_timeout,
            )
            self._table.on_finish = self._prefill.hold
        else:
            self._decode = DecodeRole(
                self._table,
                self._generator,
                agent,
                args.max_num_seqs,
                args.disaggregation_transfer_timeout,
            )

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
        *,
        cache_salt: bytes | None = None,
    ) -> Sequence | None:
        """Queue a request; returns None (and never outputs) for out-of-vocabulary IDs.

        `cache_salt` (the server's, not DeepInfer's): the prefix-cache partition it forks from
        and is kept in."""
        self._check_thread()
        self._votes = None
        # The TTFT delay runs from arrival: preparing the script below overlaps it. While
        # requests run, the engine takes a new one between two steps, in the host work that
        # overlaps the next step: it arrived when that step began, so DeepInfer's next step()
        # can prefill it, as it does a request added before an idle engine's step().
        arrived = time.monotonic()
        if self._table.running:
            arrived = self._clock.period_start(arrived)
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
        handoff = (extra or {}).get("kv_transfer_params")
        if self._decode is not None and handoff is None:
            raise ValueError(
                "a COMPLETION engine cannot prefill: the request needs the kv_transfer_params "
                "of a prefill server's answer"
            )
        if self._prefill is not None:
            # A PROMPT engine only prefills: its answer is the prompt step's token.
            sampling_params.max_tokens = 1
        prompt = prompt_token_ids.tolist()
        sequence = Sequence(
            request_id=request_id,
            prompt=prompt,
            params=sampling_params,
            script=self._script.answer_tokens(prompt, multi_modal_data),
            ready_at=arrived + self._args.ttft_ms / 1000.0,
            cache_salt=cache_salt,
        )
        if self._decode is not None:
            if sampling_params.so_args:
                self._builds.build_now(sequence)
            if not isinstance(handoff, KVTransferParams):
                handoff = msgspec.convert(handoff, KVTransferParams)
            self._decode.add(sequence, handoff)
            return sequence
        cacheable = (
            multi_modal_data is None and not sampling_params.prompt_logprobs and enqueue
        ) and not sampling_params.so_args
        forked = self._cache.add(sequence, prompt_token_ids, cacheable)
        if sampling_params.so_args and enqueue:
            self._builds.submit(sequence)
        elif sampling_params.so_args:  # DeepInfer builds synchronously here too
            self._builds.build_now(sequence)
        elif forked:  # DeepInfer's fork_seq queues a fork first
            self._table.waiting.insert(0, sequence)
        elif enqueue:
            self._table.waiting.append(sequence)
        return sequence

    def abort_request(self, request_id: str | Iterable[str]) -> tuple[int, int]:
        """Abort requests; returns (number aborted, sum of their prompt+output lengths)."""
        self._check_thread()
        self._votes = None
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        pending = self._builds.abort(ids)
        waited, ran = self._table.abort(ids)
        if self._decode is not None:
            waited.extend(self._decode.abort(ids))
        for sequence in [*pending, *waited]:
            self._pending_terminal.append(sequence.ignored_output(FINISH_ABORT))
        aborted = [*pending, *waited, *ran]
        # The in-flight (deferred) tokens of an aborted running request are dropped.
        self._deferred = [r for r in self._deferred if r.request_id not in ids]
        return len(aborted), sum(sequence.length for sequence in aborted)

    # The loop

    def has_unfinished_requests(self) -> bool:
        """An all-reduce MAX over the DP ranks of "this rank has waiting or running work".

        The same rendezvous carries the next step's prefill votes at an attempt point: nothing
        this thread does between here and `step()` changes what a rank votes.
        """
        self._check_thread()
        ballot = self._plan_step()
        decoding = self._decode is not None and self._decode.busy
        local = bool(self._table or self._builds or decoding)
        agreed = self._args.lockstep.work_check(self._args.engine_rank, local, ballot)
        self._votes = (ballot, agreed.tally)
        return agreed.unfinished

    def get_num_unfinished_requests(self) -> int:
        self._check_thread()
        pulling = len(self._decode) if self._decode is not None else 0
        return len(self._table) + len(self._builds) + pulling

    def step(self) -> npt.NDArray[np.uint64]:
        """One engine step, collective across the DP ranks; returns one handle per token."""
        self._check_thread()
        self._inject_fault()
        started = time.monotonic()
        votes, self._votes = self._votes, None
        if votes is None:  # no work check since the queues last changed: plan and vote here
            ballot = self._plan_step()
            rank = self._args.engine_rank
            votes = (
                ballot,
                None if ballot is None else self._args.lockstep.prefill_vote(rank, ballot),
            )
        self._args.lockstep.enter_step(self._args.engine_rank)
        for handles in self._to_release:
            POOL.release(handles)
        self._to_release.clear()
        table = self._table
        first_ready = None
        if not table.running and table.waiting:
            first_ready = min(s.ready_at for s in table.waiting)
        step_end = self._clock.step_end(started, first_ready)
        terminal, self._pending_terminal = self._pending_terminal, []
        if self._prefill is not None:
            self._prefill.collect()
        if self._decode is not None:
            # Pulled prompts enter with their first token; failed transfers end here.
            terminal.extend(self._decode.step())
        prompt_outputs: list[OutputRecord] = []
        prompt_step = self._prompts.schedule(prompt_outputs, step_end, *votes)
        self.prompt_tokens_computed += self._prompts.computed_tokens
        rate = self._args.prefill_tokens_per_s
        if prompt_step and rate > 0:
            # Across DP ranks the next rendezvous makes the slowest prompt step the group's.
            step_end = max(step_end, started + self._prompts.computed_tokens / rate)
        deferred, self._deferred = self._deferred, []
        decoded: list[OutputRecord] = []
        if not prompt_step:
            # Before the deferred outputs leave: a preempted sequence's in-flight tokens go.
            scheduled, deferred = schedule_decode(
                table, deferred, self._step_tokens, stop_preempted=self._decode is not None
            )
            for sequence in scheduled:
                decoded.extend(self._generator.generate(sequence))
        returned = deferred + terminal + prompt_outputs
        if self._args.zero_overhead_scheduling:
            self._deferred = decoded
        else:
            returned.extend(decoded)
        self._prompts.cadence.advance(prompt_step)
        published = self._publish(returned)
        self._clock.sleep_until(step_end)
        return published

    def flush_inflight_reqs(self) -> npt.NDArray[np.uint64]:
        """Return the outputs of the deferred decode step, if any (local, not collective)."""
        self._check_thread()
        if self._prefill is not None:
            self._prefill.collect()
        self._votes = None
        returned = self._deferred + self._pending_terminal
        self._deferred = []
        self._pending_terminal = []
        if not returned:  # the idle loop flushes every few ms: publish nothing to release
            return np.empty(0, dtype=np.uint64)
        return self._publish(returned)

    def prepare_structured_outputs(self) -> None:
        """Build the grammar compiler and start its worker, off the loop, as DeepInfer's
        SOMatcherBuilder builds its compiler with the engine; a rank calls it once it reported
        ready, so that it does not slow the server's start (an engine built in a test compiles
        on first use)."""
        self._builds.prepare()

    def close(self) -> None:
        """A world barrier: every DP rank must close together."""
        self._check_thread()
        if self._closed:
            return
        self._args.lockstep.close_barrier(self._args.engine_rank, self._args.close_timeout)
        for handles in self._to_release:
            POOL.release(handles)
        self._to_release.clear()
        self._builds.close()
        if self._prefill is not None:
            self._prefill.close()
        if self._decode is not None:
            self._decode.close()
        self._closed = True

    # Prefill/decode disaggregation (read by the engine driver)

    def pop_kv_handoff(self, request_id: str) -> KVTransferParams | None:
        """A PROMPT engine's handoff of a request that ended (None: none, or not PROMPT)."""
        if self._prefill is None:
            return None
        return self._prefill.handoffs.pop(request_id, None)

    def kv_transfer_stats(self) -> TransferStats | None:
        """A COMPLETION engine's transfer counters (None for the other roles)."""
        return None if self._decode is None else self._decode.stats

    def held_kv(self) -> int:
        """Prompts a PROMPT engine holds for decode servers now."""
        return 0 if self._prefill is None else len(self._prefill.held)

    # Internals

    def _plan_step(self) -> Ballot | None:
        """Make the queue what the next step will find (finished grammar builds joined, the
        prefix cache's evictions for waiting prompts done); at an attempt point, return this
        rank's prefill votes as of the step's end were it to start now."""
        table = self._table
        table.waiting.extend(self._builds.pump())
        self._cache.evict_for_demand(table.waiting, len(table.running))
        # Only a NORMAL engine votes: a PROMPT one always prefills, a COMPLETION one never.
        if self._args.disaggregation_mode.disaggregated:
            return None
        if not self._prompts.cadence.at_attempt_point():
            return None
        first_ready = None
        if not table.running and table.waiting:
            first_ready = min(s.ready_at for s in table.waiting)
        return self._prompts.ballot(self._clock.step_end(time.monotonic(), first_ready))

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

    def _publish(self, records: list[OutputRecord]) -> npt.NDArray[np.uint64]:
        handles = POOL.publish(records)
        self._to_release.append(handles)
        return handles
