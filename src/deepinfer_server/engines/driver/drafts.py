"""DraftCounts: speculative decoding's totals, counted from each step's outputs.

From each step's `draft_tok` and `accept_tok` (drafts + 1 and accepted + 1 on a request's last
entry of a step, 1 and 1 on a step without drafts), the drafts verified and accepted, as vLLM's
spec_decode counters do; DeepInfer accepts a prefix of the drafts, so the accepted count also
gives the positions.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from deepinfer_server.engines.driver.contract import OutputReader
from deepinfer_server.ipc.messages import EngineCounters


class DraftCounts:
    """Speculative decoding's totals since the engine started."""

    def __init__(self) -> None:
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_position: list[int] = []

    def count(self, reader: type[OutputReader], handles: npt.NDArray[np.uint64]) -> None:
        """Count the drafts of one step's outputs (every handle, even of an aborted request:
        the engine verified its drafts all the same)."""
        for handle in handles.tolist():
            drafted = reader.get_draft_tok(handle) - 1
            if drafted <= 0:  # not a step's last entry (0), or a step without drafts (1)
                continue
            accepted = reader.get_accept_tok(handle) - 1
            self.drafts += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            per_position = self.accepted_per_position
            if len(per_position) < drafted:
                per_position.extend([0] * (drafted - len(per_position)))
            for position in range(accepted):
                per_position[position] += 1

    def fill(self, counters: EngineCounters) -> None:
        """Copy the totals into `counters`."""
        counters.spec_drafts = self.drafts
        counters.spec_draft_tokens = self.draft_tokens
        counters.spec_accepted_tokens = self.accepted_tokens
        counters.spec_accepted_per_position = list(self.accepted_per_position)
