#!/usr/bin/env python3
"""Prefill cadence: TTFT and throughput against DeepInfer's prefill attempt interval.

    python bench/prefill_cadence.py [--duration SECONDS] [--itl-ms MS] [--intervals 1,5,70]
    python bench/prefill_cadence.py --agents --concurrency 16 [--prefill-tokens-per-s N]

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

With --agents every stream is an agent conversation instead: a --system-tokens prompt, then
each request is the last one's prompt and answer plus --turn-tokens new tokens (a new
conversation once a prompt passes 24k tokens), and a prompt step lasts the tokens it computes
over --prefill-tokens-per-s (the server's default 20,000); it runs once with the prefix cache
on and once off (`--prefix-caching on|off|both`), and the figures are taken after every
stream's first request (the cold prefill of every system prompt) has its first token.
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
#: <｜User｜> hi <｜Assistant｜> </think>: ends every agent prompt (the engine echoes "hi").
_TURN_END = [128803, 12632, 128804, 128822]
#: A conversation restarts once its prompt would pass this many tokens.
_CONVERSATION_LIMIT = 24_000
#: Seconds the agents' cold start may take before a row gives up.
_WARM_UP_LIMIT = 300.0


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class _Agents:
    """Agent conversations, one per stream: each request extends the stream's last one."""

    def __init__(self, system_tokens: int, turn_tokens: int) -> None:
        self._random = np.random.default_rng(11)
        self._system_tokens = system_tokens
        self._turn_tokens = turn_tokens
        self._prompts: dict[int, list[int]] = {}

    def _fresh(self, count: int) -> list[int]:
        return self._random.integers(1000, 100_000, size=count).tolist()

    def next_prompt(self, stream: int, answer: list[int]) -> np.ndarray:
        last = self._prompts.get(stream)
        if last is None or len(last) + len(answer) + self._turn_tokens > _CONVERSATION_LIMIT:
            prompt = [0, *self._fresh(self._system_tokens), *_TURN_END]
        else:
            prompt = [*last, *answer, *self._fresh(self._turn_tokens), *_TURN_END]
        self._prompts[stream] = prompt
        return np.asarray(prompt, dtype=np.int32)


