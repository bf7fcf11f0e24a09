#!/usr/bin/env python3
"""Agent replay: prefill tokens computed and time to first token per turn, with the prefix
cache on and off, in one run.

    python bench/agent_replay.py [--turns 20] [--concurrency 1,16] [--prefill-tokens-per-s N]
                                 [--state-slots-ratio R]

Replays agent conversations (`bench/agent_conversation.py`: a ~14k-token system prompt, then
200-400 tokens more per turn, half of them tool calls with their results, tools declared)
against two servers on the simulated engine, one with `--enable-prefix-caching` and one with
`--no-enable-prefix-caching`, otherwise alike: DP 1, every step may prefill
(`--prefill-attempt-interval 1`, so that TTFT is the prefill's cost and not the attempt
cadence's), `--sim-ttft-ms 0`, and a prompt step lasting the tokens it computes over
`--prefill-tokens-per-s` (the server's `--sim-prefill-tokens-per-s`). At each concurrency c, c
conversations run at once, each sending its next turn when the last one's answer is complete
(streamed, 16 tokens). Per turn it reports the prompt tokens, the tokens computed (the prompt
less `usage.prompt_tokens_details.cached_tokens`) and TTFT p50 (first content or reasoning
chunk) with and without the cache, and their ratios, then the same over turns 2 to N.
`--state-slots-ratio` sets both servers' DEEPINFER_NUM_STATE_SLOTS_RATIO (state slots per
running request; DeepInfer's default 1.2): each running conversation needs a slot, a snapshot
of its prompt and its last turn's entry.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_conversation import TOOL, conversation_turns
from harness import Server

ANSWER_TOKENS = 16


async def stream_turn(
    client: httpx.AsyncClient, messages: list[dict[str, Any]]
) -> dict[str, float]:
    """One streamed request: its TTFT and its usage."""
    body = {
        "model": "deepseek-flash",
        "messages": messages,
        "tools": [TOOL],
        "max_tokens": ANSWER_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            delta = chunk["choices"][0].get("delta", {}) if chunk.get("choices") else {}
            if first is None and (delta.get("content") or delta.get("reasoning_content")):
                first = time.perf_counter()
    prompt = usage["prompt_tokens"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "ttft": (first or time.perf_counter()) - started,
        "prompt": prompt,
        "computed": prompt - cached,
    }


async def _conversation(port: int, seed: int, turns: int) -> list[dict[str, float]]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        return [await stream_turn(client, messages) for messages in conversation_turns(seed, turns)]


async def _replay(
    port: int, concurrency: int, turns: int, seeds: int
) -> list[list[dict[str, float]]]:
    """Per turn, one result per conversation."""
    results = await asyncio.gather(
        *(_conversation(port, seeds + n, turns) for n in range(concurrency))
    )
    return [[conversation[turn] for conversation in results] for turn in range(turns)]


def _server(caching: bool, concurrency: int, rate: float) -> Server:
    return Server.deepinfer(
        "--enable-prefix-caching" if caching else "--no-enable-prefix-caching",
        "--max-num-seqs",
        str(max(16, concurrency)),
        "--prefill-attempt-interval",
        "1",
        "--sim-ttft-ms",
        "0",
        "--sim-prefill-tokens-per-s",
        str(rate),
        "--max-model-len",
        "32768",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=20_000,
        help="the simulated prefill rate of both servers (a faster one shortens the run; the "
        "ratios hold)",
    )
    parser.add_argument("--state-slots-ratio", type=float, help="DEEPINFER_NUM_STATE_SLOTS_RATIO")
    args = parser.parse_args()
    if args.state_slots_ratio is not None:
        os.environ["DEEPINFER_NUM_STATE_SLOTS_RATIO"] = str(args.state_slots_ratio)
    slots = os.environ.get("DEEPINFER_NUM_STATE_SLOTS_RATIO", "1.2")
    for number, concurrency in enumerate(int(c) for c in args.concurrency.split(",")):
        measured = {}
        for caching in (True, False):
            with _server(caching, concurrency, args.prefill_tokens_per_s) as server:
                # Distinct conversations for each concurrency; the same ones with and without.
                seeds = 1000 * (number + 1)
                measured[caching] = asyncio.run(
                    _replay(server.port, concurrency, args.turns, seeds)
                )
        print(
            f"\nc={concurrency}, {args.turns} turns, prefill {args.prefill_tokens_per_s:g} "
            f"tokens/s, state slots {slots} per running request, TTFT p50 in ms\n"
            "| turn | prompt | computed (cache on) | computed (off) | ratio | TTFT on | TTFT off "
            "| ratio |\n|---:|---:|---:|---:|---:|---:|---:|---:|"
        )
        for turn in range(args.turns):
            on, off = measured[True][turn], measured[False][turn]
            prompt = statistics.mean(r["prompt"] for r in on)
            computed_on = sum(r["computed"] for r in on) / len(on)
            computed_off = sum(r["computed"] for r in off) / len(off)
            ttft_on = statistics.median(r["ttft"] for r in on) * 1e3
            ttft_off = statistics.median(r["ttft"] for r in off) * 1e3
            print(
                f"| {turn + 1} | {prompt:.0f} | {computed_on:.0f} | {computed_off:.0f} "
                f"| {computed_on / computed_off:.3f} | {ttft_on:.0f} | {ttft_off:.0f} "
                f"| {ttft_on / ttft_off:.3f} |"
            )
        later_on = [r for turn in measured[True][1:] for r in turn]
        later_off = [r for turn in measured[False][1:] for r in turn]
        computed_ratio = sum(r["computed"] for r in later_on) / sum(
            r["computed"] for r in later_off
        )
        ttft_ratio = statistics.median(r["ttft"] for r in later_on) / statistics.median(
            r["ttft"] for r in later_off
        )
        print(
            f"turns 2-{args.turns}: computed prefill tokens, cache on / off = "
            f"{computed_ratio:.3f}; TTFT p50 on / off = {ttft_ratio:.3f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
