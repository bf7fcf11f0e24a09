"""Admission: DeepInfer's `add_request` rules, from its arguments to a queued sequence.

The sampling parameters are normalised (a dict filtered for None values, `eos_id` set), the
prompt checked (empty: ValueError; not C-contiguous int32: TypeError; an out-of-vocabulary ID:
None, and never an output), and the sequence goes where DeepInfer would put it: a COMPLETION
engine's pull, the grammar builds, the head of the queue for a prefix-cache fork, or its tail.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import cast

import msgspec
import numpy as np
import numpy.typing as npt

from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.engines.simulated.disaggregation import DecodeRole, PrefillRole
from deepinfer_server.engines.simulated.inputs import (
    Extra,
    MultiModalData,
    SamplingParamsDict,
    SamplingParamsKwargs,
)
from deepinfer_server.engines.simulated.parts import EngineParts
from deepinfer_server.engines.simulated.sampling_params import SamplingParams
from deepinfer_server.engines.simulated.sequence import Sequence
from deepinfer_server.engines.simulated.step_clock import StepClock

logger = logging.getLogger(__name__)


def sampling_params_of(
    given: SamplingParamsDict | SamplingParams | None, eos_id: int
) -> SamplingParams:
    """The request's SamplingParams (a passed object is used, and mutated: its `eos_id`)."""
    if given is None:
        given = {}
    if not isinstance(given, SamplingParams):
        kwargs = {key: value for key, value in given.items() if value is not None}
        given = SamplingParams(**cast(SamplingParamsKwargs, kwargs))
    given.eos_id = eos_id
    return given


def in_vocabulary(prompt_token_ids: npt.NDArray[np.int32], vocab_size: int) -> bool:
    """Whether every prompt ID is a token; raises for an empty or a non-int32 prompt."""
    if prompt_token_ids.size == 0:
        raise ValueError("prompt must not be empty")
    if prompt_token_ids.dtype != np.int32 or not prompt_token_ids.flags.c_contiguous:
        raise TypeError("prompt_token_ids must be a C-contiguous numpy int32 array")
    return int(prompt_token_ids.min()) >= 0 and int(prompt_token_ids.max()) < vocab_size


@dataclass
class Admission:
    """What `add_request` needs of the engine: its parts, its clock and its role."""

    parts: EngineParts
    clock: StepClock
    ttft_ms: float
    prefill: PrefillRole | None
    decode: DecodeRole | None

    def admit(
        self,
        user_id: str,
        request_id: str,
        sampling_params: SamplingParamsDict | SamplingParams | None,
        prompt_token_ids: npt.NDArray[np.int32],
        multi_modal_data: MultiModalData | None,
        extra: Extra | None,
        enqueue: bool,
        cache_salt: bytes | None,
        retention_seconds: float = 0.0,
    ) -> Sequence | None:
        """`LLMEngine.add_request`: the queued sequence, or None for out-of-vocabulary IDs."""
        # The TTFT delay runs from arrival: preparing the script below overlaps it. While
        # requests run, the engine takes a new one between two steps, in the host work that
        # overlaps the next step: it arrived when that step began, so DeepInfer's next step()
        # can prefill it, as it does a request added before an idle engine's step().
        arrived = time.monotonic()
        if self.parts.table.running:
            arrived = self.clock.period_start(arrived)
        params = sampling_params_of(sampling_params, self.parts.eos_id)
        if not in_vocabulary(prompt_token_ids, self.parts.vocab_size):
            logger.info("request %s of user %s has invalid token ids; dropped", request_id, user_id)
            return None
        handoff = (extra or {}).get("kv_transfer_params")
        if self.decode is not None and handoff is None:
            raise ValueError(
                "a COMPLETION engine cannot prefill: the request needs the kv_transfer_params "
                "of a prefill server's answer"
            )
        if self.prefill is not None:
            # A PROMPT engine only prefills: its answer is the prompt step's token.
            params.max_tokens = 1
        prompt = prompt_token_ids.tolist()
        sequence = Sequence(
            request_id=request_id,
            prompt=prompt,
            params=params,
            script=self.parts.script.answer_tokens(prompt, multi_modal_data),
            ready_at=arrived + self.ttft_ms / 1000.0,
            cache_salt=cache_salt,
            retain_seconds=retention_seconds,
        )
        if self.decode is not None:
            self._pull(self.decode, sequence, handoff)
        else:
            self._queue(sequence, prompt_token_ids, multi_modal_data, enqueue)
        return sequence

    def _pull(self, decode: DecodeRole, sequence: Sequence, handoff: object) -> None:
        """A COMPLETION engine's request: its prompt's KV is pulled, never prefilled."""
        if sequence.params.so_args:
            self.parts.builds.build_now(sequence)
        if not isinstance(handoff, KVTransferParams):
            handoff = msgspec.convert(handoff, KVTransferParams)
        decode.add(sequence, handoff)

    def _queue(
        self,
        sequence: Sequence,
        prompt_token_ids: npt.NDArray[np.int32],
        multi_modal_data: MultiModalData | None,
        enqueue: bool,
    ) -> None:
        """A request to prefill: forked from the prefix cache, built a grammar, or queued."""
        params = sequence.params
        cacheable = (
            multi_modal_data is None and not params.prompt_logprobs and enqueue
        ) and not params.so_args
        forked = self.parts.cache.add(sequence, prompt_token_ids, cacheable)
        if params.so_args and enqueue:
            self.parts.builds.submit(sequence)
        elif params.so_args:  # DeepInfer builds synchronously here too
            self.parts.builds.build_now(sequence)
        elif forked:  # DeepInfer's fork_seq queues a fork first
            self.parts.table.waiting.insert(0, sequence)
        elif enqueue:
            self.parts.table.waiting.append(sequence)