def run_point(
    interval: int,
    concurrency: int,
    duration: float,
    itl_ms: float,
    tokenizer_json: str,
    agents: tuple[int, int, float, bool] | None = None,
) -> dict[str, float]:
    """One closed-loop run at one interval; `agents`: (system tokens, tokens per turn, prefill
    tokens/s, prefix caching) for agent conversations."""
    engine = LLMEngine(
        SimEngineArgs(
            tokenizer_json=tokenizer_json,
            lockstep=new_lockstep_group(1, 60.0),
            max_num_seqs=concurrency,
            ttft_ms=0.0,
            itl_ms=itl_ms,
            prefill_attempt_interval=interval,
            enable_prefix_caching=agents is not None and agents[3],
            prefill_tokens_per_s=agents[2] if agents is not None else 0.0,
        )
    )
    conversations = _Agents(agents[0], agents[1]) if agents is not None else None
    lengths = random.Random(7)
    arrived: dict[str, float] = {}
    stream_of: dict[str, int] = {}
    answers: dict[str, list[int]] = {}
    first_wave = set()
    ttfts: list[float] = []
    computed = 0
    serial = 0

    def submit(stream: int) -> None:
        nonlocal serial
        serial += 1
        request_id = f"r{serial}"
        params = {"max_tokens": lengths.randint(128, 384), "ignore_eos": True}
        prompt = PROMPT
        if conversations is not None:
            prompt = conversations.next_prompt(stream, answers.pop(request_id, []))
        engine.add_request("0", request_id, params, prompt)
        arrived[request_id] = time.perf_counter()
        stream_of[request_id] = stream
        answers[request_id] = []

    for stream in range(concurrency):
        submit(stream)
    first_wave.update(arrived)
    started = time.perf_counter()
    tokens = 0
    steps = 0
    # Agents measure from the end of their cold start (every system prompt prefilled once).
    measuring = conversations is None
    while (now := time.perf_counter()) - started < (duration if measuring else _WARM_UP_LIMIT):
        handles = engine.step() if engine.has_unfinished_requests() else np.empty(0, np.uint64)
        steps += 1
        computed += engine._prompts.computed_tokens
        now = time.perf_counter()
        for handle in handles.tolist():
            request_id = RequestOutput.get_request_id(handle)
            tokens += 1
            answers[request_id].append(RequestOutput.get_token_id(handle))
            if request_id in arrived:
                if request_id not in first_wave:
                    ttfts.append(now - arrived[request_id])
                elif not measuring:
                    first_wave.discard(request_id)
                    if not first_wave:  # every stream is past its cold start: measure
                        started, tokens, steps, computed = now, 0, 0, 0
                        measuring = True
                del arrived[request_id]
            if RequestOutput.get_finish_reason(handle):
                stream = stream_of.pop(request_id)
                if conversations is None:
                    answers.pop(request_id, None)
                submit(stream)
    elapsed = time.perf_counter() - started
    # With the prefill cost a prompt step lasts longer than a decode step: count in periods.
    step_seconds = itl_ms / 1000 if agents else elapsed / max(1, steps)
    return {
        "ttft_p50_ms": 1000 * _percentile(ttfts, 50),
        "ttft_p99_ms": 1000 * _percentile(ttfts, 99),
        "ttft_p50_steps": _percentile(ttfts, 50) / step_seconds,
        "ttft_p99_steps": _percentile(ttfts, 99) / step_seconds,
        "tokens_per_s": tokens / elapsed,
        "ideal_tokens_per_s": concurrency / step_seconds,
        "requests": len(ttfts),
        "computed_per_request": computed / max(1, len(ttfts)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per interval")
    parser.add_argument("--itl-ms", type=float, default=5.0, help="engine step period")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--intervals", default="1,2,5,10,20,35,70,140")
    parser.add_argument("--agents", action="store_true", help="agent conversations (see above)")
    parser.add_argument("--system-tokens", type=int, default=14_000)
    parser.add_argument("--turn-tokens", type=int, default=300)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=20_000.0)
    parser.add_argument("--prefix-caching", choices=["on", "off", "both"], default="both")
    args = parser.parse_args()
    tokenizer_json = embedded_tokenizer_json()
    modes: list[bool | None] = [None]
    if args.agents:
        modes = {"on": [True], "off": [False], "both": [True, False]}[args.prefix_caching]
    for caching in modes:
        agents = None
        title = f"c={args.concurrency}, DP 1, step {args.itl_ms:g} ms, {args.duration:g} s per row"
        if caching is not None:
            agents = (args.system_tokens, args.turn_tokens, args.prefill_tokens_per_s, caching)
            title += (
                f"; agents ({args.system_tokens}-token system prompt, +{args.turn_tokens} per "
                f"turn), prefill {args.prefill_tokens_per_s:g} tokens/s, prefix cache "
                f"{'on' if caching else 'off'}; steps are {args.itl_ms:g} ms periods"
            )
        print(
            f"\n{title}\n"
            "| interval | TTFT p50 ms (steps) | TTFT p99 ms (steps) | tokens/s | / ideal "
            "| requests | prompt tokens computed per request |\n"
            "|---:|---:|---:|---:|---:|---:|---:|"
        )
        for interval in (int(v) for v in args.intervals.split(",")):
            row = run_point(
                interval, args.concurrency, args.duration, args.itl_ms, tokenizer_json, agents
            )
            print(
                f"| {interval} | {row['ttft_p50_ms']:.0f} ({row['ttft_p50_steps']:.1f}) "
                f"| {row['ttft_p99_ms']:.0f} ({row['ttft_p99_steps']:.1f}) "
                f"| {row['tokens_per_s']:.0f} "
                f"| {row['tokens_per_s'] / row['ideal_tokens_per_s']:.3f} "
                f"| {row['requests']:.0f} | {row['computed_per_request']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
