#!/usr/bin/env python3
"""Check on a GPU node that the prefix cache changes no token: a cached turn equals an uncached one.

Runs DeepInfer 0.1.0's LLMEngine with the server's prefix cache
(`deepinfer_server.engines.deepinfer.prefix_cache`) in this process, as one DP rank of the
server does (`--cp N` adds N - 1 CP worker processes), under DeepInfer's deterministic mode:
`DEEPINFER_BATCH_INVARIANT=1`, `DEEPINFER_ENABLE_MTP_VARLEN=0` and a fixed `seq_seed` ("identical
outputs for identical input tokens and sampling parameters", DeepInfer's README). Each case's
second turn is generated three times: twice with a full prefill (the cache cleared first; the
two must agree, else the node is not deterministic and the check is inconclusive) and once
forked from the first turn's cached prefix. The cases:

- extend: turn 2 starts with turn 1's whole prompt (a tool loop): the fork reuses P tokens;
- thinking: turn 1 ends with `<think>` and turn 2 renders `</think>` in its place: the fork
  reuses P - 1 tokens, one token back from the state snapshot (the rings' rollback room);
- batch: four conversations' second turns at once, cached and not;
- chain: four turns, each forked from the one before.

What the CPU twin cannot show and this does: DeepInfer's kernels reading a cloned state slot, a
rolled-back sliding-window and compression ring, and the KV blocks a fork shares. Exit status 0:
every cached turn equals the uncached one; 1: one differs (printed with the first differing
position); 2: inconclusive. Example (one B200 node):

    python scripts/check_prefix_cache_gpu.py --model /models/DeepSeek-V4.1-Flash
    python scripts/check_prefix_cache_gpu.py --model /models/DeepSeek-V4.1-Flash --cp 2
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import sys
from dataclasses import dataclass
from typing import Any

#: Set before DeepInfer is imported: it reads them at import.
DETERMINISTIC_ENV = {
    "DEEPINFER_BATCH_INVARIANT": "1",
    "DEEPINFER_ENABLE_MTP_VARLEN": "0",
    "DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "1",
    "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
_SPOKEN = (
    "the server keeps finished prompts so that the next turn of an agent conversation prefills "
    "only what it adds while the engine forks a cached sequence and clones its state slot"
)
WORDS = tuple(_SPOKEN.split())


@dataclass
class Outcome:
    tokens: list[int]
    cached: int


class Harness:
    """The engine, the server's driver, and prompts in DeepSeek V4.1's rendering."""

    def __init__(self, args: argparse.Namespace) -> None:
        from deepinfer._C.engine import RequestOutput
        from deepinfer.engine.arg_utils import EngineArgs
        from deepinfer.engine.llm_engine import LLMEngine
        from tokenizers import Tokenizer

        from deepinfer_server.engines.deepinfer.prefix_engine import prefix_caching_engine
        from deepinfer_server.engines.deepinfer.prefix_settings import PrefixCacheSettings
        from deepinfer_server.engines.llm_engine_driver import LLMEngineDriver

        engine_class = prefix_caching_engine(LLMEngine, PrefixCacheSettings(min_tokens=64))
        self.engine = engine_class.from_engine_args(
            EngineArgs(
                model=args.model,
                tokenizer=args.model,
                max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs,
                data_parallel_size=1,
                context_parallel_size=args.cp,
                gpu_memory_utilization=args.gpu_memory_utilization,
                stop_preempted_request=False,
            )
        )
        self.driver = LLMEngineDriver(self.engine, RequestOutput)
        self.tokenizer = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
        self.args = args
        self.cached: dict[str, int] = {}
        add_request = self.engine.add_request

        def remembering(*positional: Any, **named: Any) -> Any:
            seq = add_request(*positional, **named)
            if seq is not None:
                self.cached[positional[1]] = int(seq.num_cached_tokens)
            return seq

        self.engine.add_request = remembering
        self.serial = 0

    def special(self, name: str) -> int:
        token = self.tokenizer.token_to_id(name)
        assert token is not None, f"the tokenizer has no {name}"
        return int(token)

    def text(self, words: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        spoken = " ".join(rng.choice(WORDS) for _ in range(words))
        return list(self.tokenizer.encode(spoken, add_special_tokens=False).ids)

    def first_prompt(self, seed: int, thinking: bool) -> list[int]:
        return [
            self.special("<｜begin▁of▁sentence｜>"),
            *self.text(self.args.prompt_words, seed),
            self.special("<｜User｜>"),
            *self.text(40, seed + 1),
            self.special("<｜Assistant｜>"),
            self.special("<think>" if thinking else "</think>"),
        ]

    def next_prompt(self, prompt: list[int], answer: list[int], seed: int) -> list[int]:
        """The next turn as V4.1 renders it: a `<think>` ending becomes `</think>`."""
        end_think = self.special("</think>")
        thinking = prompt[-1] == self.special("<think>")
        earlier = [*prompt[:-1], end_think] if thinking else prompt
        return [
            *earlier,
            *answer,
            self.special("<｜end▁of▁sentence｜>"),
            self.special("<｜User｜>"),
            *self.text(30, seed),
            self.special("<｜Assistant｜>"),
            end_think,
        ]

    def generate(self, prompts: list[list[int]]) -> list[Outcome]:
        """Run the prompts at once until they finish (and their entries are kept)."""
        from deepinfer_server.ipc.codec import pack_token_ids
        from deepinfer_server.ipc.messages import AddRequest, SamplingOptions

        ids = []
        for prompt in prompts:
            self.serial += 1
            request_id = f"check-{self.serial}"
            options = SamplingOptions(
                max_tokens=self.args.max_tokens,
                temperature=self.args.temperature,
                top_p=0.95,
                seed=self.args.seed,
            )
            rejected = self.driver.add(AddRequest(request_id, pack_token_ids(prompt), options))
            assert rejected is None, rejected
            ids.append(request_id)
        tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
        while True:
            unfinished, deltas = self.driver.iterate()
            for delta in deltas:
                tokens[delta.request_id].extend(delta.tokens.token_ids)
            if not unfinished and self.driver.num_live == 0:
                break
        return [Outcome(tokens[request_id], self.cached[request_id]) for request_id in ids]


@dataclass(frozen=True)
class Case:
    name: str
    conversations: int
    turns: int
    thinking: bool

    @property
    def rollback(self) -> int:
        """Tokens before the snapshot the fork starts at (the `<think>` turned `</think>`)."""
        return 1 if self.thinking else 0


CASES = (
    Case("extend", conversations=1, turns=2, thinking=False),
    Case("thinking", conversations=1, turns=2, thinking=True),
    Case("batch", conversations=4, turns=2, thinking=False),
    Case("chain", conversations=1, turns=4, thinking=False),
)


def check_case(harness: Harness, case: Case) -> int:
    """0: every cached turn equals its uncached run; 1: one differs; 2: inconclusive."""
    cache = harness.engine.prefix_cache
    seeds = [100 * (index + 1) for index in range(case.conversations)]
    prompts = [harness.first_prompt(seed, case.thinking) for seed in seeds]
    cache.clear()
    answers = [outcome.tokens for outcome in harness.generate(prompts)]
    status = 0
    for turn in range(2, case.turns + 1):
        previous, previous_answers = prompts, answers
        prompts = [
            harness.next_prompt(prompt, answer, seed + turn)
            for prompt, answer, seed in zip(previous, previous_answers, seeds, strict=True)
        ]
        if case.thinking:
            prompts = [[*prompt[:-1], harness.special("<think>")] for prompt in prompts]
        label = f"{case.name} turn {turn}"
        cache.clear()
        reference = harness.generate(prompts)
        cache.clear()
        again = harness.generate(prompts)
        cache.clear()
        replayed = harness.generate(previous)  # the entries this turn forks from
        if [o.tokens for o in again] != [o.tokens for o in reference] or [
            o.tokens for o in replayed
        ] != previous_answers:
            print(f"{label}: INCONCLUSIVE (two runs without the cache differ)")
            return 2
        cached = harness.generate(prompts)
        for index, (ref, hit) in enumerate(zip(reference, cached, strict=True)):
            expected = len(previous[index]) - case.rollback
            where = f"{label} conversation {index + 1}"
            if ref.cached or hit.cached != expected:
                print(f"{where}: FAIL reused {hit.cached} tokens, expected {expected}")
                status = 1
            elif hit.tokens != ref.tokens:
                at = _first_difference(hit.tokens, ref.tokens)
                print(
                    f"{where}: FAIL the cached answer differs at token {at} of "
                    f"{len(ref.tokens)} ({hit.cached} of {len(prompts[index])} tokens reused)"
                )
                status = 1
            else:
                print(
                    f"{where}: ok, {len(ref.tokens)} tokens equal ({hit.cached} of "
                    f"{len(prompts[index])} prompt tokens reused)"
                )
        answers = [outcome.tokens for outcome in reference]
    return status


def _first_difference(first: list[int], second: list[int]) -> int:
    pairs = zip(first, second, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(first), len(second)))


def run_cases(harness: Harness, names: list[str]) -> int:
    """The worst status over the chosen cases."""
    statuses = [check_case(harness, case) for case in CASES if case.name in names]
    if 1 in statuses:
        print("FAIL: a cached turn differs from the uncached one")
        return 1
    if 2 in statuses:
        print("INCONCLUSIVE: the node does not reproduce an uncached run")
        return 2
    print("PASS: every cached turn equals the uncached one")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the checkpoint directory")
    parser.add_argument("--cp", type=int, default=1, help="context parallel size (default 1)")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--prompt-words", type=int, default=3000, help="turn 1's length")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--nextn", type=int, default=0, help="MTP draft tokens (the server ships 0)"
    )
    parser.add_argument(
        "--cases",
        default=",".join(case.name for case in CASES),
        help="comma-separated, of: " + ", ".join(case.name for case in CASES),
    )
    args = parser.parse_args()
    os.environ.update(DETERMINISTIC_ENV)
    os.environ.setdefault("DEEPINFER_USE_NEXTN_DECODE", str(args.nextn))
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(args.cp))))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port() + 50))
    harness = Harness(args)
    try:
        return run_cases(harness, args.cases.split(","))
    finally:
        harness.engine.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
