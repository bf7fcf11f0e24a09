#!/usr/bin/env python3
"""Prefill/decode disaggregation against one NORMAL server with the same total DP ranks.

    python bench/disaggregation.py [--runs 3] [--duration 25] [--intervals 70,20,5]

Long prompts mixed with ongoing decodes, as GPUStack's PD benchmark uses them: a closed loop
of --concurrency streams, each request a fresh prompt of about --prompt-tokens tokens (no
prefix to reuse: the prefix cache is off on every server) and --output-tokens streamed tokens
(ignore_eos). smg (the Shepherd Model Gateway, scripts/install-smg.sh) is in front of every
configuration, so both pay the same gateway hop:

- aggregated: one simulated NORMAL server with DP 2 behind `smg launch --worker-urls`, once per
  --intervals value (`--prefill-attempt-interval`; the first is DeepInfer's default, 70);
- disaggregated: a prefill server (DP 1) and a decode server (DP 1) behind `smg launch
  --pd-disaggregation`, which sends the prefill leg (one token) and then the streamed decode
  leg with its `kv_transfer_params`; the decode server pulls the prompt's KV blocks and state
  slot from the prefill server through Mooncake's Transfer Engine over loopback TCP, as many
  bytes as DeepInfer allocates for the real model (--kv-bytes-per-token, default auto: the
  released DeepSeek-V4.1-Flash's 891 bytes a token and about 2.9 MB a sequence).

The simulated engine's cost model: a decode step of B sequences lasts --itl-ms + B x
--itl-ms-per-request (an assumption: a fixed part and a part per sequence), a prompt step its
prompt tokens over --prefill-tokens-per-s, and a NORMAL engine prefills only at DeepInfer's
attempt points, each prompt step stalling every decode of its rank. TTFT runs from the
request's start to its first content token; ITL is every gap between streamed chunks; requests
started in a run's first --warmup seconds are left out. Each configuration runs --runs times
against the same servers; the tables give each metric's mean and range (min-max) over the runs,
then disaggregated over aggregated at the default interval and at the interval best for that
metric, with "better"/"worse" only when the two ranges do not overlap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Gateway, Server, free_port

WORDS = ["lighthouse", "storm", "keeper", "harbour", "signal", "rope", "tide", "lantern", "gull"]
METRICS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")
TITLES = ("TTFT p50", "TTFT p99", "ITL p50", "ITL p99")
#: DeepInfer's default DEEPINFER_PREFILL_ATTEMPT_INTERVAL.
DEFAULT_INTERVAL = 70


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


@dataclass
class Samples:
    """One run's measurements (seconds)."""

    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    failed: int = 0

    def row(self) -> dict[str, float]:
        """The run's percentiles, in ms."""
        if not self.ttft or not self.itl:
            return dict.fromkeys(METRICS, float("nan"))
        return {
            "ttft_p50": _percentile(self.ttft, 50) * 1000,
            "ttft_p99": _percentile(self.ttft, 99) * 1000,
            "itl_p50": _percentile(self.itl, 50) * 1000,
            "itl_p99": _percentile(self.itl, 99) * 1000,
        }


@dataclass
class Configuration:
    """One configuration's runs."""

    name: str
    #: The aggregated server's prefill attempt interval (None: disaggregated).
    interval: int | None = None
    rows: list[dict[str, float]] = field(default_factory=list)
    requests: int = 0
    failed: int = 0
    note: str = ""

    def add(self, samples: Samples) -> None:
        self.rows.append(samples.row())
        self.requests += len(samples.ttft)
        self.failed += samples.failed

    def spread(self, metric: str) -> tuple[float, float, float]:
        """(mean, min, max) of `metric` over the runs."""
        values = [row[metric] for row in self.rows]
        return statistics.fmean(values), min(values), max(values)


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], out: Samples, counted: bool
) -> None:
    started = time.perf_counter()
    first: float | None = None
    last = 0.0
    ttft: float | None = None
    itl: list[float] = []
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
                ttft = now - started
            else:
                itl.append(now - last)
            last = now
    if counted and ttft is not None:
        out.ttft.append(ttft)
        out.itl.extend(itl)


