"""UnplacedAborts: aborts DeepInfer could not place yet, sent again until they land.

An abort DeepInfer cannot place (a grammar still compiling: the sequence is in no queue until
the builder enqueues it, and `abort_request` returns (0, 0)) is sent again every iteration
until the engine finds the request or the request ends.
"""

from __future__ import annotations

from deepinfer_server.engines.driver.contract import LLMEngine


class UnplacedAborts:
    """Engine request IDs aborted and not found by the engine yet."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self._ids: set[str] = set()

    def __contains__(self, engine_id: object) -> bool:
        return engine_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def abort(self, engine_id: str) -> None:
        """Abort one engine request; remember it when the engine does not find it."""
        found, _ = self._engine.abort_request([engine_id])
        if found:
            self._ids.discard(engine_id)
        else:
            self._ids.add(engine_id)

    def retry(self) -> None:
        """Send every unplaced abort again (rare; the loop runs every few milliseconds)."""
        for engine_id in list(self._ids):
            self.abort(engine_id)

    def ended(self, engine_id: str) -> None:
        """The request ended before the engine found it: nothing more to abort."""
        self._ids.discard(engine_id)
