#!/usr/bin/env python3
"""Prefill cadence: TTFT and throughput against DeepInfer's prefill attempt interval.

    python bench/prefill_cadence.py [--duration SECONDS] [--itl-ms MS] [--intervals 1,5,70]

Drives the simulated engine in process (no HTTP: the figures isolate the scheduler) with a
closed loop of --concurrency streams (default 64, DP 1, max_num_seqs = concurrency), each
request generating 128-384 tokens (ignore_eos, fixed seed), and a new request as soon as one
ends. For each DEEPINFER_PREFILL_ATTEMPT_INTERVAL it reports TTFT p50/p99 (in ms and in engine
steps) of the requests that arrived after the first wave, and output tokens/s beside the ideal
(every running stream gets a token every step), as a ratio. The ANY interval is held at
DeepInfer's 100 (with DP 1 it only matters above 100).

Limits of the model: a prompt step costs one step period like a decode step (a real prefill of
many long prompts costs more), and DP 1 has no votes (every point where the rank wants a
prefill wins), so the figures show the shape of the trade-off, not B200 numbers.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np

from deepinfer_server.engines.simulated.collectives import new_lockstep_group
from deepinfer_server.engines.simulated.engine import LLMEngine, SimEngineArgs
from deepinfer_server.engines.simulated.outputs import RequestOutput
from deepinfer_server.model.tokenizer import embedded_tokenizer_json

PROMPT = np.asarray([0, 128803, 19923, 128804, 128822], dtype=np.int32)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def run_point(
    interval: int, concurrency: int, duration: float, itl_ms: float, tokenizer_json: str
) -> dict[str, float]:
    """One closed-loop run at one interval."""
    engine = LLMEngine(
        SimEngineArgs(
            tokenizer_json=tokenizer_json,
            lockstep=new_lockstep_group(1, 60.0),
            max_num_seqs=concurrency,
            ttft_ms=0.0,
            itl_ms=itl_ms,
            prefill_attempt_interval=interval,
        )
    )
    lengths = random.Random(7)
    arrived: dict[str, float] = {}
    first_wave = set()
    ttfts: list[float] = []
    serial = 0

    def submit() -> None:
        nonlocal serial
        serial += 1
        request_id = f"r{serial}"
        params = {"max_tokens": lengths.randint(128, 384), "ignore_eos": True}
        engine.add_request("0", request_id, params, PROMPT)
        arrived[request_id] = time.perf_counter()

    for _ in range(concurrency):
        submit()
    first_wave.update(arrived)
    started = time.perf_counter()
    tokens = 0
    steps = 0
    while (now := time.perf_counter()) - started < duration:
        handles = engine.step() if engine.has_unfinished_requests() else np.empty(0, np.uint64)
        steps += 1
        now = time.perf_counter()
        for handle in handles.tolist():
            request_id = RequestOutput.get_request_id(handle)
            tokens += 1
            if request_id in arrived:
                if request_id not in first_wave:
                    ttfts.append(now - arrived[request_id])
                del arrived[request_id]
            if RequestOutput.get_finish_reason(handle):
                submit()
    elapsed = time.perf_counter() - started
    step_seconds = elapsed / steps
    return {
        "ttft_p50_ms": 1000 * _percentile(ttfts, 50),
        "ttft_p99_ms": 1000 * _percentile(ttfts, 99),
        "ttft_p50_steps": _percentile(ttfts, 50) / step_seconds,
        "ttft_p99_steps": _percentile(ttfts, 99) / step_seconds,
        "tokens_per_s": tokens / elapsed,
        "ideal_tokens_per_s": concurrency / step_seconds,
        "requests": len(ttfts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per interval")
    parser.add_argument("--itl-ms", type=float, default=5.0, help="engine step period")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--intervals", default="1,2,5,10,20,35,70,140")
    args = parser.parse_args()
    tokenizer_json = embedded_tokenizer_json()
    print(
        f"c={args.concurrency}, DP 1, step {args.itl_ms:g} ms, {args.duration:g} s per row\n"
        "| interval | TTFT p50 ms (steps) | TTFT p99 ms (steps) | tokens/s | / ideal | requests |\n"
        "|---:|---:|---:|---:|---:|---:|"
    )
    for interval in (int(v) for v in args.intervals.split(",")):
        row = run_point(interval, args.concurrency, args.duration, args.itl_ms, tokenizer_json)
        print(
            f"| {interval} | {row['ttft_p50_ms']:.0f} ({row['ttft_p50_steps']:.1f}) "
            f"| {row['ttft_p99_ms']:.0f} ({row['ttft_p99_steps']:.1f}) "
            f"| {row['tokens_per_s']:.0f} | {row['tokens_per_s'] / row['ideal_tokens_per_s']:.3f} "
            f"| {row['requests']:.0f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