async def _stream_loop(index: int, args: argparse.Namespace, url: str, out: Samples) -> None:
    rng = random.Random(index)
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        while (now := time.perf_counter()) < start + args.duration:
            # About 1.3 tokens a word; a random text has no prefix in common with another.
            words = " ".join(rng.choice(WORDS) for _ in range(int(args.prompt_tokens / 1.3)))
            body: dict[str, Any] = {
                "model": "deepseek-flash",
                "messages": [{"role": "user", "content": f"{index} {words}"}],
                "max_tokens": args.output_tokens,
                "ignore_eos": True,
                "stream": True,
                "thinking": {"type": "disabled"},
            }
            await _stream(client, url, body, out, counted=now >= start + args.warmup)


def _load(args: argparse.Namespace, port: int) -> Samples:
    """One closed-loop run against the gateway on `port`."""
    out = Samples()
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    async def run() -> None:
        await asyncio.gather(*(_stream_loop(i, args, url, out) for i in range(args.concurrency)))

    asyncio.run(run())
    return out


def _common(args: argparse.Namespace) -> tuple[str, ...]:
    model_len = max(8192, args.prompt_tokens + args.output_tokens + 256)
    return (
        "--no-enable-prefix-caching",
        "--max-num-seqs", str(args.concurrency),
        "--max-model-len", str(model_len),
        "--sim-itl-ms", str(args.itl_ms),
        "--sim-itl-ms-per-request", str(args.itl_ms_per_request),
        "--sim-prefill-tokens-per-s", str(args.prefill_tokens_per_s),
    )  # fmt: skip


def _runs(args: argparse.Namespace, config: Configuration, port: int) -> None:
    for run in range(args.runs):
        samples = _load(args, port)
        config.add(samples)
        row = config.rows[-1]
        print(
            f"  {config.name} run {run + 1}/{args.runs}: {len(samples.ttft)} requests, "
            + ", ".join(f"{t} {row[m]:.1f} ms" for t, m in zip(TITLES, METRICS, strict=True)),
            flush=True,
        )


def aggregated(args: argparse.Namespace, interval: int) -> Configuration:
    """The NORMAL server (DP 2) at one prefill attempt interval, behind smg."""
    default = " (DeepInfer's default)" if interval == DEFAULT_INTERVAL else ""
    config = Configuration(f"aggregated, interval {interval}{default}", interval)
    server_args = (*_common(args), "--dp", "2", "--prefill-attempt-interval", str(interval))
    with (
        Server.deepinfer(*server_args) as normal,
        Gateway.smg(["--worker-urls", f"http://127.0.0.1:{normal.port}"], 1) as gateway,
    ):
        _runs(args, config, gateway.port)
    return config


def _pair_secret() -> str:
    """A file holding a fresh secret for the pair to sign its handoffs with."""
    with tempfile.NamedTemporaryFile("w", prefix="pd-secret-", delete=False) as file:
        file.write(secrets.token_hex(32))
    return file.name


def _transfer_note(decode_port: int, requests: int) -> str:
    """What the decode server's /metrics say its pulls moved and took."""
    text = httpx.get(f"http://127.0.0.1:{decode_port}/metrics", timeout=10).text

    def total(name: str) -> float:
        pattern = rf"^deepinfer:{name}(?:_total)?(?:\{{[^}}]*\}})? (\S+)$"
        return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))

    moved, pulls = total("kv_transfer_bytes"), total("kv_transfer_seconds_count")
    seconds = total("kv_transfer_seconds_sum")
    if not pulls:
        return "no KV pulled"
    return (
        f"{pulls:.0f} pulls moved {moved / 2**20:.1f} MiB ({moved / pulls / 2**20:.2f} MiB "
        f"each), {seconds / pulls * 1000:.1f} ms a pull on average; {requests} requests counted"
    )


