"""Wire types between the API process and the DP rank processes (no engine imports).

Every message is a msgspec Struct in one tagged union per direction, encoded as msgpack with
`array_like=True`; new fields go last so positional encoding stays compatible. Finish reasons
and error kinds are enums here, never strings compared across processes.
"""

from __future__ import annotations

import enum

import msgspec

from deepinfer_server.errors import ErrorKind


class Finish(enum.IntEnum):
    """How the engine ended a request. STOP and LENGTH are normal ends; the rest are errors."""

    STOP = 1
    LENGTH = 2
    ABORTED = 3
    PROMPT_TOO_LONG = 4
    OUT_OF_RESOURCES = 5
    GRAMMAR_FAILED = 6
    ENGINE_ERROR = 7

    @property
    def is_normal(self) -> bool:
        """True for the ends a client sees as a finish_reason rather than an error."""
        return self in (Finish.STOP, Finish.LENGTH)


class AbortReason(enum.StrEnum):
    """Why an engine request was cut short before the engine ended it (a metrics label)."""

    DISCONNECT = "disconnect"
    TIMEOUT = "timeout"
    STOP = "stop"
    RANK_FAILURE = "rank_failure"
    SHUTDOWN = "shutdown"


class _Message(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of every wire message; the class name is the tag."""


# API process -> rank process


class StructuredOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """DeepInfer's `SamplingParams.so_args`: a grammar the engine constrains decoding with.

    `schema_type` is "json" (strict JSON schema), "regex" or "ebnf"; with `trigger_token_ids`
    generation is free until that token sequence appears, then the grammar applies.
    """

    schema_type: str
    schema: str
    trigger_token_ids: list[int] | None = None

    def as_so_args(self) -> dict[str, object]:
        """The dict DeepInfer's SamplingParams takes."""
        so_args: dict[str, object] = {"schema_type": self.schema_type, "schema": self.schema}
        if self.trigger_token_ids:
            so_args["trigger_token_ids"] = list(self.trigger_token_ids)
        return so_args


class SamplingOptions(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Per-request engine options: sampling, stopping and structured output."""

    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    ignore_eos: bool = False
    seed: int | None = None
    structured: StructuredOutput | None = None


class AddRequest(_Message):
    """Start one request on the rank; `prompt_token_ids` is packed by `ipc.codec`."""

    request_id: str
    prompt_token_ids: bytes
    sampling: SamplingOptions


class AbortRequests(_Message):
    """Stop these requests; later outputs for them are discarded by the rank."""

    request_ids: list[str]


class Wake(_Message):
    """Shortens an idle rank's wait so that it joins the next lockstep round promptly."""


class Shutdown(_Message):
    """Ends an idle rank's wait; the stop itself is the agreement in `StopAgreement`."""


ToRank = AddRequest | AbortRequests | Wake | Shutdown


# rank process -> API process


class RankReady(_Message):
    """The rank constructed its engine and entered its loop."""

    rank: int
    pid: int


class GeneratedTokens(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Tokens generated for one request, with their per-token data aligned to `token_ids`.

    This is the one record that carries per-token data from the engine to the protocol layer:
    a new per-token field is added here (last, with a default), filled by the engine driver and
    read by the protocol output.
    """

    token_ids: list[int] = msgspec.field(default_factory=list)
    #: Generated tokens that count (usage, token metrics) but are never rendered: the EOS a
    #: request with `ignore_eos` generates as an ordinary token. They have no per-token data.
    hidden_tokens: int = 0

    def extend(self, other: GeneratedTokens) -> None:
        """Append `other`'s tokens (and their per-token data) to these."""
        self.token_ids.extend(other.token_ids)
        self.hidden_tokens += other.hidden_tokens

    def __len__(self) -> int:
        """Every generated token, rendered or hidden."""
        return len(self.token_ids) + self.hidden_tokens


class RequestDelta(msgspec.Struct, array_like=True, gc=False):
    """What one request produced in one engine iteration; `finish` is set when it ended."""

    request_id: str
    tokens: GeneratedTokens
    finish: Finish | None = None


class StepOutputs(_Message):
    """Everything one rank produced in one loop iteration."""

    rank: int
    deltas: list[RequestDelta]
    step_seconds: float


class RequestRejected(_Message):
    """The engine refused a request at `add_request` time (for example invalid token IDs)."""

    request_id: str
    kind: ErrorKind
    message: str


class RankFailed(_Message):
    """The rank's engine raised (or an engine child died); the rank exits after sending this."""

    rank: int
    message: str
    traceback: str


FromRank = RankReady | StepOutputs | RequestRejected | RankFailed

to_rank_encoder = msgspec.msgpack.Encoder()
to_rank_decoder = msgspec.msgpack.Decoder(ToRank)
from_rank_encoder = msgspec.msgpack.Encoder()
from_rank_decoder = msgspec.msgpack.Decoder(FromRank)
