"""Grammars of the roles' sequences, compiled off the rank's thread.

DeepInfer's `add_request` compiles a request's grammar on the caller's thread when it does not
enqueue the sequence (`enqueue=False`: the caller schedules it), and the roles build every
sequence that way. So they take the grammar out of the request, put it back on the sequence
DeepInfer built, and hand it to DeepInfer's own builder (`SOMatcherBuilder.submit`), whose pump
(each step's `pre_sampler_sync`) attaches the matcher and calls back: a rank's other requests
go on meanwhile, and `has_unfinished_requests` counts the build.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: DeepInfer's finish string of a failed grammar (sequence.hpp `get_finished_reason`).
GRAMMAR_FAILED = "xgrammar runtime errors or timeout"


def without_grammar(params: Any) -> tuple[Any, dict[str, Any] | None]:
    """The request's sampling parameters without `so_args`, and its `so_args`."""
    if isinstance(params, dict):
        so_args = params.get("so_args")
        if so_args is None:
            return params, None
        return {key: value for key, value in params.items() if key != "so_args"}, so_args
    so_args = getattr(params, "so_args", None)
    if so_args is not None:
        params.so_args = None
    return params, so_args


def build_grammar(
    engine: Any, seq: Any, so_args: dict[str, Any], on_ready: Callable[[Any], None]
) -> None:
    """Give `seq` its grammar back and build its matcher; `on_ready(seq)` once it is attached
    (an aborted matcher when the build failed or timed out)."""
    seq.sampling_params.so_args = so_args
    engine.so_matcher_builder.submit(seq, so_args, on_ready)
