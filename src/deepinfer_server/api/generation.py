"""The request path shared by every protocol: drive one engine request through an output.

`generate()` is the only loop over a request's token batches. Whatever ends it (normal finish,
the parser ending the answer early, an error, the client leaving) it closes the handle, which
aborts the engine request if the engine may still run it, and closes the output's parser.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from deepinfer_server.coordinator.handle import RequestHandle


class ProtocolOutput(Protocol):
    """One protocol's view of a request's output (ChatOutput, and later Responses/Messages)."""

    @property
    def finished(self) -> bool: ...

    def start(self) -> list[str]: ...

    def push(self, token_ids: list[int]) -> list[str]: ...

    def finish(self, engine_reason: str) -> list[str]: ...

    def close(self) -> None: ...


async def generate(handle: RequestHandle, output: ProtocolOutput) -> AsyncIterator[list[str]]:
    """Yield the output's payloads step by step until the request ends.

    Raises the request's ApiError (timeout, rank failure, engine error); the handle and the
    output are released in every case, including cancellation.
    """
    try:
        yield output.start()
        while True:
            batch = await handle.next_batch()
            payloads = output.push(batch.token_ids)
            if output.finished:
                # The parser ended the answer (EOS or a stop sequence); closing the handle
                # below aborts the engine request if it is still running.
                payloads.extend(output.finish("stop"))
                yield payloads
                return
            if batch.finish_reason is not None:
                payloads.extend(output.finish(batch.finish_reason))
                yield payloads
                return
            if payloads:
                yield payloads
    finally:
        handle.close()
        output.close()
