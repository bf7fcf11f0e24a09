"""The Responses store's cost: the same streamed /v1/responses load with `store: false` (the
stateless path), stored (OpenAI's default `store: true`, SQLite in a temporary state dir), and
background (`background: true`: every event is written to the store before the stream shows it,
one transaction per write taking every event that came while the last one ran).

Alternating rounds on one server (DP=1, 5 ms steps, 32 concurrent streams of a 64-word answer
that the simulated model echoes); prints the median over rounds of the requests/s, the request
latency p50/p99 (the stored stream's last event waits for its write) and the gap between events
p50/p99 (the token path), and the ratio of each to the stateless path's. A benchmark, not a
test: nothing asserts.

    python bench/responses_store.py --duration 8 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import httpx
from harness import Server, run_client

#: 5 ms engine steps; a queue, so that 32 streams over 16 running slots wait instead of 429s.
SERVER = ("--sim-ttft-ms", "5", "--sim-itl-ms", "5", "--max-queued-requests", "64")
PROMPT = " ".join(f"word{index}" for index in range(64))


MODES = ("stateless", "stored", "background")


def _body(mode: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "deepseek-flash",
        "input": PROMPT,
        "stream": True,
    }
    if mode == "stateless":
        body["store"] = False
    if mode == "background":
        body["background"] = True
    return body


def _wait_background_idle(port: int, timeout: float = 120.0) -> None:
    """Until no background response runs: those the last round left (its clients stop at the
    round's end, their generations do not) would slow the next round."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        running = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("deepinfer:background_responses{")
        )
        if running == 0:
            return
        time.sleep(0.2)
    raise TimeoutError("background responses still running")


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _row(result: dict[str, Any]) -> dict[str, float]:
    return {
        "req/s": result["requests"] / result["elapsed"],
        "latency p50 ms": 1000 * _quantile(result["latency"], 0.5),
        "latency p99 ms": 1000 * _quantile(result["latency"], 0.99),
        "event gap p50 ms": 1000 * _quantile(result["itl"], 0.5),
        "event gap p99 ms": 1000 * _quantile(result["itl"], 0.99),
        "errors": float(result["errors"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    rows: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with (
        tempfile.TemporaryDirectory() as state,
        Server.deepinfer(*SERVER, "--state-dir", state) as server,
    ):
        run_client(server.port, _body("stateless"), 4, 2.0, path="/v1/responses")  # warm-up
        for _ in range(args.rounds):
            for name in MODES:
                result = run_client(
                    server.port,
                    _body(name),
                    args.concurrency,
                    args.duration,
                    frame_gaps=True,
                    path="/v1/responses",
                )
                rows[name].append(_row(result))
                if name == "background":
                    _wait_background_idle(server.port)
    keys = list(rows["stateless"][0])
    print("| | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for name, measured in rows.items():
        medians = {key: statistics.median(row[key] for row in measured) for key in keys}
        print(f"| {name} | " + " | ".join(f"{medians[key]:.2f}" for key in keys) + " |")
    for name in MODES[1:]:
        ratios = {
            key: statistics.median(row[key] for row in rows[name])
            / statistics.median(row[key] for row in rows["stateless"])
            for key in keys
            if key != "errors"
        }
        print(f"| {name} / stateless | " + " | ".join(f"{ratios[k]:.3f}" for k in ratios) + " | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
