#!/usr/bin/env python3
"""Streamed throughput, this checkout against a git revision, and prefix caching's API cost.

1. Throughput A/B: streamed completion tokens/s on the simulated engine at zero latency
   (`--sim-itl-ms 0 --sim-ttft-ms 0`), 256 output tokens per request (`ignore_eos`), DP 1, at
   each `--concurrency`: one server from the `src/` of `--base` (extracted with `git archive`,
   run with it on PYTHONPATH) and one from this checkout. Rounds alternate the two, each side
   first in turn, so the machine's other load falls on both alike; each side's median round,
   the ratio this/base, and the API process's CPU per request and per token.
2. Prefix caching's API cost, this checkout only: a ~3k-token shared system prompt and a
   distinct user turn per request, 16 streamed tokens, `--enable-prefix-caching` against
   `--no-enable-prefix-caching` in alternating rounds at each `--prefix-dp`: the API process's
   CPU per request (µs) of each and the difference, and requests/s. Prompt steps are made
   near-free (`--sim-prefill-tokens-per-s`) so that the request path, not the engine, sets the
   pace with the cache off. The API process's part is the prefix-aware routing, which exists
   only with more than one DP rank (the ranks' own cache is the engine's work); its own work
   per request (the prefix directory's hashing, lookup and record) is also timed in process.

    python bench/throughput_ab.py --base REV [--rounds 3] [--duration 8] [--concurrency 32,128]
        [--prefix-dp 1,2] [--only ab|prefix]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_conversation import conversation_turns
from harness import ROOT, Server, extract_src, run_client

OUTPUT_TOKENS = 256
PREFIX_OUTPUT_TOKENS = 16
SYSTEM_TOKENS = 3_000
#: Replaced by loadgen with a number of its own in every request: the distinct user turn.
MARKER = "@@N@@"
#: DEEPINFER_NUM_STATE_SLOTS_RATIO of the prefix servers: with DeepInfer's 1.2, 32 running
#: requests leave the cache too few state slots to keep the primer's prompt.
STATE_SLOTS_RATIO = 3.0
#: Seconds of load on each server before its measured rounds (imports, first-request caches).
WARM_UP_SECONDS = 2.0


@dataclass
class Side:
    """Where a server's sources come from, and the flags it is started with on every run."""

    name: str
    src: Path
    extra: tuple[str, ...] = ()
    #: DEEPINFER_NUM_STATE_SLOTS_RATIO, when set.
    ratio: float | None = None

    @property
    def env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(self.src)}
        if self.ratio is not None:
            env["DEEPINFER_NUM_STATE_SLOTS_RATIO"] = str(self.ratio)
        return env

    def check(self) -> str:
        """The deepinfer_server this side imports (it must be from `src`); adds
        --no-grammar-warmup when this side's server has the option."""
        probe = "import deepinfer_server; print(deepinfer_server.__file__)"
        imported = subprocess.run(
            [sys.executable, "-c", probe], env=self.env, capture_output=True, text=True, check=True
        ).stdout.strip()
        if not Path(imported).resolve().is_relative_to(self.src.resolve()):
            raise SystemExit(f"{self.name}: imports {imported}, not the sources in {self.src}")
        helped = subprocess.run(
            [sys.executable, "-m", "deepinfer_server", "--help"],
            env=self.env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        # A revision without the option has no background grammar warm-up to turn off.
        if "--no-grammar-warmup" in helped:
            self.extra = (*self.extra, "--no-grammar-warmup")
        return imported


def _ab_body() -> dict[str, Any]:
    return {
        "model": "deepseek-flash",
        "messages": [{"role": "user", "content": "again"}],
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "thinking": {"type": "disabled"},
    }


def _prefix_bodies() -> tuple[dict[str, Any], dict[str, Any]]:
    """The request that primes the cache and the load's request: the load's is the second turn
    of the primer's conversation plus a distinct user message. The engines reuse a finished
    request's whole prompt (DeepInfer's forked-prompt semantics), so a shared system prompt
    alone is never a hit; a conversation's next turn is."""
    system = conversation_turns(0, 1, system_tokens=SYSTEM_TOKENS)[0][0]
    first = {"role": "user", "content": "Read the repository and wait for a task."}
    common = {"model": "deepseek-flash", "thinking": {"type": "disabled"}}
    primer = {**common, "messages": [system, first], "max_tokens": 1}
    task = f"Request {MARKER}: list the files the tests touch."
    messages = [system, first, {"role": "assistant", "content": "Ready."}]
    load = {
        **common,
        "messages": [*messages, {"role": "user", "content": task}],
        "max_tokens": PREFIX_OUTPUT_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    return primer, load


def _measure(
    server: Server,
    body: dict[str, Any],
    concurrency: int,
    duration: float,
    distinct: str | None = None,
) -> dict[str, float]:
    """One round of load: completed requests, their rate, and the API process's CPU."""
    before = server.cpu_seconds()
    result = run_client(server.port, body, concurrency, duration, distinct=distinct)
    after = server.cpu_seconds()
    requests = int(result["requests"])
    elapsed = float(result["elapsed"])
    api = after["api"] - before["api"]
    return {
        "requests": requests,
        "errors": int(result["errors"]),
        "rps": requests / elapsed,
        "api_us_per_request": api / max(requests, 1) * 1e6,
        "api_share": api / elapsed,
        "ranks_share": (after["ranks"] - before["ranks"]) / elapsed,
        "client_share": float(result["client_cpu"]),
    }


@contextmanager
def _servers(configs: dict[str, tuple[Side, list[str]]]) -> Iterator[dict[str, Server]]:
    """One server per named configuration, all running at once, warmed up."""
    with ExitStack() as stack:
        servers = {
            name: stack.enter_context(Server.deepinfer(*args, *side.extra, env=side.env))
            for name, (side, args) in configs.items()
        }
        yield servers


def _alternate(
    servers: dict[str, Server],
    body: dict[str, Any],
    concurrency: int,
    duration: float,
    rounds: int,
    distinct: str | None = None,
    primer: dict[str, Any] | None = None,
) -> dict[str, list[dict[str, float]]]:
    """`rounds` rounds of every server, the order reversed each round, after `primer` (when
    given) and a warm-up."""
    for server in servers.values():
        if primer is not None:
            url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
            httpx.post(url, json=primer, timeout=60).raise_for_status()
        run_client(server.port, body, concurrency, WARM_UP_SECONDS, distinct=distinct)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
    order = list(servers)
    for _ in range(rounds):
        order.reverse()
        for name in order:
            results[name].append(_measure(servers[name], body, concurrency, duration, distinct))
    return results


def _cached_fraction(server: Server) -> float:
    """The share of prompt tokens the server's ranks found in their prefix cache so far."""
    text = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=10).text
    totals = {"queries": 0.0, "hits": 0.0}
    for line in text.splitlines():
        for name in totals:
            if line.startswith(f"deepinfer:prefix_cache_{name}_total"):
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["hits"] / totals["queries"] if totals["queries"] else 0.0


#: Run in a child with a side's sources: the prefix directory's work for one request (hash the
#: prompt's blocks, look them up on every rank, record them), µs, over random prompts of
#: argv[1] tokens sharing all but their last 40.
_DIRECTORY_PROBE = """
import sys, time, numpy as np
from deepinfer_server.coordinator.prefix_directory import PrefixDirectory
tokens, ranks, requests = int(sys.argv[1]), int(sys.argv[2]), 2000
directory = PrefixDirectory(ranks, 65536, 32)
for rank in range(ranks):
    directory.rank_holds(rank, 64)
rng = np.random.default_rng(0)
shared = rng.integers(0, 128000, tokens - 40, dtype=np.int32)
prompts = [
    np.concatenate([shared, rng.integers(0, 128000, 40, dtype=np.int32)]).astype("<i4").tobytes()
    for _ in range(requests)
]
started = time.perf_counter()
for number, prompt in enumerate(prompts):
    hashes = directory.block_hashes(prompt, b"partition")
    directory.held_tokens(hashes)
    directory.record(number % ranks, str(number), hashes)
print((time.perf_counter() - started) / requests * 1e6)
"""


def _directory_us(side: Side, prompt_tokens: int, ranks: int) -> float:
    command = [sys.executable, "-c", _DIRECTORY_PROBE, str(prompt_tokens), str(ranks)]
    done = subprocess.run(command, env=side.env, capture_output=True, text=True, check=True)
    return float(done.stdout)


def _prompt_tokens(server: Server, body: dict[str, Any]) -> int:
    """The prompt tokens of `body` (its marker replaced) as the server counts them."""
    request = json.loads(json.dumps(body).replace(MARKER, "0"))
    request.update(stream=False, max_tokens=1)
    url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    response = httpx.post(url, json=request, timeout=60)
    response.raise_for_status()
    return int(response.json()["usage"]["prompt_tokens"])


def _median(rounds: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def throughput_ab(
    base: Side, this: Side, concurrencies: list[int], args: argparse.Namespace
) -> None:
    """Part 1: streamed tokens/s of `base` and `this`, alternating rounds."""
    print(
        f"\n1. Throughput A/B: streamed tokens/s, {OUTPUT_TOKENS} tokens per request (ignore_eos), "
        f"--sim-itl-ms 0 --sim-ttft-ms 0, DP 1; {args.rounds} alternating rounds of "
        f"{args.duration:g} s, medians"
    )
    print(
        f"{'c':>4} {'side':<5} {'tokens/s':>10} {'API µs/req':>11} {'API µs/tok':>11} "
        f"{'API CPU':>8} {'ranks':>6} {'client':>7} {'errors':>7}"
    )
    for concurrency in concurrencies:
        flags = ["--sim-itl-ms", "0", "--sim-ttft-ms", "0", "--dp", "1", "--ep", "1"]
        flags += ["--max-num-seqs", str(concurrency)]
        configs = {"base": (base, flags), "this": (this, flags)}
        with _servers(configs) as servers:
            results = _alternate(servers, _ab_body(), concurrency, args.duration, args.rounds)
        rates: dict[str, float] = {}
        for name, rounds in results.items():
            rates[name] = _median(rounds, "rps") * OUTPUT_TOKENS
            per_request = _median(rounds, "api_us_per_request")
            print(
                f"{concurrency:>4} {name:<5} {rates[name]:>10,.0f} {per_request:>11,.0f} "
                f"{per_request / OUTPUT_TOKENS:>11.2f} {_median(rounds, 'api_share'):>8.0%} "
                f"{_median(rounds, 'ranks_share'):>6.0%} {_median(rounds, 'client_share'):>7.0%} "
                f"{sum(int(r['errors']) for r in rounds):>7}"
            )
        pairs = zip(results["base"], results["this"], strict=True)
        per_round = ", ".join(f"{t['rps'] / b['rps']:.3f}" for b, t in pairs)
        ratio = rates["this"] / rates["base"]
        print(f"{concurrency:>4} this/base {ratio:.3f} (rounds: {per_round})")


def prefix_cost(this: Side, dps: list[int], concurrency: int, args: argparse.Namespace) -> None:
    """Part 2: the API process's CPU per request with the prefix cache on and off."""
    print(
        f"\n2. Prefix caching's API cost (this checkout): a conversation's second turn "
        f"(~{SYSTEM_TOKENS:,}-token system prompt, first turn cached) + a distinct user message, "
        f"{PREFIX_OUTPUT_TOKENS} streamed tokens, c={concurrency}, --sim-itl-ms 0, prompt steps "
        f"near-free, state slots ratio {STATE_SLOTS_RATIO}; {args.prefix_rounds} alternating "
        f"rounds of {args.duration:g} s, medians; cached: prompt tokens the ranks found in "
        "their cache (primer and warm-up included)"
    )
    print(
        f"{'DP':>3} {'prefix cache':<13} {'requests/s':>11} {'API µs/req':>11} {'API CPU':>8} "
        f"{'ranks':>6} {'client':>7} {'errors':>7} {'cached':>7}"
    )
    for dp in dps:
        flags = ["--sim-itl-ms", "0", "--sim-ttft-ms", "0", "--dp", str(dp), "--ep", str(dp)]
        flags += ["--max-num-seqs", str(concurrency), "--prefill-attempt-interval", "1"]
        flags += ["--sim-prefill-tokens-per-s", "1000000000"]
        configs = {
            "on": (this, [*flags, "--enable-prefix-caching"]),
            "off": (this, [*flags, "--no-enable-prefix-caching"]),
        }
        with _servers(configs) as servers:
            primer, load = _prefix_bodies()
            results = _alternate(
                servers, load, concurrency, args.duration, args.prefix_rounds, MARKER, primer
            )
            cached = {name: _cached_fraction(server) for name, server in servers.items()}
            prompt_tokens = _prompt_tokens(servers["off"], load)
        for name, rounds in results.items():
            print(
                f"{dp:>3} {name:<13} {_median(rounds, 'rps'):>11,.0f} "
                f"{_median(rounds, 'api_us_per_request'):>11,.0f} "
                f"{_median(rounds, 'api_share'):>8.0%} {_median(rounds, 'ranks_share'):>6.0%} "
                f"{_median(rounds, 'client_share'):>7.0%} "
                f"{sum(int(r['errors']) for r in rounds):>7} {cached[name]:>7.0%}"
            )
        differences = [
            on["api_us_per_request"] - off["api_us_per_request"]
            for on, off in zip(results["on"], results["off"], strict=True)
        ]
        print(
            f"{dp:>3} on - off: {statistics.median(differences):+,.0f} µs API CPU per request "
            f"(rounds: {', '.join(f'{d:+,.0f}' for d in differences)})"
        )
        if dp > 1:
            print(
                f"{dp:>3} the prefix directory's own work (in process, {prompt_tokens:,}-token "
                f"prompts): {_directory_us(this, prompt_tokens, dp):,.0f} µs per request"
            )
        else:
            print(f"{dp:>3} (one rank: the API process keeps no prefix directory)")


def _numbers(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="main", help="the git revision to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per round")
    parser.add_argument("--concurrency", type=_numbers, default=[32, 128])
    parser.add_argument("--prefix-dp", type=_numbers, default=[1, 2])
    parser.add_argument("--prefix-concurrency", type=int, default=32)
    parser.add_argument(
        "--prefix-rounds", type=int, default=5, help="rounds of part 2 (its difference is small)"
    )
    parser.add_argument("--only", choices=["ab", "prefix"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        this = Side("this", ROOT / "src")
        cached = Side("this", ROOT / "src", ratio=STATE_SLOTS_RATIO)
        sides = [this]
        if args.only != "prefix":
            revision = subprocess.run(
                ["git", "rev-parse", "--short", args.base],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            sides.insert(0, Side(f"base {revision}", extract_src(args.base, Path(tmp))))
        for side in sides:
            imported = side.check()
            print(f"{side.name}: imports {imported} {' '.join(side.extra)}".rstrip())
        if args.only != "prefix":
            throughput_ab(sides[0], this, args.concurrency, args)
        if args.only != "ab":
            cached.check()
            prefix_cost(cached, args.prefix_dp, args.prefix_concurrency, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
