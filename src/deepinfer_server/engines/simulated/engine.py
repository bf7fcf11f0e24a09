"""LLMEngine: a CPU implementation of DeepInfer 0.1.0's engine contract.

What it reproduces of `deepinfer/engine/llm_engine.py`: the `add_request` input rules and its `None`
return for out-of-vocabulary IDs; uint64 output handles released by the next `step()`;
zero-overhead scheduling (decode tokens come back one `step()` late, first tokens at once,
`flush_inflight_reqs()` drains); several tokens per decode step (speculative decoding);
DeepInfer's finish-reason strings; running vs waiting abort semantics; `prompt_length_exceeded`
at prefill time; EOS generated as an ordinary token under `ignore_eos`; the prefill cadence
(`prompt_scheduler.PromptScheduler`); `has_unfinished_requests()` as an all-reduce MAX (whose
rendezvous also carries the step's prefill votes) and `step()`/`close()` as collectives across
the DP ranks; single-thread ownership; DeepInfer's structured outputs (`matcher_builds`).

This module is the contract's face and the order of one step; `parts` builds the rest beside it
(admission, queues, prompt steps, preemption, tokens, grammar builds, the prefix cache with its host
and store tiers, the state slots) and `step_clock` times it: a step lasts `itl_ms` while there is
work, a decode step `itl_ms_per_request` more per sequence, a prompt step at least its computed
tokens over `prefill_tokens_per_s` plus its restores; a request is schedulable `ttft_ms` after
`add_request` (while requests run: after the start of the step it can join).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import numpy as np
import numpy.typing as npt

from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.layout import KVLayout
from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.disaggregation.transfer.agent import TransferAgent
from deepinfer_server.disaggregation.transfer.stats import TransferStats
from deepinfer_server.engines.simulated.admission import Admission
from deepinfer_server.engines.simulated.collectives import Ballot, Tally
from deepinfer_server.engines.simulated.disaggregation import DecodeRole, PrefillRole
from deepinfer_server.engines.simulated.engine_args import SimEngineArgs
from deepinfer_server.engines.simulated.inputs import Extra, MultiModalData, SamplingParamsDict
from deepinfer_server.engines.simulated.outputs import OutputRecord, Published, RequestOutput
from deepinfer_server.engines.simulated.parts import EngineParts
from deepinfer_server.engines.simulated.preemption import schedule_decode
from deepinfer_server.engines.simulated.prompt_scheduler import PromptScheduler
from deepinfer_server.engines.simulated.sampling_params import SamplingParams
from deepinfer_server.engines.simulated.scheduler import (
    PrefillCadence,
)
from deepinfer_server.engines.simulated.sequence import FINISH_ABORT, Sequence
from deepinfer_server.engines.simulated.step_clock import StepClock

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "RequestOutput", "SamplingParams", "SimEngineArgs"]


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
        parts = EngineParts.build(args, self._step_tokens)
        self.tokenizer, self.eos_id = parts.tokenizer, parts.eos_id
        self._deferred: list[OutputRecord] = []
        self._pending_terminal: list[OutputRecord] = []
        self._published = Published()
        self._clock = StepClock(args.itl_ms, args.itl_ms_per_request)
        self._closed = False
        self._builds = parts.builds
        # DeepInfer's KV read-out: `scheduler.get_num_free_gpu_blocks()`, `cache_config`.
        self._kv = self.scheduler = parts.kv
        self.cache_config = self._kv.cache_config
        self._cache = parts.cache
        if args.enable_prefix_caching:
            # What the engine driver reads (absent without a cache, as on DeepInfer).
            self.prefix_cache_stats = self._cache.stats
        self.host_tier_stats = self._cache.host_stats  # the server's, not DeepInfer's
        self._table, self._generator = parts.table, parts.generator
        batched_tokens, prompt_limit = parts.batched_tokens, parts.prompt_limit
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
        self._admission = Admission(parts, self._clock, args.ttft_ms, self._prefill, self._decode)

    def _start_role(self, args: SimEngineArgs) -> None:
        """A PROMPT or COMPLETION engine: its transfer agent and its role's state."""
        role = args.role
        if role is None:
            raise ValueError(f"a {args.disaggregation_mode} engine needs its role settings")
        agent = TransferAgent(role.host, role.ib_device, role.transport)
        if args.disaggregation_mode is DisaggregationRole.PREFILL:
            self._prefill = PrefillRole(self._kv, self._cache.slots, agent, role, args.kv_size)
            self._table.on_finish = self._prefill.hold
        else:
            table, seqs = self._table, args.max_num_seqs
            self._decode = DecodeRole(table, self._generator, agent, seqs, role, args.kv_size)

    @classmethod
    def from_engine_args(cls, args: SimEngineArgs) -> LLMEngine:
        """DeepInfer's constructor from its arguments."""
        return cls(args)

    # Requests

    def add_request(
        self,
        user_id: str,
        request_id: str,
        sampling_params: SamplingParamsDict | SamplingParams | None,
        prompt_token_ids: npt.NDArray[np.int32],
        multi_modal_data: MultiModalData | None = None,
        arrival_time: float | None = None,
        extra: Extra | None = None,
        enqueue: bool = True,
        chunk_checkpoints: list[int] | None = None,
        *,
        cache_salt: bytes | None = None,
        retention_seconds: float = 0.0,
    ) -> Sequence | None:
        """Queue a request; returns None (and never outputs) for out-of-vocabulary IDs
        (`admission`; `arrival_time` and `chunk_checkpoints` are ignored, as on DeepInfer).

        `cache_salt` (the server's, not DeepInfer's): the prefix-cache partition it forks from
        and is kept in; `retention_seconds`, how long it asked that its prompt be kept."""
        self._check_thread()
        self._votes = None
        return self._admission.admit(
            user_id,
            request_id,
            sampling_params,
            prompt_token_ids,
            multi_modal_data,
            extra,
            enqueue,
            cache_salt,
            retention_seconds,
        )

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
        """This rank's requests not yet finished: queued, building a grammar or pulling KV."""
        self._check_thread()
        pulling = len(self._decode) if self._decode is not None else 0
        return len(self._table) + len(self._builds) + pulling

    def step(self) -> npt.NDArray[np.uint64]:
        """One engine step, collective across the DP ranks; returns one handle per token."""
        self._check_thread()
        self._inject_fault()
        started = time.monotonic()
        votes = self._take_votes()
        self._args.lockstep.enter_step(self._args.engine_rank)
        self._published.release()
        step_end = self._clock.step_end(started, self._first_ready())
        terminal, self._pending_terminal = self._pending_terminal, []
        if self._prefill is not None:
            self._prefill.collect()
        if self._decode is not None:
            # Pulled prompts enter with their first token; failed transfers end here.
            terminal.extend(self._decode.step())
        prompt_outputs: list[OutputRecord] = []
        prompt_step = self._prompts.schedule(prompt_outputs, step_end, *votes)
        self.prompt_tokens_computed += self._prompts.computed_tokens
        prompt_seconds = self._cache.prompt_seconds(self._prompts.computed_tokens)
        if prompt_step and prompt_seconds > 0:
            # Across DP ranks the next rendezvous makes the slowest prompt step the group's.
            step_end = max(step_end, started + prompt_seconds)
        deferred, decoded, batch = self._decode_step(prompt_step)
        step_end = self._clock.decode_end(step_end, batch)
        returned = deferred + terminal + prompt_outputs
        if self._args.zero_overhead_scheduling:
            self._deferred = decoded
        else:
            returned.extend(decoded)
        self._prompts.cadence.advance(prompt_step)
        published = self._published.publish(returned)
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
        return self._published.publish(returned)

    def prepare_structured_outputs(self, on_warm: Callable[[], None] | None = None) -> None:
        """Build the grammar compiler, start its worker and build a first matcher, off the
        loop, as DeepInfer's SOMatcherBuilder builds its compiler with the engine; a rank calls
        it once it reported ready, so that it does not slow the server's start (an engine built
        in a test compiles on first use). `on_warm()`, on a builder thread, once done."""
        self._builds.prepare(on_warm)

    def close(self) -> None:
        """A world barrier: every DP rank must close together."""
        self._check_thread()
        if self._closed:
            return
        self._args.lockstep.close_barrier(self._args.engine_rank, self._args.close_timeout)
        self._published.release()
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
        """A COMPLETION engine's transfer counters, a PROMPT engine's ignored releases (None
        for a NORMAL engine)."""
        if self._prefill is not None:
            return self._prefill.transfer_stats()
        return None if self._decode is None else self._decode.stats

    def held_kv(self) -> int:
        """Prompts a PROMPT engine holds for decode servers now."""
        return 0 if self._prefill is None else len(self._prefill.held)

    def kv_layout(self) -> KVLayout | None:
        """The role's KV layout (None for a NORMAL engine)."""
        role = self._prefill or self._decode
        return None if role is None else role.layout

    def bootstrap_port(self) -> int | None:
        """A PROMPT engine's bound bootstrap port (None for the other roles)."""
        return None if self._prefill is None else self._prefill.bootstrap.port

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
        return self._prompts.ballot(self._clock.step_end(time.monotonic(), self._first_ready()))

    def _take_votes(self) -> tuple[Ballot | None, Tally | None]:
        """The step's prefill votes: the last work check's, else planned and cast now."""
        votes, self._votes = self._votes, None
        if votes is None:  # no work check since the queues last changed: plan and vote here
            ballot = self._plan_step()
            rank = self._args.engine_rank
            votes = (
                ballot,
                None if ballot is None else self._args.lockstep.prefill_vote(rank, ballot),
            )
        return votes

    def _first_ready(self) -> float | None:
        """When the first waiting prompt becomes schedulable, on an engine that runs none."""
        table = self._table
        if table.running or not table.waiting:
            return None
        return min(s.ready_at for s in table.waiting)

    def _decode_step(self, prompt_step: bool) -> tuple[list[OutputRecord], list[OutputRecord], int]:
        """The previous step's deferred outputs and, off a prompt step, this one's tokens and
        the sequences it decoded."""
        deferred, self._deferred = self._deferred, []
        decoded: list[OutputRecord] = []
        if prompt_step:
            return deferred, decoded, 0
        # Before the deferred outputs leave: a preempted sequence's in-flight tokens go.
        scheduled, deferred = schedule_decode(
            self._table, deferred, self._step_tokens, stop_preempted=self._decode is not None
        )
        for sequence in scheduled:
            decoded.extend(self._generator.generate(sequence))
        return deferred, decoded, len(scheduled)

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
