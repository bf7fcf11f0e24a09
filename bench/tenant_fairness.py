#!/usr/bin/env python3
"""Fair admission: a light tenant's TTFT while a heavy tenant saturates the server.

    python bench/tenant_fairness.py [--heavy 48] [--light-requests 20] [--max-num-seqs 8]

A simulated server (DP 1, --max-num-seqs 8, 10 ms steps) with two API keys. The light tenant
sends one streaming chat at a time (16 tokens) and records its time to first token; the heavy
tenant keeps --heavy streams of 256 tokens each going (a new one as soon as one ends), six times
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
(docs/operations/prefill-cadence.md), which would hide what admission does. One run, one server
per row.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
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


async def _ttft(client: httpx.AsyncClient, key: str, tokens: int) -> float:
    """Seconds from sending to the first content chunk; the stream is read to its end."""
    start = time.perf_counter()
    first = None
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream(
        "POST", "/v1/chat/completions", json=_body(tokens), headers=headers
    ) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and line.startswith("data:") and '"content"' in line:
                first = time.perf_counter() - start
    assert first is not None
    return first


async def _light(client: httpx.AsyncClient, key: str, count: int) -> float:
    """The light tenant's TTFT p50 over `count` requests sent one after another."""
    return statistics.median([await _ttft(client, key, 16) for _ in range(count)])


async def _row(port: int, heavy_key: str, args: argparse.Namespace) -> tuple[float, float]:
    limits = httpx.Limits(max_connections=args.heavy + 4)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits
    ) as client:
        await _light(client, LIGHT_KEY, 3)  # warm-up
        idle = await _light(client, LIGHT_KEY, args.light_requests)
        stop = asyncio.Event()
        started = asyncio.Event()
        running = 0

        async def heavy_stream() -> None:
            nonlocal running
            while not stop.is_set():
                running += 1
                if running >= args.heavy:
                    started.set()
                await _ttft(client, heavy_key, 256)
                running -= 1

        streams = [asyncio.create_task(heavy_stream()) for _ in range(args.heavy)]
        await started.wait()
        await asyncio.sleep(args.warm_up)  # the heavy tenant's streams fill the slots
        saturated = await _light(client, LIGHT_KEY, args.light_requests)
        stop.set()
        for stream in streams:
            stream.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
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
            idle, saturated = asyncio.run(_row(server.port, heavy_key, args))
        print(f"{name:<24} {idle * 1000:>8.1f} {saturated * 1000:>13.1f} {saturated / idle:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
