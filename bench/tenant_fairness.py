#!/usr/bin/env python3
"""Fair admission: a light tenant's TTFT while a heavy tenant saturates the server.

    python bench/tenant_fairness.py [--heavy 48] [--light-requests 20] [--max-num-seqs 8]

A simulated server (DP 1, --max-num-seqs 8, 10 ms steps) with two API keys. The light tenant
sends one streaming chat at a time (16 tokens) and records its time to first token (the first
chunk with text, not the opening chunk with the role); the heavy tenant, a client process of its
own, keeps --heavy streams of 256 tokens each going (a new one as soon as one ends), six times
the running slots. Each row measures the light tenant's TTFT p50 alone (idle) and with the
heavy tenant saturating, and prints their ratio:

- `one key`: both tenants send with the same key, so admission cannot tell them apart
  (first come, first served, as before fair admission);
- `fair queue`: two keys, `--key-running-share 1`: a freed slot goes to the key running fewest,
  but one key alone may hold every slot;
- `fair + share` (the default): two keys, `--key-running-share 0.75`: one key holds at most 3/4
  of the slots while the other may need one.

Prefill runs at every step (`--prefill-attempt-interval 1`): DeepInfer's default cadence delays
every prompt on a busy server by up to 70 steps whoever sent it
(docs/operations/prefill-cadence.md), which would hide what admission does. The servers skip
the grammar warm-up (`--no-grammar-warmup`): no request here is structured, and the warm-up's
tens of seconds of CPU in the API and rank processes would fall in one phase or the other. One
run, one server per row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from multiprocessing.synchronize import Event
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Server

MODEL = "deepseek-flash"
HEAVY_KEY, LIGHT_KEY = "sk-bench-heavy", "sk-bench-light"


def _body(tokens: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "disabled"},
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }


def _has_text(line: str) -> bool:
    """Whether an SSE line is a chunk with text (the opening chunk's content is empty)."""
    if not line.startswith("data:") or '"content"' not in line:
        return False
    choices = json.loads(line[5:])["choices"]
    return bool(choices and choices[0]["delta"].get("content"))


async def _ttft(client: httpx.AsyncClient, key: str, tokens: int) -> float:
    """Seconds from sending to the first chunk with text; the stream is read to its end."""
    start = time.perf_counter()
    first = None
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream(
        "POST", "/v1/chat/completions", json=_body(tokens), headers=headers
    ) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and _has_text(line):
                first = time.perf_counter() - start
    assert first is not None
    return first


async def _stream(client: httpx.AsyncClient, key: str, tokens: int) -> None:
    """One stream read to its end."""
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream(
        "POST", "/v1/chat/completions", json=_body(tokens), headers=headers
    ) as response:
        response.raise_for_status()
        async for _ in response.aiter_raw():
            pass


async def _light(client: httpx.AsyncClient, key: str, count: int) -> float:
    """The light tenant's TTFT p50 over `count` requests sent one after another."""
    return statistics.median([await _ttft(client, key, 16) for _ in range(count)])


def _heavy(port: int, key: str, streams: int, started: Event) -> None:
    """The heavy tenant (a process of its own): `streams` streams, each followed by the next."""

    async def run() -> None:
        limits = httpx.Limits(max_connections=streams + 4)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits
        ) as client:
            sent = 0

            async def heavy_stream() -> None:
                nonlocal sent
                while True:
                    sent += 1
                    if sent >= streams:
                        started.set()
                    await _stream(client, key, 256)

            await asyncio.gather(*(heavy_stream() for _ in range(streams)))

    asyncio.run(run())


async def _light_phase(port: int, count: int) -> float:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        return await _light(client, LIGHT_KEY, count)


def _row(port: int, heavy_key: str, args: argparse.Namespace) -> tuple[float, float]:
    asyncio.run(_light_phase(port, 3))  # warm-up
    idle = asyncio.run(_light_phase(port, args.light_requests))
    context = multiprocessing.get_context("spawn")
    started = context.Event()
    heavy = context.Process(target=_heavy, args=(port, heavy_key, args.heavy, started))
    heavy.start()
    try:
        started.wait()
        time.sleep(args.warm_up)  # the heavy tenant's streams fill the slots
        saturated = asyncio.run(_light_phase(port, args.light_requests))
    finally:
        heavy.terminate()
        heavy.join()
    return idle, saturated


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heavy", type=int, default=48, help="heavy tenant's concurrent streams")
    parser.add_argument("--light-requests", type=int, default=20)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--itl-ms", type=float, default=10.0)
    parser.add_argument("--warm-up", type=float, default=3.0, help="seconds before measuring")
    args = parser.parse_args()
    keys = Path(tempfile.mkdtemp()) / "keys"
    keys.write_text(f"heavy {HEAVY_KEY}\nlight {LIGHT_KEY}\n")
    common = [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-queued-requests",
        str(args.heavy * 2),
        "--sim-ttft-ms",
        str(args.itl_ms),
        "--sim-itl-ms",
        str(args.itl_ms),
        "--prefill-attempt-interval",
        "1",
        "--prefill-any-attempt-interval",
        "1",
        "--api-key-file",
        str(keys),
        "--no-grammar-warmup",
    ]
    rows = [
        ("one key", LIGHT_KEY, "1"),
        ("fair queue", HEAVY_KEY, "1"),
        ("fair + share (default)", HEAVY_KEY, "0.75"),
    ]
    print(
        f"light tenant TTFT p50, idle vs a heavy tenant's {args.heavy} streams "
        f"(--max-num-seqs {args.max_num_seqs}, {args.itl_ms:g} ms steps)"
    )
    print(f"{'row':<24} {'idle ms':>8} {'saturated ms':>13} {'ratio':>6}")
    for name, heavy_key, share in rows:
        with Server.deepinfer(*common, "--key-running-share", share) as server:
            idle, saturated = _row(server.port, heavy_key, args)
        print(f"{name:<24} {idle * 1000:>8.1f} {saturated * 1000:>13.1f} {saturated / idle:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
