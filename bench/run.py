#!/usr/bin/env python3
"""deepinfer-server benchmarks on the simulated engine, all measured in one run.

    python bench/run.py [--duration SECONDS] [--write-results bench/RESULTS.md]

1. Frontend ceiling: streamed tokens/s at --sim-itl-ms 0 --sim-ttft-ms 0, 256 tokens per
   request (ignore_eos), concurrency 32 and 128, DP 1 and 2, beside a raw ASGI app on the same
   uvicorn stack streaming the same number of OpenAI-shaped chunks, and the ratio.
2. Coordinator efficiency: --sim-itl-ms 10, 64 streams, DP 2: engine steps/s over the ideal
   100/s, and tokens/s over the ideal.
3. Added latency: TTFT minus --sim-ttft-ms and ITL minus --sim-itl-ms, p50 and p99, at
   concurrency 1 and 64.
4. Non-streaming: requests/s for 16-token completions at concurrency 32.
Load generators run in their own processes, pinned to the last CPU, and their CPU use is
reported beside every row so that a saturated client would show: wrk (C, one thread) for the
throughput scenarios 1 and 4; bench/loadgen.py (asyncio, per-token timestamps) for 2 and 3.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any, TypeVar

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Server, run_client, run_wrk

API_SERVERS = (1, 2)
ROUNDS = 3
#: Tokens per chunk in the realistic scenario's --stream-interval row.
STREAM_INTERVAL = 4
MESSAGES = [{"role": "user", "content": "again"}]


def _body(max_tokens: int, stream: bool = True, usage: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "deepseek-flash",
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
        "thinking": {"type": "disabled"},
    }
    if usage:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def _steps(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("deepinfer:engine_step_seconds_count"):
            rank = line.split('dp_rank="')[1].split('"')[0]
            counts[rank] = float(line.rsplit(" ", 1)[1])
    return counts


def _measure(
    server: Server, body: dict[str, Any], concurrency: int, duration: float, timing: bool = False
) -> dict[str, Any]:
    cpu_before = server.cpu_seconds()
    result = run_client(server.port, body, concurrency, duration, timing=timing)
    cpu_after = server.cpu_seconds()
    elapsed = result["elapsed"]
    result["api_cpu"] = (cpu_after["api"] - cpu_before["api"]) / elapsed
    result["ranks_cpu"] = (cpu_after["ranks"] - cpu_before["ranks"]) / elapsed
    return result


def _wrk_measure(
    server: Server, body: dict[str, Any], concurrency: int, duration: float
) -> dict[str, Any]:
    cpu_before = server.cpu_seconds()
    result = run_wrk(server.port, body, concurrency, duration)
    cpu_after = server.cpu_seconds()
    result["api_cpu"] = (cpu_after["api"] - cpu_before["api"]) / result["elapsed"]
    result["ranks_cpu"] = (cpu_after["ranks"] - cpu_before["ranks"]) / result["elapsed"]
    return result


def ceiling(duration: float, rows: list[list[str]]) -> None:
    tokens = 256
    for concurrency in (32, 128):
        with Server.raw_baseline() as baseline:
            raw = _wrk_measure(baseline, _body(tokens), concurrency, duration)
        raw_rate = raw["requests_per_second"] * tokens
        rows.append(
            [
                "1. ceiling",
                f"raw ASGI baseline, c={concurrency}",
                f"{raw_rate:,.0f} tok/s",
                "1.00",
                f"wrk {raw['client_cpu']:.0%} CPU, server {raw['api_cpu']:.0%}; "
                f"errors {raw['errors']}",
            ]
        )
        for dp in (1, 2):
            args = [
                "--sim-itl-ms",
                "0",
                "--sim-ttft-ms",
                "0",
                "--ep",
                str(dp),
                "--dp",
                str(dp),
                "--max-num-seqs",
                str(concurrency),
            ]
            with Server.deepinfer(*args) as server:
                ours = _wrk_measure(server, _body(tokens), concurrency, duration)
            rate = ours["requests_per_second"] * tokens
            rows.append(
                [
                    "1. ceiling",
                    f"deepinfer-server DP={dp}, c={concurrency}",
                    f"{rate:,.0f} tok/s",
                    f"{rate / raw_rate:.2f}",
                    f"wrk {ours['client_cpu']:.0%} CPU, API {ours['api_cpu']:.0%}, ranks "
                    f"{ours['ranks_cpu']:.0%}; errors {ours['errors']}",
                ]
            )


def coordinator(duration: float, rows: list[list[str]]) -> None:
    args = [
        "--sim-itl-ms",
        "10",
        "--sim-ttft-ms",
        "0",
        "--ep",
        "2",
        "--dp",
        "2",
        "--max-num-seqs",
        "64",
    ]
    with Server.deepinfer(*args) as server:
        before = _steps(server.port)
        started = time.perf_counter()
        result = _measure(server, _body(10_000), 64, duration)
        window = time.perf_counter() - started
        after = _steps(server.port)
    # Requests never finish within the window (10,000 tokens), so every stream runs throughout;
    # the load generator cuts them when --duration ends.
    steps_per_second = min(after[r] - before.get(r, 0) for r in after) / window
    tokens = result["frames"]  # one token per chunk at 10 ms steps
    rows.append(
        [
            "2. coordinator",
            "DP=2, 64 streams, 10 ms steps",
            f"{steps_per_second:.1f} steps/s",
            f"{steps_per_second / 100:.1%} of ideal",
            f"tokens {tokens / result['elapsed']:,.0f}/s = "
            f"{tokens / result['elapsed'] / 6400:.1%} of 6,400/s; "
            f"client {result['client_cpu']:.0%}",
        ]
    )


def _generation_tokens(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("deepinfer:generation_tokens_total")
    )


def _paced_run(
    server: Server, body: dict[str, Any], streams: int, duration: float
) -> dict[str, Any]:
    user_before, system_before = server.http_cpu_times()
    all_before = sum(server.cpu_seconds().values())
    result = run_client(server.port, body, streams, duration, frame_gaps=True)
    user_after, system_after = server.http_cpu_times()
    result["http_user_seconds"] = user_after - user_before
    result["http_cpu_seconds"] = result["http_user_seconds"] + system_after - system_before
    others = sum(server.cpu_seconds().values()) - all_before - result["http_cpu_seconds"]
    result["other_cpu"] = others / result["elapsed"]
    return result


def realistic(duration: float, rows: list[list[str]]) -> None:
    """The HTTP processes' CPU per token at a realistic decode cadence, against the paced floor
    (bench/paced_floor.py: one ticker writing a pre-built chunk to every stream each tick).

    256 streams of 200 text tokens (ignore_eos), 10 ms engine steps with one token per step on
    DP=2: 25,600 tokens/s offered. CPU is read from /proc for every process listening on the
    port. DeepInfer's default prefill cadence applies: new streams wait for an attempt point
    and prompt steps decode nothing, so the engine delivers somewhat less than offered."""
    streams, tokens, tick_ms = 256, 200, 10.0
    offered = streams * 1000 / tick_ms
    body = _body(tokens)
    # The simulated model echoes the user's message: a long one makes every token text (a
    # short one would be followed by EOS tokens, which ignore_eos streams as empty chunks).
    body["messages"] = [{"role": "user", "content": " ".join(["again"] * (tokens + 50))}]
    base_label = f"DP=2, {streams} streams, {tick_ms:g} ms steps"
    # (row label, extra server options): one HTTP process, several, and fewer larger chunks.
    configurations = [
        (base_label, []),
        *(
            (f"{base_label}, --api-server-count {n}", ["--api-server-count", str(n)])
            for n in API_SERVERS
            if n > 1
        ),
        (
            f"{base_label}, --stream-interval {STREAM_INTERVAL}",
            ["--stream-interval", str(STREAM_INTERVAL)],
        ),
    ]
    floor_runs: list[tuple[float, dict[str, Any]]] = []
    runs: dict[str, list[tuple[float, float, dict[str, Any]]]] = {
        label: [] for label, _ in configurations
    }
    # Rounds alternate the floor and each configuration, and the median round is reported:
    # CPU per token moves with whatever else the machine runs.
    for _ in range(ROUNDS):
        with Server.paced_floor(tick_ms) as floor:
            base = _paced_run(floor, body, streams, duration)
        floor_us = base["http_cpu_seconds"] / base["frames"] * 1e6
        floor_runs.append((floor_us, base))
        for label, extra in configurations:
            args = [
                "--sim-itl-ms",
                str(tick_ms),
                "--sim-ttft-ms",
                "0",
                "--dp",
                "2",
                "--ep",
                "2",
                "--max-num-seqs",
                str(streams // 2),
                *extra,
            ]
            with Server.deepinfer(*args) as server:
                generated = _generation_tokens(server.port)
                result = _paced_run(server, body, streams, duration)
                result["generated"] = _generation_tokens(server.port) - generated
            us = result["http_cpu_seconds"] / result["generated"] * 1e6
            runs[label].append((us / floor_us, us, result))
    floor_us, base = _median(floor_runs)
    rows.append(
        [
            "5. realistic cadence",
            f"paced floor, {streams} streams, {tick_ms:g} ms ticks",
            f"{floor_us:.1f} µs CPU/token ({_user_system(base, base['frames'])})",
            "1.00",
            f"{base['frames'] / base['elapsed']:,.0f} of {offered:,.0f} tok/s offered; ITL p99 "
            f"{_percentile(base['itl'], 99) * 1000:.1f} ms; client {base['client_cpu']:.0%}; "
            f"median of {ROUNDS}",
        ]
    )
    for label, _ in configurations:
        ratio, us, result = _median(runs[label])
        rows.append(
            [
                "5. realistic cadence",
                label,
                f"{us:.1f} µs CPU/token ({_user_system(result, result['generated'])})",
                f"{ratio:.2f}",
                f"{result['generated'] / result['elapsed']:,.0f} of {offered:,.0f} tok/s offered; "
                f"ITL p99 {_percentile(result['itl'], 99) * 1000:.1f} ms; HTTP CPU "
                f"{result['http_cpu_seconds'] / result['elapsed']:.0%}, ranks "
                f"{result['other_cpu']:.0%}; client {result['client_cpu']:.0%}; ratios "
                + ", ".join(f"{r:.2f}" for r, _, _ in runs[label]),
            ]
        )


def _user_system(result: dict[str, Any], tokens: float) -> str:
    """A run's HTTP CPU per token split into user and system (kernel) time: system time is
    mostly the socket writes (and, for deepinfer-server, reading the ranks' reports)."""
    user_us = result["http_user_seconds"] / tokens * 1e6
    system_us = (result["http_cpu_seconds"] - result["http_user_seconds"]) / tokens * 1e6
    return f"user {user_us:.1f}, system {system_us:.1f}"


_T = TypeVar("_T", bound=tuple[Any, ...])


def _median(runs: list[_T]) -> _T:
    """The run whose first element is the median (the lower one of an even count)."""
    return sorted(runs, key=lambda run: run[0])[(len(runs) - 1) // 2]


def latency(duration: float, rows: list[list[str]]) -> None:
    """With DeepInfer's zero-overhead scheduling (the default) a request's second token comes
    two steps after its first; that gap is the engine's, so the server's own added latency is
    also measured with --sim-disable-zos. Prompts may be prefilled at every step
    (--prefill-attempt-interval 1): the wait for DeepInfer's attempt points is the engine's too
    (bench/prefill_cadence.py measures it)."""
    ttft_ms, itl_ms = 20.0, 10.0
    for zos in (True, False):
        args = ["--sim-ttft-ms", str(ttft_ms), "--sim-itl-ms", str(itl_ms), "--max-num-seqs", "64"]
        args += ["--prefill-attempt-interval", "1"]
        if not zos:
            args.append("--sim-disable-zos")
        with Server.deepinfer(*args) as server:
            for concurrency in (1, 64):
                result = _measure(server, _body(64, usage=True), concurrency, duration, timing=True)
                added_ttft = [t * 1000 - ttft_ms for t in result["ttft"]]
                added_itl = [t * 1000 - itl_ms for t in result["itl"]]
                rows.append(
                    [
                        "3. latency",
                        f"c={concurrency}, {'ZOS on (engine default)' if zos else 'ZOS off'}",
                        f"TTFT +{_percentile(added_ttft, 50):.2f} / "
                        f"+{_percentile(added_ttft, 99):.2f} ms",
                        f"ITL +{_percentile(added_itl, 50):.2f} / "
                        f"+{_percentile(added_itl, 99):.2f} ms",
                        f"p50 / p99 added; {len(result['ttft'])} requests, "
                        f"{len(result['itl'])} gaps; client {result['client_cpu']:.0%}",
                    ]
                )


def ttft(duration: float, rows: list[list[str]]) -> None:
    """Added TTFT at concurrency 1, from many short requests: TTFT minus --sim-ttft-ms, the
    prompt prefilled at the first step (--prefill-attempt-interval 1).

    The baseline is the ideal server in the same run: the raw ASGI app writing its first chunk
    exactly --sim-ttft-ms after the body (bench/raw_asgi.py --first-token-ms), whose added time
    is only the HTTP stack, loopback and the client. What deepinfer-server adds is its TTFT
    over that baseline's. Rounds alternate the baseline and the server, and the samples of all
    rounds are pooled."""
    ttft_ms = 20.0
    samples: dict[str, list[float]] = {"ideal": [], "ZOS off": [], "ZOS on (engine default)": []}
    clients: dict[str, list[float]] = {label: [] for label in samples}
    round_seconds = max(duration / 2, 3.0)
    for _ in range(ROUNDS):
        with Server.raw_baseline(first_token_ms=ttft_ms) as baseline:
            # Its first frame is the first token: no usage to count tokens by.
            ideal = run_client(baseline.port, _body(2), 1, round_seconds, frame_gaps=True)
        samples["ideal"] += [t * 1000 - ttft_ms for t in ideal["ttft"]]
        clients["ideal"].append(ideal["client_cpu"])
        for zos in (False, True):
            label = "ZOS on (engine default)" if zos else "ZOS off"
            args = ["--sim-ttft-ms", str(ttft_ms), "--sim-itl-ms", "10"]
            args += ["--prefill-attempt-interval", "1"]
            if not zos:
                args.append("--sim-disable-zos")
            with Server.deepinfer(*args) as server:
                result = _measure(server, _body(2, usage=True), 1, round_seconds, timing=True)
            samples[label] += [t * 1000 - ttft_ms for t in result["ttft"]]
            clients[label].append(result["client_cpu"])
    ideal_p50 = _percentile(samples["ideal"], 50)
    for label, added in samples.items():
        is_ideal = label == "ideal"
        p50 = _percentile(added, 50)
        rows.append(
            [
                "6. TTFT",
                "ideal server (raw ASGI, first chunk 20 ms after the body), c=1"
                if is_ideal
                else f"c=1, 2-token answers, {label}",
                f"+{p50:.2f} ms p50"
                + ("" if is_ideal else f" (+{p50 - ideal_p50:.2f} over ideal)"),
                f"+{_percentile(added, 90):.2f} / +{_percentile(added, 99):.2f} ms p90 / p99",
                f"{len(added)} requests in {ROUNDS} alternating rounds; client "
                f"{max(clients[label]):.0%}",
            ]
        )


def non_streaming(duration: float, rows: list[list[str]]) -> None:
    with Server.deepinfer(
        "--sim-itl-ms", "0", "--sim-ttft-ms", "0", "--max-num-seqs", "32"
    ) as server:
        result = _wrk_measure(server, _body(16, stream=False), 32, duration)
    rows.append(
        [
            "4. non-streaming",
            "16 tokens, c=32",
            f"{result['requests_per_second']:,.0f} req/s",
            "",
            f"wrk {result['client_cpu']:.0%} CPU, API {result['api_cpu']:.0%}, ranks "
            f"{result['ranks_cpu']:.0%}; errors {result['errors']}",
        ]
    )


def render(rows: list[list[str]]) -> str:
    header = ["scenario", "configuration", "result", "ratio / detail", "notes"]
    table = [header, ["---"] * len(header), *rows]
    return "\n".join("| " + " | ".join(row) + " |" for row in table)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per measurement")
    parser.add_argument("--write-results", type=Path, help="also write a RESULTS.md here")
    parser.add_argument(
        "--only",
        choices=["ceiling", "coordinator", "latency", "non-streaming", "realistic", "ttft"],
    )
    args = parser.parse_args()
    rows: list[list[str]] = []
    scenarios = {
        "ceiling": ceiling,
        "coordinator": coordinator,
        "latency": latency,
        "non-streaming": non_streaming,
        "realistic": realistic,
        "ttft": ttft,
    }
    for name, scenario in scenarios.items():
        if args.only in (None, name):
            scenario(args.duration, rows)
            print(render(rows[-1:]).splitlines()[-1], flush=True)
    table = render(rows)
    print("\n" + table)
    if args.write_results:
        machine = (
            f"{platform.machine()}, {len(__import__('os').sched_getaffinity(0))} CPUs, "
            f"Python {platform.python_version()}, {platform.platform()}"
        )
        args.write_results.write_text(
            "# Benchmark results\n\n"
            f"Command: `python bench/run.py --duration {args.duration:g}"
            f" --write-results {args.write_results}`\n\n"
            f"Machine: {machine}\n\n{table}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
