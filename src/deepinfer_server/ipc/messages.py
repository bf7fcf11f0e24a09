"""Wire types between the API process and the DP rank processes (no engine imports).

Every message is a msgspec Struct in one tagged union per direction, encoded as msgpack with
`array_like=True`; new fields go last so positional encoding stays compatible. Finish reasons
and error kinds are enums here, never strings compared across processes.
"""

from __future__ import annotations

import enum
from typing import TypeVar

import msgspec

from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.layout import KVLayout
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
    #: A decode engine could not get the prompt's KV from the prefill server.
    KV_TRANSFER_FAILED = 8

    @property
    def is_normal(self) -> bool:
        """True for the ends a client sees as a finish_reason rather than an error."""
        return self in (Finish.STOP, Finish.LENGTH)


class AbortReason(enum.StrEnum):
    """Why an engine request was cut short before the engine ended it (a metrics label)."""

    DISCONNECT = "disconnect"
    TIMEOUT = "timeout"
    #: The server found a stop sequence the engine does not know.
    STOP = "stop"
    #: Submitting failed part-way (a later choice was refused): the admitted ones are undone.
    ROLLBACK = "rollback"
    #: An unexpected error in the server while the request ran.
    ERROR = "error"
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
    #: DeepInfer's top_k: -1 (off) or at least 1.
    top_k: int = -1
    #: Report each generated token's logprob (`GeneratedTokens.logprobs`).
    logprobs: bool = False
    #: How many alternatives to report per generated token (0-1000; 0: none).
    top_logprobs: int = 0
    #: Report the prompt's logprobs (`GeneratedTokens.prompt_logprobs`, prompt length - 1).
    prompt_logprobs: bool = False
    #: The most reasoning tokens the request may generate (None: no budget); once spent,
    #: `thinking_end_id` (`</think>`) is the next token and the answer follows.
    thinking_budget: int | None = None
    thinking_end_id: int = -1
    #: How long the request asked that its prompt be kept in the prefix cache (Anthropic's
    #: `cache_control` ttl, OpenAI's `prompt_cache_retention`); 0: no retention asked. The
    #: driver hands it to engines that honour it, never in the sampling parameters.
    retention_seconds: int = 0


class Images(msgspec.Struct, array_like=True, gc=False):
    """DeepInfer's `multi_modal_data`: encoded images in the order of the prompt's image
    placeholders, with each one's (width, height) in pixels."""

    sizes: list[tuple[int, int]]
    data: list[bytes]
    #: Prompt tokens the images add beyond their placeholders (the engine expands each one).
    extra_tokens: int = 0

    @staticmethod
    def prompt_tokens(prompt_token_ids: list[int], images: Images | None) -> int:
        """The prompt's length as the engine counts it: images at their token counts."""
        return len(prompt_token_ids) + (images.extra_tokens if images is not None else 0)

    def as_multi_modal_data(self) -> dict[str, object]:
        """The dict DeepInfer's add_request takes."""
        return {"image_sizes": list(self.sizes), "image_bytes": list(self.data)}


class AddRequest(_Message):
    """Start one request on the rank; `prompt_token_ids` is packed by `ipc.codec`."""

    request_id: str
    prompt_token_ids: bytes
    sampling: SamplingOptions
    images: Images | None = None
    #: The API server process that sent it (`--api-server-count`): its outputs go back there.
    client: int = 0
    #: Its prefix-cache partition (a digest of the API key's scope and the request's
    #: `cache_salt`): requests with different ones never share cached prefixes; None shares
    #: with every other request without one.
    cache_salt: bytes | None = None
    #: A decode server's request: where its prompt's KV is pulled from.
    kv_transfer_params: KVTransferParams | None = None


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
    #: A prefill rank's bound disaggregation bootstrap port (None on other roles).
    bootstrap_port: int | None = None
    #: Its grammar builder is still warming up: `GrammarWarm` follows (else it is warm now).
    grammar_warming: bool = False
    #: A prefill or decode rank's KV layout (None on a NORMAL rank).
    layout: KVLayout | None = None


class GrammarWarm(_Message):
    """The rank's grammar builder is warm: a first structured request pays no start-up."""

    rank: int


