#!/usr/bin/env python3
"""Collective cost: the simulated engine's step rate at DP 1, 2, 4 (and 8) in lockstep.

    python bench/collective_cost.py [--seconds 3] [--dp 1,2,4] [--itl-ms 0] [--streams 1]
    python bench/collective_cost.py --baseline HEAD~1 --rounds 3

No server and no HTTP: each DP rank is a spawned process that builds the simulated engine on
one shared collective group (as the server's ranks do), queues --streams requests that never
end, and loops `has_unfinished_requests()` then `step()` (the rank loop's iteration) until the
ranks agree to stop (the server's StopAgreement) after --seconds. Every rank decodes at every
step, so with --itl-ms 0 a step costs the engine's host work plus its collectives; the rate at
DP N over DP 1's is what the collectives (and N processes sharing the machine's cores) cost.

With --baseline REF the same rows are measured with the sources of git revision REF too (its
`src/` extracted to a temporary directory), alternating REF and the working tree round by round,
and each row shows the working tree's steps/s over REF's: a paired before/after in one run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: Steps each rank takes before its clock starts (imports, first prompt step, caches warm).
_WARM_UP_STEPS = 200


def _rank(
    group: Any,
    stop: Any,
    rank: int,
    dp: int,
    seconds: float,
    itl_ms: float,
    streams: int,
    results: Any,
) -> None:
    import numpy as np

    from deepinfer_server.engines.simulated.engine import LLMEngine, SimEngineArgs
    from deepinfer_server.model.tokenizer import embedded_tokenizer_json

    engine = LLMEngine(
        SimEngineArgs(
            tokenizer_json=embedded_tokenizer_json(),
            lockstep=group,
            engine_rank=rank,
            data_parallel_size=dp,
            max_model_len=1_000_000,
            max_num_seqs=max(1, streams),
            kv_blocks=4096,
            ttft_ms=0.0,
            itl_ms=itl_ms,
        )
    )
    prompt = np.asarray([0, 128803, 19923, 128804, 128822], dtype=np.int32)
    for stream in range(streams):
        engine.add_request("0", f"r{stream}", {"max_tokens": 10**9, "ignore_eos": True}, prompt)
    iteration = 0
    started = 0.0
    cpu = 0.0
    while not stop.should_stop(iteration):
        if engine.has_unfinished_requests():
            engine.step()
        else:
            engine.flush_inflight_reqs()
        iteration += 1
        if iteration == _WARM_UP_STEPS:
            started, cpu = time.perf_counter(), time.process_time()
        elif rank == 0 and started and time.perf_counter() - started >= seconds:
            stop.request_stop()
    results.put(
        (rank, iteration - _WARM_UP_STEPS, time.perf_counter() - started, time.process_time() - cpu)
    )
    engine.close()


def measure(dp: int, seconds: float, itl_ms: float, streams: int) -> dict[str, float]:
    """One row in this interpreter's sources: steps/s of DP `dp` ranks in lockstep."""
    from deepinfer_server.engines.simulated.collectives import new_lockstep_group
    from deepinfer_server.ipc.stop_agreement import StopAgreement

    context = multiprocessing.get_context("spawn")
    group = new_lockstep_group(dp, 60.0)
    stop = StopAgreement()
    results = context.Queue()
    processes = [
        context.Process(
            target=_rank, args=(group, stop, rank, dp, seconds, itl_ms, streams, results)
        )
        for rank in range(dp)
    ]
    for process in processes:
        process.start()
    rows = [results.get(timeout=seconds + 120) for _ in processes]
    for process in processes:
        process.join(30)
    steps = rows[0][1]
    elapsed = max(row[2] for row in rows)
    return {
        "steps_per_s": steps / elapsed,
        "cpu_ms_per_step": 1000 * sum(row[3] for row in rows) / max(1, steps),
    }


def _measure_with(src: Path, dp: int, args: argparse.Namespace) -> dict[str, float]:
    """One row measured in a fresh interpreter whose first import path is `src`."""
    command = [
        sys.executable, __file__, "--one", str(dp), "--seconds", str(args.seconds),
        "--itl-ms", str(args.itl_ms), "--streams", str(args.streams),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(src)}
    output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    result: dict[str, float] = json.loads(output.strip().splitlines()[-1])
    return result


def _baseline_sources(ref: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "src"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per row")
    parser.add_argument("--dp", default="1,2,4", help="DP sizes, comma-separated")
    parser.add_argument("--itl-ms", type=float, default=0.0, help="the engine's step period")
    parser.add_argument("--streams", type=int, default=1, help="running requests per rank")
    parser.add_argument("--baseline", metavar="REF", help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per row (median kept)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args.seconds, args.itl_ms, args.streams)))
        return
    sizes = [int(value) for value in args.dp.split(",")]
    here = ROOT / "src"
    with tempfile.TemporaryDirectory() as scratch:
        sources = {"this tree": here}
        if args.baseline:
            sources = {args.baseline: _baseline_sources(args.baseline, Path(scratch)), **sources}
        samples: dict[tuple[str, int], list[dict[str, float]]] = {}
        for _ in range(args.rounds):
            for dp in sizes:
                for name, src in sources.items():
                    samples.setdefault((name, dp), []).append(_measure_with(src, dp, args))
    print(
        f"\n{os.cpu_count()} CPUs, step period {args.itl_ms:g} ms, {args.streams} stream(s) per "
        f"rank, {args.seconds:g} s per row, median of {args.rounds} round(s)\n"
    )
    header = "| sources | DP | steps/s | / DP 1 | ms per step | CPU ms per step (all ranks) |"
    if args.baseline:
        header += " / baseline |"
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for name in sources:
        single = None
        for dp in sizes:
            rate = statistics.median(s["steps_per_s"] for s in samples[(name, dp)])
            cpu = statistics.median(s["cpu_ms_per_step"] for s in samples[(name, dp)])
            single = rate if dp == 1 else single
            ratio = f"{rate / single:.2f}" if single else "-"
            line = f"| {name} | {dp} | {rate:.0f} | {ratio} | {1000 / rate:.3f} | {cpu:.3f} |"
            if args.baseline:
                base = statistics.median(s["steps_per_s"] for s in samples[(args.baseline, dp)])
                line += f" {rate / base:.2f} |" if name != args.baseline else " 1.00 |"
            print(line, flush=True)


if __name__ == "__main__":
    main()
