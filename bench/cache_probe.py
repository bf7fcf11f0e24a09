#!/usr/bin/env python3
"""Cache probe: what a second API key learns about the first key's conversation, with
`--prefix-cache-scope key` (the default) and `global`, in one run.

    python bench/cache_probe.py [--trials 8] [--prefill-tokens-per-s N]

Per scope, one simulated server with two API keys and the prefix cache on (DP 1,
`--prefill-attempt-interval 1`, `--sim-ttft-ms 0`, a prompt step lasting the tokens it computes
over `--prefill-tokens-per-s`). Each trial takes a new agent conversation
(`bench/agent_conversation.py`: a ~14k-token system prompt, a few hundred tokens per turn): key
1 sends its first turn; key 2 then sends its second turn twice, a right guess (exactly key 1's
first turn, then one more) and a wrong one (the same with one character of the first user
message changed); key 1 finally sends the right guess itself. Each request streams 16 tokens.
Reported per scope: key 2's cached tokens and TTFT p50 for each guess and the ratio right /
wrong (1 when the probe tells nothing), and key 1's own next turn against the wrong guess (what
the cache still saves the key that sent the conversation).
"""

from __future__ import annotations

import argparse
import asyncio
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
KEYS = ("probe-key-one", "probe-key-two")


async def _send(port: int, key: str, messages: list[dict[str, Any]]) -> tuple[float, int]:
    """One streamed request: its TTFT and its cached prompt tokens."""
    body = {
        "model": "deepseek-flash",
        "messages": messages,
        "tools": [TOOL],
        "max_tokens": ANSWER_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        started = time.perf_counter()
        first: float | None = None
        usage: dict[str, Any] = {}
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers=headers
        ) as response:
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
    return (first or time.perf_counter()) - started, usage["prompt_tokens_details"]["cached_tokens"]


def _wrong(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same conversation with one character of its first user message changed."""
    changed = [dict(message) for message in messages]
    user = next(m for m in changed if m["role"] == "user")
    text = str(user["content"])
    user["content"] = ("X" if text[0] != "X" else "Y") + text[1:]
    return changed


async def _trials(port: int, trials: int) -> dict[str, list[tuple[float, int]]]:
    measured: dict[str, list[tuple[float, int]]] = {"right": [], "wrong": [], "own": []}
    for seed in range(trials):
        first, second = conversation_turns(5000 + seed, 2)
        await _send(port, KEYS[0], first)
        measured["right"].append(await _send(port, KEYS[1], second))
        measured["wrong"].append(await _send(port, KEYS[1], _wrong(second)))
        measured["own"].append(await _send(port, KEYS[0], second))
    return measured


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=20_000)
    args = parser.parse_args()
    print(
        f"{args.trials} conversations per scope, prefill {args.prefill_tokens_per_s:g} "
        "tokens/s, TTFT p50 in ms\n"
        "| scope | key 2 cached (right / wrong) | key 2 TTFT right | key 2 TTFT wrong | ratio "
        "| key 1 own next turn TTFT | ratio to wrong |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for scope in ("key", "global"):
        with Server.deepinfer(
            "--api-key",
            KEYS[0],
            "--api-key",
            KEYS[1],
            "--prefix-cache-scope",
            scope,
            "--enable-prefix-caching",
            "--prefill-attempt-interval",
            "1",
            "--sim-ttft-ms",
            "0",
            "--sim-prefill-tokens-per-s",
            str(args.prefill_tokens_per_s),
            "--max-model-len",
            "32768",
        ) as server:
            measured = asyncio.run(_trials(server.port, args.trials))
        ttft = {
            name: statistics.median(t for t, _ in runs) * 1e3 for name, runs in measured.items()
        }
        cached = {name: statistics.mean(c for _, c in runs) for name, runs in measured.items()}
        print(
            f"| {scope} | {cached['right']:.0f} / {cached['wrong']:.0f} | {ttft['right']:.0f} "
            f"| {ttft['wrong']:.0f} | {ttft['right'] / ttft['wrong']:.3f} | {ttft['own']:.0f} "
            f"| {ttft['own'] / ttft['wrong']:.3f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
