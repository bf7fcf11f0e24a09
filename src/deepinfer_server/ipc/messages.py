"""Wire types between the API process and the DP rank processes.

Every message is a msgspec Struct in one tagged union per direction, encoded as msgpack with
`array_like=True`; new fields go last so positional encoding stays compatible.
"""

from __future__ import annotations

import msgspec


class _Message(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of every wire message; the class name is the tag."""


# API process -> rank process


class SamplingOptions(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Per-request sampling parameters, the subset DeepInfer's SamplingParams understands."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    ignore_eos: bool = False
    seed: int | None = None


class AddRequest(_Message):
    """Start one request on the rank; `prompt_token_ids` is int32 little-endian bytes."""

    request_id: str
    prompt_token_ids: bytes
    sampling: SamplingOptions


class AbortRequests(_Message):
    """Stop these requests; later outputs for them are discarded by the rank."""

    request_ids: list[str]


class Wake(_Message):
    """Shortens an idle rank's wait so that it joins the next lockstep round promptly."""


class Shutdown(_Message):
    """Stop the rank loop at the iteration all ranks agree on, then close the engine."""


ToRank = AddRequest | AbortRequests | Wake | Shutdown


# rank process -> API process


class RankReady(_Message):
    """The rank constructed its engine and entered its loop."""

    rank: int
    pid: int


class RequestOutput(msgspec.Struct, array_like=True, gc=False):
    """New tokens of one request in one engine iteration, and its finish reason if it ended.

    `finish_reason` is DeepInfer's string: "" while running, "stop" or "length" for a normal
    end, anything else for an end the client must see as an error.
    """

    request_id: str
    token_ids: list[int]
    finish_reason: str


class StepOutputs(_Message):
    """Everything one rank produced in one loop iteration."""

    rank: int
    outputs: list[RequestOutput]
    step_seconds: float


class RequestRejected(_Message):
    """The engine refused a request at `add_request` time (for example invalid token IDs)."""

    request_id: str
    status_code: int
    message: str


class RankFailed(_Message):
    """The rank's engine raised; the rank exits after sending this."""

    rank: int
    message: str
    traceback: str


FromRank = RankReady | StepOutputs | RequestRejected | RankFailed

to_rank_encoder = msgspec.msgpack.Encoder()
to_rank_decoder = msgspec.msgpack.Decoder(ToRank)
from_rank_encoder = msgspec.msgpack.Encoder()
from_rank_decoder = msgspec.msgpack.Decoder(FromRank)
