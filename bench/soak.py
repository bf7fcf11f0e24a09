#!/usr/bin/env python3
"""Memory soak: the API process's RSS before and after a long steady load.

    python bench/soak.py [--seconds 600]

Starts the server on the simulated engine (DP=2, 10 ms steps), warms it up for 30 s, records
the API process's RSS, runs 32 concurrent streaming clients (64-token answers) for --seconds,
records the RSS again, and prints both with the number of requests served.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Server, run_client

BODY = {
    "model": "deepseek-flash",
    "messages": [{"role": "user", "content": "soak"}],
    "max_tokens": 64,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
    "thinking": {"type": "disabled"},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    args = parser.parse_args()
    with Server.deepinfer(
        "--ep",
        "2",
        "--dp",
        "2",
        "--sim-itl-ms",
        "10",
        "--sim-ttft-ms",
        "20",
        "--max-num-seqs",
        "32",
    ) as server:
        warm = run_client(server.port, BODY, 32, 30.0)
        before = server.rss_bytes()
        soak = run_client(server.port, BODY, 32, args.seconds)
        after = server.rss_bytes()
    mib = 1024 * 1024
    print(
        f"warm-up: {warm['requests']} requests; soak: {soak['requests']} requests, "
        f"{soak['errors']} errors in {soak['elapsed']:.0f} s"
    )
    print(
        f"API process RSS: {before / mib:.1f} MiB before, {after / mib:.1f} MiB after "
        f"({(after - before) / mib:+.1f} MiB)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
