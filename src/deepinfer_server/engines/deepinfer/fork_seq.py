"""fork_seq: DeepInfer's `Scheduler.fork_seq`, called by what each argument means.

Every path that enters a sequence through it calls it here: the prefix cache's forks (the
parent's whole table, on the `_` branch: only the rest of the prompt is prefilled), prompts the
cache placed in blocks it chose, and prompts a prefill server computed (`blocks` given, their
first token forced). The binding takes nine positional arguments; the new sequence keeps the
built sequence's sampling parameters and ID, replaces no token, and is stamped as
`add_sequence` stamps an arrival.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np


def fork_seq(
    scheduler: Any,
    parent: Any,
    blocks: Sequence[int] | None,
    branch: str,
    seq: Any,
    *,
    so_matcher: Any = None,
    sp_token: int = -1,
) -> Any:
    """Fork `parent` (its whole table, or the KV blocks `blocks`) as the request DeepInfer
    built in `seq` (never enqueued), on `branch`, with `so_matcher`'s grammar and, unless -1,
    `sp_token` forced as its first output token; the new sequence, queued first."""
    table = None if blocks is None else np.asarray(blocks, dtype=np.int32)
    return scheduler.fork_seq(
        parent,
        table,
        branch,
        seq.sampling_params,
        so_matcher,
        sp_token,
        -1,  # replace_last_token_id: none
        seq.seq_id,
        time.time() * 1000.0,  # milliseconds, as add_sequence stamps
    )
