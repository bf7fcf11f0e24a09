"""Another key's trivial schema under one key's flood of heavy grammars, against an idle compile.

Starts the API process's structured outputs (the compile workers and the fair queue before
them, as a server has once its warm-up ended), times a trivial schema never compiled before
from a quiet key while nothing else compiles (the idle figure, median of `--rounds`), then has
one key flood runaway regexes (each compiles until the time bound kills it) and, once the flood
holds every worker it may, times another trivial schema from the quiet key. Prints both and
their ratio (the victim's wait under the flood as a multiple of an idle compile):

    PYTHONPATH=src python bench/grammar_fairness.py            (needs the [grammar] extra)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import time

from deepinfer_server.grammar import chat_constraint
from deepinfer_server.grammar.compile_queue import QueueLimits
from deepinfer_server.grammar.errors import GrammarError
from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from deepinfer_server.protocol.core.structured_outputs import StructuredOutputs

FLOODER, VICTIM = "tenant-flooder", "tenant-victim"
#: Bounded repeats: tens of seconds and gigabytes each, so every one runs to the time bound.
RUNAWAY = "\\w{1,5}-" * 700


async def _victim(outputs: StructuredOutputs, name: str) -> float:
    """Seconds to compile a trivial schema no one compiled before, in the quiet key's turn."""
    schema = {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}
    answer = {"type": "json_schema", "json_schema": {"name": "v", "schema": schema}}
    constraint = chat_constraint({"response_format": answer})
    assert constraint is not None
    started = time.perf_counter()
    await outputs.compile(constraint, VICTIM)
    return time.perf_counter() - started


async def _flood_one(outputs: StructuredOutputs, index: int) -> None:
    constraint = chat_constraint({"structured_outputs": {"regex": f"{RUNAWAY}x{index}"}})
    assert constraint is not None
    with contextlib.suppress(GrammarError):  # cut at the time bound, as it should be
        await outputs.compile(constraint, FLOODER)


async def _measure(outputs: StructuredOutputs, rounds: int, flood_size: int) -> tuple[float, float]:
    assert await outputs.wait_ready()
    idle = statistics.median([await _victim(outputs, f"idle{i}") for i in range(rounds)])
    flood = [asyncio.ensure_future(_flood_one(outputs, i)) for i in range(flood_size)]
    while True:  # until the flood's compiles run and the rest wait behind them
        stats = outputs.queue_stats()
        if stats is not None and stats.running >= 1 and stats.waiting >= 1:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.5)  # the flood's compiles are well under way
    flooded = await _victim(outputs, "flooded")
    for task in flood:
        task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)
    return idle, flooded


def main() -> None:
    """Print the idle compile, the victim's under the flood, and their ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="idle compiles timed (median)")
    parser.add_argument("--flood", type=int, default=8, help="runaway regexes the flooder sends")
    args = parser.parse_args()
    # The engine's bound 8 s: a runaway compile is killed after 4 s.
    os.environ.setdefault("DEEPINFER_XGRAMMAR_TIMEOUT", "8")
    outputs = StructuredOutputs(embedded_tokenizer_json(), limits=QueueLimits(args.flood, 120.0))
    try:
        idle, flooded = asyncio.run(_measure(outputs, args.rounds, args.flood))
    finally:
        outputs.close()
    print(f"idle compile (median of {args.rounds}): {idle:.3f} s")
    print(f"victim's compile under the flood:    {flooded:.3f} s")
    print(f"ratio: {flooded / idle:.2f}x")


if __name__ == "__main__":
    main()
