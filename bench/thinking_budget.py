#!/usr/bin/env python3
"""Thinking budget: what one budget hit costs on DeepInfer 0.1.0's own engine (the CPU twin).

    DEEPINFER_TWIN_DIR=... python bench/thinking_budget.py [--trials 5] [--budget 64]

When a request's reasoning budget runs out, the server's engine driver ends the engine request
and adds one that continues from prompt + reasoning + `</think>` (docs/api/reasoning.md). In
one twin process per configuration (prefix cache off, then on), each trial runs two requests of
the same output, alone: one whose reasoning is cut by the budget (`</think>` forced), and one
whose model ends the same reasoning with `</think>` by itself. Reported per configuration: the
prompt tokens the engine computed again per hit (the driver's counter), the engine iterations
and the wall time from `</think>` to the first answer token, for each request, and their
ratio (forced / natural), medians over the trials. The twin's model costs next to nothing, so
its times show the scheduling path (abort, re-add, prefill step), not a GPU's prefill time:
on a GPU the recomputed tokens are the cost that matters.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.checkpoint import write_checkpoint
from tests.deepinfer_twin import twin_dir
from tests.deepinfer_twin.runner import run_in_twin

REASONING = "step " * 400
ANSWER = "The answer is 42."

BODY = """
import statistics, time
END = TOKENIZER.token_to_id("</think>")
reasoning = TOKENIZER.encode(REASONING, add_special_tokens=False).ids[:BUDGET]

def thinking_prompt(turn):
    rendered = f"<｜begin▁of▁sentence｜><｜User｜>{turn}<｜Assistant｜><think>"
    return TOKENIZER.encode(rendered, add_special_tokens=False).ids

def gap(request_id, prompt, budget):
    # Iterations and seconds from the iteration that brings </think> to the next token.
    sampling = SamplingOptions(max_tokens=BUDGET + 64, thinking_budget=budget, thinking_end_id=END)
    before = DRIVER.counters()
    computed_before = before.prompt_tokens_computed if before else COMPUTED[0]
    assert DRIVER.add(AddRequest(request_id, pack_token_ids(prompt), sampling)) is None
    ended_at = None
    iterations = 0
    while DRIVER.num_live:
        start = time.perf_counter()
        _, deltas = DRIVER.iterate()
        now = time.perf_counter()
        tokens = [t for d in deltas for t in d.tokens.token_ids]
        if ended_at is not None:
            iterations += 1
        if END in tokens and ended_at is None:
            ended_at = start
            if tokens[-1] != END:
                return 0, now - start, 0
        elif ended_at is not None and tokens:
            after = DRIVER.counters()
            computed = after.prompt_tokens_computed if after else COMPUTED[0]
            COMPUTED[0] = computed
            return iterations, now - ended_at, computed - computed_before - len(prompt)
    raise AssertionError("no answer after </think>")

COMPUTED = [0]
forced, natural = [], []
text = TOKENIZER.decode(reasoning)
for trial in range(TRIALS):
    # A different first word per trial: no request reuses another's cached prompt.
    forced.append(gap(f"f{trial}", thinking_prompt(f"{trial} {REASONING}</think>{ANSWER}"), BUDGET))
    natural.append(gap(f"n{trial}", thinking_prompt(f"{trial} {text}</think>{ANSWER}"), None))
med = lambda rows, i: statistics.median(row[i] for row in rows)
RESULT = {
    "forced": [med(forced, 0), med(forced, 1), med(forced, 2)],
    "natural": [med(natural, 0), med(natural, 1), med(natural, 2)],
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--budget", type=int, default=64)
    args = parser.parse_args()
    if twin_dir() is None:
        sys.exit("set DEEPINFER_TWIN_DIR to a built twin (scripts/build_deepinfer_twin.py)")
    checkpoint = write_checkpoint(Path(tempfile.mkdtemp()) / "DeepSeek-V4.1-Flash")
    head = (
        f"REASONING = {REASONING!r}\nANSWER = {ANSWER!r}\n"
        f"BUDGET = {args.budget}\nTRIALS = {args.trials}\n"
    )
    print(f"budget {args.budget} tokens, {args.trials} trials, medians")
    print(
        "| prefix cache | recomputed tokens per hit | iterations </think> → answer "
        "(forced / natural) | ms </think> → answer (forced / natural) | ratio |"
    )
    print("|---|---|---|---|---|")
    for cache in (False, True):
        engine = {"prefix_cache": {"min_tokens": 64}, "max_model_len": 4096} if cache else None
        result = run_in_twin(checkpoint, head + BODY, engine=engine, timeout=900)
        forced, natural = result["forced"], result["natural"]
        ratio = forced[1] / natural[1] if natural[1] else float("inf")
        print(
            f"| {'on' if cache else 'off'} | {forced[2]:.0f} | {forced[0]:.0f} / {natural[0]:.0f} "
            f"| {forced[1] * 1e3:.1f} / {natural[1] * 1e3:.1f} | {ratio:.1f} |"
        )


if __name__ == "__main__":
    main()
