#!/usr/bin/env python3
"""Agent sessions over a small KV pool: prompt tokens computed and TTFT with the prefix cache's
host tier on against the GPU-only cache, in one run, repeated.

    python bench/agent_sessions.py [--sessions 16] [--turns 8] [--kv-blocks 400]
                                   [--host-gb 64] [--repeat 2] [--think-s 1.0]

Claude Code-like sessions (`bench/agent_conversation.py` with one shared system prompt of
`--system-tokens`, then turns of 200-400 tokens, half of them tool calls with their results) run
concurrently against two servers on the simulated engine that differ only in
`--kv-offload-host-gb` (0: the GPU-only prefix cache; `--host-gb`: the host tier). Each session
sends its next turn a think time after the last answer ended (exponential, mean `--think-s`,
seeded: the same draws for both servers). The rank's pool is `--kv-blocks` blocks of 128 tokens,
sized so that the sessions' KV is several times the pool (the table says how many); the host
tier copies DeepSeek-V4.1-Flash's KV blocks and state slot (the simulated engine's default
without a checkpoint) over `--host-bandwidth-gbps`, and a prompt step lasts the tokens it
computes over `--prefill-tokens-per-s`. Per server and repetition it prints the prompt tokens,
the tokens computed (the prompt less usage's cached tokens), TTFT p50 and p99 over every turn
and over turns 2 to N, and the tiers' hit tokens from /metrics; then the ratio of computed
tokens, host tier on / GPU only.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
from pathlib import Path

import httpx

from deepinfer_server.model.kv_block import blocks_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_conversation import conversation_turns
from agent_replay import stream_turn
from harness import Server


async def _session(port: int, seed: int, args: argparse.Namespace) -> list[dict[str, float]]:
    """One session's turns, each after its think time; the first starts within one think."""
    turns = conversation_turns(
        seed, args.turns, system_tokens=args.system_tokens, shared_system=True
    )
    think = random.Random(seed)
    results = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=900) as client:
        await asyncio.sleep(think.uniform(0, args.think_s))
        for messages in turns:
            results.append(await stream_turn(client, messages))
            await asyncio.sleep(think.expovariate(1 / args.think_s) if args.think_s else 0)
    return results


async def _run(
    port: int, args: argparse.Namespace, repetition: int
) -> list[list[dict[str, float]]]:
    seeds = range(1000 * (repetition + 1), 1000 * (repetition + 1) + args.sessions)
    return list(await asyncio.gather(*(_session(port, seed, args) for seed in seeds)))


def _hit_tokens(port: int) -> dict[str, float]:
    """deepinfer:prefix_cache_hit_tokens_total by tier."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    hits = {}
    for line in text.splitlines():
        if line.startswith("deepinfer:prefix_cache_hit_tokens_total{"):
            tier = line.split('tier="', 1)[1].split('"', 1)[0]
            hits[tier] = float(line.rsplit(" ", 1)[1])
    return hits


def _server(args: argparse.Namespace, host_gb: float) -> Server:
    return Server.deepinfer(
        "--enable-prefix-caching",
        "--kv-offload-host-gb",
        str(host_gb),
        "--sim-kv-blocks",
        str(args.kv_blocks),
        "--sim-host-bandwidth-gbps",
        str(args.host_bandwidth_gbps),
        "--sim-prefill-tokens-per-s",
        str(args.prefill_tokens_per_s),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--prefill-attempt-interval",
        "1",
        "--sim-ttft-ms",
        "0",
        "--max-model-len",
        "32768",
    )


def _row(label: str, sessions: list[list[dict[str, float]]], hits: dict[str, float]) -> str:
    every = [turn for session in sessions for turn in session]
    later = [turn for session in sessions for turn in session[1:]]

    def pct(results: list[dict[str, float]], q: int) -> float:
        return statistics.quantiles([r["ttft"] for r in results], n=100)[q - 1] * 1e3

    prompt = sum(r["prompt"] for r in every)
    computed = sum(r["computed"] for r in every)
    return (
        f"| {label} | {prompt:.0f} | {computed:.0f} | {pct(every, 50):.0f} | {pct(every, 99):.0f} "
        f"| {pct(later, 50):.0f} | {pct(later, 99):.0f} | {hits.get('gpu', 0):.0f} "
        f"| {hits.get('host', 0):.0f} |"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=15_000)
    parser.add_argument("--think-s", type=float, default=1.0, help="mean think time (s)")
    parser.add_argument("--kv-blocks", type=int, default=400, help="the rank's KV pool")
    parser.add_argument("--host-gb", type=float, default=64.0)
    parser.add_argument("--host-bandwidth-gbps", type=float, default=50.0)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=20_000)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    return parser


def main() -> int:
    args = _parser().parse_args()
    print(
        f"{args.sessions} sessions x {args.turns} turns, shared system prompt "
        f"{args.system_tokens} tokens, think {args.think_s:g} s (exponential), pool "
        f"{args.kv_blocks} blocks, prefill {args.prefill_tokens_per_s:g} tokens/s, "
        f"host link {args.host_bandwidth_gbps:g} GB/s"
    )
    print(
        "| server | prompt tokens | computed | TTFT p50 ms | p99 | turns 2+ p50 | p99 "
        "| hit tokens gpu | host |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    ratios = []
    for repetition in range(args.repeat):
        computed: dict[str, float] = {}
        # Alternate which server runs first, so that neither always meets a quieter machine.
        order = [("GPU only", 0.0), ("host tier", args.host_gb)]
        for label, host_gb in order if repetition % 2 == 0 else order[::-1]:
            with _server(args, host_gb) as server:
                sessions = asyncio.run(_run(server.port, args, repetition))
                hits = _hit_tokens(server.port)
            print(_row(f"{label} #{repetition + 1}", sessions, hits), flush=True)
            computed[label] = sum(turn["computed"] for s in sessions for turn in s)
            last_prompts = [session[-1]["prompt"] for session in sessions]
        ratios.append(computed["host tier"] / computed["GPU only"])
    kv = sum(blocks_for(int(tokens)) for tokens in last_prompts)
    print(
        f"\nsessions' KV at their last turn: {kv} blocks = {kv / args.kv_blocks:.1f}x the pool; "
        "prompt tokens computed, host tier / GPU only: "
        + ", ".join(f"{ratio:.3f}" for ratio in ratios)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
