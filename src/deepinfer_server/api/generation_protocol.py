"""What the generation endpoint asks of a client protocol: how it prepares a request (the
`Prepared` requests it yields), frames its stream, shapes its errors, and, for a protocol with
state, the `Session` that serves a request with it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from deepinfer_server.api.sse import SSEResponse
from deepinfer_server.coordinator.handle import RequestHandle
from deepinfer_server.errors import ApiError
from deepinfer_server.grammar import Constraint
from deepinfer_server.ipc.messages import Images, SamplingOptions
from deepinfer_server.metrics import RequestRecord
from deepinfer_server.protocol.core.json_types import JsonObject
from deepinfer_server.protocol.core.recipe import RecipeContext
from deepinfer_server.services.token_stream import ProtocolOutput


class Prepared(Protocol):
    """What every protocol's preparation yields."""

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def sampling(self) -> SamplingOptions: ...

    @property
    def stream(self) -> bool: ...

    @property
    def constraint(self) -> Constraint | None: ...

    @property
    def images(self) -> Images | None: ...

    @property
    def cache_salt(self) -> str | None: ...


P = TypeVar("P", bound=Prepared)


class Choice(Protocol):
    """What a prepared choice of a several-choice request adds (chat n > 1, completions)."""

    @property
    def index(self) -> int: ...

    @property
    def prompt_index(self) -> int: ...


class Session(Protocol[P]):
    """A request that a protocol serves with state (the Responses store): its own preparation
    and output, and what it does once the output is complete."""

    @property
    def response_id(self) -> str: ...

    def prepare(self, body: JsonObject, recipe: RecipeContext) -> P: ...

    def expanded_size(self, bound: int) -> int:
        """The bytes the session adds to what the request prepares, beyond its body (stored
        items), counted until past `bound`."""
        ...

    def make_output(self, prepared: P, response_id: str, recipe: RecipeContext) -> ProtocolOutput:
        """The output of the session's one choice."""
        ...

    async def finished(self) -> list[str]:
        """After the request ended normally: the closing payloads its output held back."""
        ...

    @property
    def background(self) -> bool:
        """Whether the request runs detached from its connection (`run_in_background`)."""
        ...

    async def run_in_background(
        self, handle: RequestHandle, record: RequestRecord, streaming: bool
    ) -> Response | SSEResponse:
        """Start the detached run, which owns `handle` from then on; the answer."""
        ...


@dataclass(frozen=True)
class GenerationProtocol(Generic[P]):
    """How one client protocol prepares requests, frames its stream and shapes its errors."""

    id_prefix: str
    #: One prepared request, or one per choice (n > 1, several prompts).
    prepare: Callable[[JsonObject, RecipeContext], P | list[P]]
    make_output: Callable[[P, str, RecipeContext], ProtocolOutput]
    frames: Callable[[list[str]], bytes]
    done_frame: bytes
    #: The stream's last message when the request fails after the stream started.
    error_frame: Callable[[ApiError], bytes]
    #: A protocol with state: the session of a request that needs it (None: the stateless
    #: path, exactly as for a protocol without state).
    open_session: Callable[[Request, JsonObject], Awaitable[Session[P] | None]] | None = None