class GeneratedTokens(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Tokens generated for one request, with their per-token data aligned to `token_ids`.

    This is the one record that carries per-token data from the engine to the protocol layer:
    a new per-token field is added here (last, with a default), filled by the engine driver and
    read by the protocol output.
    """

    token_ids: list[int] = msgspec.field(default_factory=list)
    #: Natural-log probability of each token (after temperature, top-p and top-k); set only
    #: when the request asked for logprobs, then one per token.
    logprobs: list[float] | None = None
    #: The most likely alternatives of each token, `(token_id, logprob)` in descending order;
    #: set only when the request asked for top logprobs, then one list per token.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    #: The prompt's logprobs (one per prompt token after the first); on the first batch only.
    prompt_logprobs: list[float] | None = None
    #: Generated tokens that count (usage, token metrics) but are never rendered: the EOS a
    #: request with `ignore_eos` generates as an ordinary token. They have no per-token data.
    hidden_tokens: int = 0

    def extend(self, other: GeneratedTokens) -> None:
        """Append `other`'s tokens (and their per-token data) to these."""
        before = len(self.token_ids)
        added = len(other.token_ids)
        self.token_ids.extend(other.token_ids)
        self.logprobs = _aligned(self.logprobs, other.logprobs, before, added)
        self.top_logprobs = _aligned(self.top_logprobs, other.top_logprobs, before, added)
        if other.prompt_logprobs is not None:
            self.prompt_logprobs = other.prompt_logprobs
        self.hidden_tokens += other.hidden_tokens

    def logprob_pairs(self) -> list[tuple[float, list[tuple[int, float]]]] | None:
        """One `(logprob, top_logprobs)` pair per token, or None without logprobs."""
        if self.logprobs is None:
            return None
        tops = self.top_logprobs or [[] for _ in self.logprobs]
        return list(zip(self.logprobs, tops, strict=True))

    def __len__(self) -> int:
        """Every generated token, rendered or hidden."""
        return len(self.token_ids) + self.hidden_tokens


_T = TypeVar("_T")


def _aligned(
    mine: list[_T] | None, theirs: list[_T] | None, mine_len: int, their_len: int
) -> list[_T] | None:
    """`mine + theirs` for a per-token field, or None when neither side carries it.

    Both sides of one request carry a field or neither does, except empty batches (a bare
    finish), which carry nothing and have nothing to align.
    """
    if theirs is None:
        if mine is not None and their_len:
            raise ValueError("per-token data missing from a non-empty batch")
        return mine
    if mine is None:
        if mine_len:
            raise ValueError("per-token data missing from a non-empty batch")
        mine = []
    mine.extend(theirs)
    return mine


class RequestDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What one request produced in one engine iteration; `finish` is set when it ended.

    A request's first delta, sent in the first iteration after the engine took it (with or
    without tokens), carries `cached_tokens`: the prompt tokens the engine reused from its
    prefix cache (0 on a miss or without a cache); later deltas leave it None.
    """

    request_id: str
    tokens: GeneratedTokens
    finish: Finish | None = None
    cached_tokens: int | None = None
    #: A prefill engine's handoff of the request's KV, on its finishing delta.
    kv_transfer_params: KVTransferParams | None = None
    #: The engine's reason for an error finish (a failed KV transfer's), when it gives one.
    detail: str | None = None
    #: With `cached_tokens`: the prompt tokens the engine will write to its prefix cache for
    #: a request that asked for retention (0: none will be).
    written_tokens: int | None = None


class HostTierStats(msgspec.Struct, array_like=True, gc=False):
    """A rank's host-memory KV tier (`--kv-offload-host-gb`): the prompt tokens its restores
    served, the bytes and seconds of the copies each way since the rank started, and what it
    holds now against its budget."""

    hit_tokens: int
    restore_bytes: int
    restore_seconds: float
    offload_bytes: int
    offload_seconds: float
    sequences: int
    bytes: int
    budget_bytes: int
    #: Of `hit_tokens`, those first brought from the shared store (`--kv-offload-store`), and
    #: the store's errors and timed-out lookups (each a miss).
    store_hit_tokens: int = 0
    store_errors: int = 0


class PrefixCacheStats(msgspec.Struct, array_like=True, gc=False):
    """A rank's prefix-cache counters: prompt tokens looked up and found in the cache since
    the rank started (as vLLM counts them; `hits` counts every tier's), and the sequences the
    cache holds now; `host`, its host-memory tier's (None without one)."""

    queries: int
    hits: int
    sequences: int
    host: HostTierStats | None = None


class EngineCounters(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A rank's engine counters (disaggregation, speculative decoding): totals since the rank
    started, and the samples of its histograms since its last report."""

    #: Prompt tokens the engine's prompt steps computed (prefix-cache and pulled ones excluded).
    prompt_tokens_computed: int = 0
    #: KV bytes a decode engine pulled, and its failed transfers by reason.
    kv_transfer_bytes: int = 0
    kv_transfer_failures: dict[str, int] = msgspec.field(default_factory=dict)
    #: Seconds of each pull, and of each request's wait from arrival to its KV in place.
    kv_transfer_seconds: list[float] = msgspec.field(default_factory=list)
    kv_transfer_wait_seconds: list[float] = msgspec.field(default_factory=list)
    #: Prompts a prefill engine holds for decode servers now.
    held_kv: int = 0
    #: Speculative decoding: decode steps of a sequence that verified drafts, the drafts they
    #: verified and accepted, and the accepted ones by draft position (0 = the first draft).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = msgspec.field(default_factory=list)


class StepOutputs(_Message):
    """Everything one rank produced in one loop iteration."""

    rank: int
    deltas: list[RequestDelta]
    step_seconds: float
    #: The rank's KV-cache usage (0-1) after the iteration; None when the engine cannot tell.
    kv_cache_usage: float | None = None
    #: The rank's prefix-cache counters after the iteration; None without a prefix cache.
    prefix_cache: PrefixCacheStats | None = None
    #: The rank's disaggregation counters, when they changed since its last report.
    counters: EngineCounters | None = None


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


class LinkHello(_Message):
    """A rank's first message on a connection to an API process: which rank it is, and whether
    the connection is the rank's link (False: a one-off report from another thread)."""

    rank: int
    main: bool = True


class RankAlive(_Message):
    """The rank's loop came back: sent when an iteration reported nothing else for the
    heartbeat interval, so that an idle rank is watched as closely as a busy one."""

    rank: int


FromRank = (
    RankReady | StepOutputs | RequestRejected | RankFailed | LinkHello | RankAlive | GrammarWarm
)

to_rank_encoder = msgspec.msgpack.Encoder()
to_rank_decoder = msgspec.msgpack.Decoder(ToRank)
from_rank_encoder = msgspec.msgpack.Encoder()
from_rank_decoder = msgspec.msgpack.Decoder(FromRank)
