"""RequestRecord: timing and token counts of one request, filled in as it runs; ChoiceRecords:
those of a request's several choices, read as one for the access log."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """Timing and token counts of one request, filled in as it runs (`time.perf_counter()`)."""

    arrival: float
    prompt_tokens: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    first_step_seconds: float = 0.0
    last_token_at: float | None = None
    generation_tokens: int = 0
    inter_token_latencies: list[float] = field(default_factory=list)
    #: How the engine ended it (`Finish`, lower case: "stop", "length"): the metrics' label.
    finish_reason: str | None = None
    #: How the client was told it ended, in its protocol's words: the access log's.
    client_finish_reason: str | None = None
    #: The error kind when the request failed after it was admitted (for example mid-stream).
    error_kind: str | None = None

    def on_tokens(self, arrived_at: float, count: int, step_seconds: float) -> None:
        """Record `count` tokens that reached the API process at `arrived_at`."""
        if count <= 0:
            return
        if self.first_token_at is None:
            self.first_token_at = arrived_at
            self.first_step_seconds = step_seconds
            # Tokens that came with the first one (speculative decoding) follow it at once.
            self.inter_token_latencies.extend([0.0] * (count - 1))
        elif count == 1:
            assert self.last_token_at is not None
            self.inter_token_latencies.append(arrived_at - self.last_token_at)
        else:
            assert self.last_token_at is not None
            # Several tokens in one arrival share the gap since the previous one.
            gap = (arrived_at - self.last_token_at) / count
            self.inter_token_latencies.extend([gap] * count)
        self.generation_tokens += count
        self.last_token_at = arrived_at

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival


@dataclass(frozen=True)
class ChoiceRecords:
    """The records of a request's engine requests (`n` > 1, several prompts), read as one
    request's for the access log: every choice's tokens, each prompt's tokens once (as `usage`
    counts them), the first token of any choice, the first choice's finish, any choice's error.
    """

    records: list[RequestRecord]
    #: The prompt each record's choice answers.
    prompt_indexes: list[int]

    @property
    def prompt_tokens(self) -> int:
        per_prompt = dict(zip(self.prompt_indexes, self.records, strict=True))
        return sum(record.prompt_tokens for record in per_prompt.values())

    @property
    def generation_tokens(self) -> int:
        return sum(record.generation_tokens for record in self.records)

    @property
    def ttft(self) -> float | None:
        times = [record.ttft for record in self.records if record.ttft is not None]
        return min(times) if times else None

    @property
    def finish_reason(self) -> str | None:
        return self.records[0].finish_reason

    @property
    def client_finish_reason(self) -> str | None:
        return self.records[0].client_finish_reason

    @property
    def error_kind(self) -> str | None:
        return next((r.error_kind for r in self.records if r.error_kind is not None), None)
