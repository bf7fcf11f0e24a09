#!/usr/bin/env python3
"""Batches fill idle capacity: an interactive client's TTFT with and without a batch running.

    python bench/batch_ttft.py [--lines 1000] [--requests 30] [--max-num-seqs 8]
        [--prompt-words N]

One simulated server (DP 1, --max-num-seqs 8, 10 ms steps, an SQLite store in a temporary
directory). The interactive client sends one streaming chat at a time (16 tokens) and records
its time to first token (the first chunk with text). It is measured idle, then while a batch of
--lines chat requests (64 tokens each) runs: the batch is uploaded and created with the openai
client, and the second measurement starts once the server is answering batch lines. Printed: the
TTFT p50 of each phase, their ratio, and the batch lines answered during the second phase (that
the batch was running). One run, one server. A benchmark, not a test: nothing asserts.

The interactive prompt is "hi" by default: its prompt step lasts one engine step, so a request
that arrives while a batch runs waits for the step in progress (half a step on average) on any
step-synchronous engine. `--prompt-words N` sends a prompt of about N tokens instead, whose
prompt step lasts its tokens over the simulated engine's default prefill rate
(`--sim-prefill-tokens-per-s`), as a real prompt's does.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Server

MODEL = "deepseek-flash"


def _chat(tokens: int, stream: bool, prompt: str = "hi") -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "thinking": {"type": "disabled"},
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": stream,
    }


async def _ttft(client: httpx.AsyncClient, prompt: str) -> float:
    """Seconds from sending to the first chunk with text; the stream is read to its end."""
    start = time.perf_counter()
    first = None
    body = _chat(16, True, prompt)
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data:") and '"content"' in line:
                choices = json.loads(line[5:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    first = time.perf_counter() - start
    assert first is not None
    return first


async def _p50(port: int, count: int, prompt: Callable[[], str]) -> float:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        return statistics.median([await _ttft(client, prompt()) for _ in range(count)])


def _answered(client: openai.OpenAI, batch_id: str) -> int:
    counts = client.batches.retrieve(batch_id).request_counts
    assert counts is not None
    return counts.completed + counts.failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=30, help="interactive requests a phase")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--itl-ms", type=float, default=10.0)
    parser.add_argument(
        "--prompt-words",
        type=int,
        default=0,
        help="an interactive prompt of about this many tokens (distinct words; 0: 'hi')",
    )
    args = parser.parse_args()
    state = tempfile.mkdtemp()
    common = [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--sim-ttft-ms",
        str(args.itl_ms),
        "--sim-itl-ms",
        str(args.itl_ms),
        "--prefill-attempt-interval",
        "1",
        "--prefill-any-attempt-interval",
        "1",
        "--state-dir",
        state,
        "--no-grammar-warmup",
    ]
    # Distinct per request (a counter first), so that no prefix cache shortens the prompt step.
    words = " ".join(f"w{n % 997}" for n in range(args.prompt_words))
    prompts = itertools.count()

    def prompt() -> str:
        return f"{next(prompts)} {words}" if words else "hi"

    with Server.deepinfer(*common) as server:
        asyncio.run(_p50(server.port, 3, prompt))  # warm-up
        probe = httpx.post(
            f"http://127.0.0.1:{server.port}/v1/chat/completions",
            json=_chat(1, False, prompt()),
            timeout=600,
        )
        prompt_tokens = probe.json()["usage"]["prompt_tokens"]
        idle = asyncio.run(_p50(server.port, args.requests, prompt))
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused")
        lines = [
            {
                "custom_id": f"line-{n}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": _chat(64, False),
            }
            for n in range(args.lines)
        ]
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        upload = client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        while _answered(client, batch.id) == 0:
            time.sleep(0.05)  # polling the batch, as its clients do
        before = _answered(client, batch.id)
        busy = asyncio.run(_p50(server.port, args.requests, prompt))
        during = _answered(client, batch.id) - before
        client.batches.cancel(batch.id)
    print(
        f"interactive TTFT p50, idle vs a {args.lines}-line batch running "
        f"(--max-num-seqs {args.max_num_seqs}, {args.itl_ms:g} ms steps, interactive prompts "
        f"of {prompt_tokens} tokens)"
    )
    print(f"{'idle ms':>8} {'batch ms':>9} {'ratio':>6} {'batch lines answered meanwhile':>31}")
    print(f"{idle * 1000:>8.1f} {busy * 1000:>9.1f} {busy / idle:>6.2f} {during:>31}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
