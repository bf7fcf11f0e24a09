#!/usr/bin/env python3
"""Large preparations against another key's requests: latency idle vs contended, in one run.

    python bench/preparation_fairness.py [--light-requests 10] [--heavy 8] [--heavy-mb 4]

A simulated server with two API keys and a Responses store in a temporary state dir. The light
key sends one request at a time and records its latency; the heavy key, a client process of its
own, keeps `--heavy` large requests going (a new one as soon as one ends). Each row measures the
light key's latency p50 alone (idle) and with the heavy key busy, and prints their ratio:

- `tokenize, one key`: the heavy key's requests are `--heavy-mb` MB /tokenize bodies and the
  light key's are 100 KB chats, both sent with the same key (the server's only one), so the
  preparation workers cannot tell them apart (first come, first served, as before the workers
  were fair);
- `tokenize, two keys`: the same with two keys: the workers are taken in turn between keys;
- `conversation turn`: the heavy key's requests are `{"input": "next", "conversation": ID}`
  turns of a stored conversation holding one 3.8 MB item (each a 400, past the context), and
  the light key's a small Responses request: the turn is expanded and prepared off the event
  loop, by the size of what it prepares, not of its few-byte body.

The light key's requests are not stored (`store: false`) and ask for one token. One run, one
server per row; the machine's load shows in both columns alike.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import sys
import tempfile
import time
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Server

MODEL = "deepseek-flash"
HEAVY_KEY, LIGHT_KEY = "sk-bench-heavy", "sk-bench-light"
#: The light key's chat (about 100 KB) and Responses request.
LIGHT_CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "word " * 20_000}],
    "max_tokens": 1,
}
LIGHT_RESPONSE = {"model": MODEL, "input": "hi", "store": False, "max_output_tokens": 1}


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _light(port: int, path: str, body: dict[str, Any], count: int) -> float:
    """The light key's latency p50 over `count` requests sent one after another."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        latencies = []
        for _ in range(count):
            start = time.perf_counter()
            response = await client.post(path, json=body, headers=_headers(LIGHT_KEY))
            response.raise_for_status()
            latencies.append(time.perf_counter() - start)
    return statistics.median(latencies)


def _heavy(port: int, key: str, path: str, body: bytes, streams: int, started: Event) -> None:
    """The heavy key (a process of its own): `streams` requests, each followed by the next."""

    async def run() -> None:
        limits = httpx.Limits(max_connections=streams + 4)
        headers = {**_headers(key), "Content-Type": "application/json"}
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=600, limits=limits
        ) as client:

            async def one_after_another() -> None:
                while True:
                    started.set()
                    await client.post(path, content=body, headers=headers)

            await asyncio.gather(*(one_after_another() for _ in range(streams)))

    asyncio.run(run())


def _row(
    port: int,
    heavy: tuple[str, str, bytes],
    light: tuple[str, dict[str, Any]],
    args: argparse.Namespace,
) -> tuple[float, float]:
    asyncio.run(_light(port, *light, 2))  # warm-up
    idle = asyncio.run(_light(port, *light, args.light_requests))
    context = multiprocessing.get_context("spawn")
    started = context.Event()
    key, path, body = heavy
    process = context.Process(target=_heavy, args=(port, key, path, body, args.heavy, started))
    process.start()
    try:
        started.wait()
        time.sleep(args.warm_up)  # the heavy key's requests reach the server first
        contended = asyncio.run(_light(port, *light, args.light_requests))
    finally:
        process.terminate()
        process.join()
    return idle, contended


def _conversation(port: int) -> str:
    """A conversation of the heavy key holding one 3.8 MB item: its ID."""
    item = {"type": "message", "role": "user", "content": "word " * 760_000}
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        created = client.post(
            "/v1/conversations", json={"items": [item]}, headers=_headers(HEAVY_KEY)
        )
        created.raise_for_status()
        return str(created.json()["id"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heavy", type=int, default=8, help="heavy key's concurrent requests")
    parser.add_argument("--heavy-mb", type=float, default=4.0, help="size of each /tokenize")
    parser.add_argument("--light-requests", type=int, default=10)
    parser.add_argument("--warm-up", type=float, default=2.0, help="seconds before measuring")
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp())
    one_key, two_keys = state / "one-key", state / "two-keys"
    one_key.write_text(f"light {LIGHT_KEY}\n")
    two_keys.write_text(f"heavy {HEAVY_KEY}\nlight {LIGHT_KEY}\n")
    common = ["--max-model-len", "65536", "--state-dir", str(state), "--no-grammar-warmup"]
    words = int(args.heavy_mb * 1024 * 1024 / 5)
    tokenize = f'{{"model": "{MODEL}", "prompt": "{"word " * words}"}}'.encode()
    print(
        f"light key latency p50, idle vs the heavy key's {args.heavy} requests at once "
        f"({args.light_requests} light requests per column)"
    )
    print(f"{'row':<22} {'idle ms':>8} {'contended ms':>13} {'ratio':>6}")
    rows = [
        ("tokenize, one key", LIGHT_KEY, one_key),
        ("tokenize, two keys", HEAVY_KEY, two_keys),
    ]
    for name, heavy_key, key_file in rows:
        with Server.deepinfer(*common, "--api-key-file", str(key_file)) as server:
            heavy = (heavy_key, "/tokenize", tokenize)
            idle, contended = _row(server.port, heavy, ("/v1/chat/completions", LIGHT_CHAT), args)
        print(f"{name:<22} {idle * 1000:>8.1f} {contended * 1000:>13.1f} {contended / idle:>6.2f}")
    with Server.deepinfer(*common, "--api-key-file", str(two_keys)) as server:
        conversation = _conversation(server.port)
        turn = f'{{"model": "{MODEL}", "input": "next", "conversation": "{conversation}"}}'
        heavy = (HEAVY_KEY, "/v1/responses", turn.encode())
        idle, contended = _row(server.port, heavy, ("/v1/responses", LIGHT_RESPONSE), args)
    name = "conversation turn"
    print(f"{name:<22} {idle * 1000:>8.1f} {contended * 1000:>13.1f} {contended / idle:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