def disaggregated(args: argparse.Namespace) -> Configuration:
    """A prefill server and a decode server (DP 1 each) behind smg in PD mode."""
    config = Configuration("disaggregated, 1 prefill + 1 decode (smg PD)")
    bootstrap = str(free_port())
    secret = _pair_secret()
    pair = ("--disaggregation-secret-file", secret)
    kv: tuple[str, ...] = ("--sim-kv-bytes-per-token", args.kv_bytes_per_token)
    if args.kv_bytes_per_token == "none":
        kv = ()
    bootstrap_args = ("--disaggregation-bootstrap-port", bootstrap)
    prefill_args = ("--disaggregation-mode", "prefill", *bootstrap_args)
    with ExitStack() as stack:
        stack.callback(os.unlink, secret)
        prefill = stack.enter_context(Server.deepinfer(*_common(args), *pair, *kv, *prefill_args))
        decode = stack.enter_context(
            Server.deepinfer(*_common(args), *pair, *kv, "--disaggregation-mode", "decode")
        )
        workers = [
            "--pd-disaggregation",
            "--prefill", f"http://127.0.0.1:{prefill.port}", bootstrap,
            "--decode", f"http://127.0.0.1:{decode.port}",
        ]  # fmt: skip
        gateway = stack.enter_context(Gateway.smg(workers, 2))
        _runs(args, config, gateway.port)
        config.note = _transfer_note(decode.port, config.requests)
    return config


def _cell(config: Configuration, metric: str) -> str:
    mean, low, high = config.spread(metric)
    return f"{mean:.1f} ({low:.1f}-{high:.1f})"


def print_runs(configs: list[Configuration]) -> None:
    """Each configuration's mean (min-max) over its runs."""
    print("\n| configuration | runs | requests (failed) | " + " | ".join(TITLES) + " |")
    print("|---|---:|---:|" + "---:|" * len(METRICS))
    for config in configs:
        cells = " | ".join(_cell(config, m) for m in METRICS)
        counts = f"{len(config.rows)} | {config.requests} ({config.failed})"
        print(f"| {config.name} | {counts} | {cells} |")
    print("\nms: mean over the runs (min-max)")
    for config in configs:
        if config.note:
            print(f"{config.name}: {config.note}")


def _verdict(pd: Configuration, agg: Configuration, metric: str) -> str:
    """disaggregated / aggregated: ratio of the means, and better/worse when the ranges of
    the runs do not overlap (lower is better for every metric)."""
    mean, low, high = pd.spread(metric)
    agg_mean, agg_low, agg_high = agg.spread(metric)
    verdict = "better" if high < agg_low else "worse" if low > agg_high else "overlap"
    if min(len(pd.rows), len(agg.rows)) < 2:
        verdict = "(one run: no spread)"
    return f"{mean / agg_mean:.2f}x {verdict}"


def print_ratios(pd: Configuration, aggregated_configs: list[Configuration]) -> None:
    """Disaggregated over the default interval and over each metric's best interval."""
    default = aggregated_configs[0]
    print("\n| disaggregated / aggregated | " + " | ".join(TITLES) + " |")
    print("|---|" + "---:|" * len(METRICS))
    cells = " | ".join(_verdict(pd, default, m) for m in METRICS)
    print(f"| at {default.name.removeprefix('aggregated, ')} | {cells} |")
    best_cells = []
    for metric in METRICS:
        best = min(aggregated_configs, key=lambda c: c.spread(metric)[0])
        best_cells.append(f"{_verdict(pd, best, metric)} (vs interval {best.interval})")
    print(f"| at the best interval for each metric | {' | '.join(best_cells)} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=25.0, help="seconds of load per run")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds left out per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per configuration")
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--itl-ms", type=float, default=12.0, help="a decode step's fixed part")
    parser.add_argument(
        "--itl-ms-per-request", type=float, default=0.5, help="a decode step's part per sequence"
    )
    parser.add_argument("--prefill-tokens-per-s", type=float, default=20000.0)
    parser.add_argument(
        "--intervals",
        default="70,20,5",
        help="prefill attempt intervals of the aggregated server (the first is the default row)",
    )
    parser.add_argument(
        "--kv-bytes-per-token", default="auto", help="auto, N, or none (8 bytes of provenance)"
    )
    args = parser.parse_args()
    started = time.monotonic()
    intervals = [int(value) for value in args.intervals.split(",")]
    aggregated_configs = [aggregated(args, interval) for interval in intervals]
    pd = disaggregated(args)
    print_runs([*aggregated_configs, pd])
    print_ratios(pd, aggregated_configs)
    print(f"\n{time.monotonic() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
