#!/usr/bin/env python3
"""Prefill/decode disaggregation against one NORMAL server, with the same total DP ranks.

    python bench/disaggregation.py [--concurrency 16] [--duration 40] [--prompt-tokens 3000]

Long prompts mixed with ongoing decodes, as GPUStack's PD benchmark uses them: a closed loop
of --concurrency streams, each request a fresh prompt of about --prompt-tokens tokens (no
prefix to reuse: the prefix cache is off on every server) and --output-tokens streamed tokens
(ignore_eos). Aggregated: one simulated NORMAL server with DP 2. Disaggregated: a prefill
server (DP 1) and a decode server (DP 1), the bench playing the gateway as smg does (the
prefill leg, not streamed, one token; then the streamed decode leg with its
kv_transfer_params). Every server uses the simulated engine's cost model: --itl-ms per step,
a prompt step lasting its prompt tokens over --prefill-tokens-per-s, and DeepInfer's prefill
cadence (a NORMAL engine prefills only at its vote points, and a prompt step stalls every
decode of its rank). TTFT runs from the request's start (the prefill leg's, disaggregated) to
its first content token; ITL is every gap between streamed chunks. One run; the ratios are
disaggregated over aggregated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Server, free_port

WORDS = [
    "lighthouse",
    "storm",
    "keeper",
    "harbour",
    "signal",
    "rope",
    "tide",
    "lantern",
    "gull",
    "cliff",
    "wave",
]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


class Results:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.failed = 0


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], started: float, out: Results
) -> None:
    first: float | None = None
    last = 0.0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            out.failed += 1
            await response.aread()
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not chunk.get("choices") or not chunk["choices"][0]["delta"].get("content"):
                continue
            now = time.perf_counter()
            if first is None:
                first = now
                out.ttft.append(now - started)
            else:
                out.itl.append(now - last)
            last = now


async def _stream_loop(
    index: int, args: argparse.Namespace, urls: tuple[str, str | None], out: Results, end: float
) -> None:
    decode_url, prefill_url = urls
    rng = random.Random(index)
    async with httpx.AsyncClient(timeout=300) as client:
        while time.perf_counter() < end:
            # About 1.3 tokens a word; a random text has no prefix in common with another.
            words = " ".join(rng.choice(WORDS) for _ in range(int(args.prompt_tokens / 1.3)))
            body: dict[str, Any] = {
                "model": "deepseek-flash",
                "messages": [{"role": "user", "content": f"{index} {words}"}],
                "max_tokens": args.output_tokens,
                "ignore_eos": True,
                "thinking": {"type": "disabled"},
            }
            started = time.perf_counter()
            if prefill_url is not None:
                leg = await client.post(prefill_url, json={**body, "max_tokens": 1})
                if leg.status_code != 200:
                    out.failed += 1
                    continue
                body["kv_transfer_params"] = leg.json()["kv_transfer_params"]
            await _stream(client, decode_url, {**body, "stream": True}, started, out)


async def _run(args: argparse.Namespace, urls: tuple[str, str | None]) -> Results:
    out = Results()
    end = time.perf_counter() + args.duration
    await asyncio.gather(*(_stream_loop(i, args, urls, out, end) for i in range(args.concurrency)))
    return out


def _summary(name: str, out: Results) -> dict[str, float]:
    row = {
        "ttft_p50": _percentile(out.ttft, 50),
        "ttft_p99": _percentile(out.ttft, 99),
        "itl_p50": _percentile(out.itl, 50),
        "itl_p99": _percentile(out.itl, 99),
        "itl_max": max(out.itl),
    }
    print(
        f"{name:>14}: {len(out.ttft)} requests, {out.failed} failed; TTFT p50 "
        f"{row['ttft_p50'] * 1000:.0f} ms p99 {row['ttft_p99'] * 1000:.0f} ms; ITL p50 "
        f"{row['itl_p50'] * 1000:.1f} ms p99 {row['itl_p99'] * 1000:.1f} ms max "
        f"{row['itl_max'] * 1000:.0f} ms"
    )
    return row


def _pair_secret() -> str:
    """A file holding a fresh secret for the pair to sign its handoffs with."""
    with tempfile.NamedTemporaryFile("w", prefix="pd-secret-", delete=False) as file:
        file.write(secrets.token_hex(32))
    return file.name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--itl-ms", type=float, default=20.0)
    parser.add_argument("--prefill-tokens-per-s", type=float, default=20000.0)
    args = parser.parse_args()
    common = (
        "--no-enable-prefix-caching",
        "--max-num-seqs",
        str(args.concurrency),
        "--max-model-len",
        "8192",
        "--sim-itl-ms",
        str(args.itl_ms),
        "--sim-prefill-tokens-per-s",
        str(args.prefill_tokens_per_s),
    )
    with Server.deepinfer(*common, "--dp", "2") as normal:
        aggregated = _summary(
            "aggregated",
            asyncio.run(_run(args, (f"http://127.0.0.1:{normal.port}/v1/chat/completions", None))),
        )
    bootstrap = str(free_port())
    pair = ("--disaggregation-secret-file", _pair_secret())
    with (
        Server.deepinfer(
            *common,
            *pair,
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            bootstrap,
        ) as prefill,
        Server.deepinfer(*common, *pair, "--disaggregation-mode", "decode") as decode,
    ):
        urls = (
            f"http://127.0.0.1:{decode.port}/v1/chat/completions",
            f"http://127.0.0.1:{prefill.port}/v1/chat/completions",
        )
        disaggregated = _summary("disaggregated", asyncio.run(_run(args, urls)))
    for key in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "itl_max"):
        print(f"{key}: disaggregated / aggregated = {disaggregated[key] / aggregated[key]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
