#!/usr/bin/env python3
"""Prompt encoding reuse, in one process, no server: an agent conversation's request
preparation (`prepare_chat`: checks, conversion, encoding) per turn with the prompt encoder
reusing the last turn's tokens and with every prompt encoded whole by deepseek-recipe.

Replays `--conversations` conversations of `--turns` turns (a ~14k-token system prompt, then
200-400 tokens per turn, tools declared), the two ways alternating turn by turn, and prints
the median and mean preparation time of the first turn and of the later ones, with their ratio
(the mean includes the one request in 64 whose reused encoding is checked against the
recipe's).

    python bench/prompt_encoding.py [--conversations 3] [--turns 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_conversation import TOOL, conversation_turns

from deepinfer_server.model.tokenizer import embedded_tokenizer_json
from deepinfer_server.protocol.chat.request import PreparedChat, prepare_chat
from deepinfer_server.protocol.core.recipe import RecipeContext


def _body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "flash", "messages": messages, "tools": [TOOL], "max_tokens": 16}


def _prepare(recipe: RecipeContext, messages: list[dict[str, Any]]) -> tuple[float, list[int]]:
    started = time.perf_counter()
    prepared = prepare_chat(_body(messages), recipe)
    elapsed = time.perf_counter() - started
    assert isinstance(prepared, PreparedChat)
    return elapsed, prepared.prompt_token_ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=20)
    args = parser.parse_args()
    reusing = RecipeContext.create(embedded_tokenizer_json(), ("flash",), 65536, True)
    whole = dataclasses.replace(reusing, prompt_encoder=None)
    _prepare(whole, conversation_turns(10_000, 1)[0])  # warm-up: the recipe's caches
    first: dict[str, list[float]] = {"reuse": [], "whole": []}
    later: dict[str, list[float]] = {"reuse": [], "whole": []}
    for seed in range(args.conversations):
        for turn, messages in enumerate(conversation_turns(seed, args.turns)):
            timings = {}
            for name, recipe in (("whole", whole), ("reuse", reusing)):
                timings[name], tokens = _prepare(recipe, messages)
                if name == "whole":
                    expected = tokens
                elif tokens != expected:
                    raise AssertionError(f"conversation {seed} turn {turn}: tokens differ")
            for name, seconds in timings.items():
                (first if turn == 0 else later)[name].append(seconds)
    print(f"prepare_chat per request, ms ({args.conversations} conversations):")
    for label, samples in (("turn 1", first), (f"turns 2-{args.turns}", later)):
        for stat in (statistics.median, statistics.mean):
            whole_ms = stat(samples["whole"]) * 1e3
            reuse_ms = stat(samples["reuse"]) * 1e3
            print(
                f"  {label:>10} {stat.__name__:>6}: encoded whole {whole_ms:7.2f}, reusing the "
                f"last turn {reuse_ms:7.2f}  (ratio {reuse_ms / whole_ms:.3f})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
