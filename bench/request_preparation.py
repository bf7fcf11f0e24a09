#!/usr/bin/env python3
"""Request preparation, this checkout against a git revision, in one run (no server).

Times each protocol's preparation (`prepare_chat`, `prepare_completion`, `prepare_messages`:
the sampling checks, deepseek-recipe's conversion, prompt encoding and the engine options) of a
typical body carrying sampling fields. The base revision's `src/` is extracted from git; child
processes of both sides alternate round by round, each side first in turn (the machine's load
hits both alike); each side's best round counts, and the ratio this/base is printed per
protocol. `--base HEAD` measures the method's own bias (an A/A run).

    python bench/request_preparation.py [--base main] [--rounds 7] [--requests 300]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from harness import extract_src  # noqa: E402

PROMPT = "Summarise the plot of a long novel about a lighthouse keeper in three sentences. " * 4
_SAMPLING = {"temperature": 0.7, "top_p": 0.95, "top_k": 40, "presence_penalty": 0.0}
BODIES: dict[str, dict[str, Any]] = {
    "chat": {
        "model": "flash",
        "messages": [
            {"role": "system", "content": "You are concise."},
            {"role": "user", "content": PROMPT},
        ],
        "max_tokens": 256,
        "stream": True,
        "seed": 1,
        **_SAMPLING,
    },
    "completions": {"model": "flash", "prompt": PROMPT, "max_tokens": 256, **_SAMPLING},
    "messages": {
        "model": "flash",
        "max_tokens": 256,
        "system": "You are concise.",
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0.7,
        "top_p": 0.95,
        "top_k": 40,
    },
}


def _child(requests: int) -> None:
    """Time each protocol's preparation with the deepinfer_server on PYTHONPATH."""
    from deepinfer_server.model.tokenizer import embedded_tokenizer_json
    from deepinfer_server.protocol.chat.request import prepare_chat
    from deepinfer_server.protocol.completions.request import prepare_completion
    from deepinfer_server.protocol.core.recipe import RecipeContext
    from deepinfer_server.protocol.messages.request import prepare_messages

    recipe = RecipeContext.create(embedded_tokenizer_json(), ("flash",), 65536, False)
    prepares: dict[str, Callable[[dict[str, Any], RecipeContext], object]] = {
        "chat": prepare_chat,
        "completions": prepare_completion,
        "messages": prepare_messages,
    }
    result: dict[str, float] = {}
    for name, prepare in prepares.items():
        body = BODIES[name]
        prepare(json.loads(json.dumps(body)), recipe)  # warm-up: the recipe's caches
        copies = [json.loads(json.dumps(body)) for _ in range(requests)]  # it edits bodies
        started = time.perf_counter()
        for copy in copies:
            prepare(copy, recipe)
        result[name] = (time.perf_counter() - started) / requests * 1e6
    print(json.dumps(result))


def _round(src: Path, requests: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    command = [sys.executable, __file__, "--child", "--requests", str(requests)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    timings: dict[str, float] = json.loads(done.stdout)
    return timings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="main", help="the git revision to compare against")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.requests)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"base": extract_src(args.base, Path(tmp)), "this": ROOT / "src"}
        best: dict[str, dict[str, float]] = {side: {} for side in sides}
        order = list(sides)
        for _ in range(args.rounds):
            order.reverse()  # neither side always runs first
            for side in order:
                for name, us in _round(sides[side], args.requests).items():
                    best[side][name] = min(us, best[side].get(name, us))
    print(f"request preparation, best of {args.rounds} rounds of {args.requests} (µs/request)")
    print(f"{'protocol':<12} {'base':>9} {'this':>9} {'this/base':>10}")
    for name in BODIES:
        base, this = best["base"][name], best["this"][name]
        print(f"{name:<12} {base:>9.1f} {this:>9.1f} {this / base:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
