"""Grammar compile time and per-token masking cost vs. unconstrained (one run, ratio style).

Run: PYTHONPATH=src python bench/grammar_bench.py   (needs the [grammar] extra)
"""

from __future__ import annotations

import time
from typing import Any

from deepinfer_server.grammar import chat_constraint
from deepinfer_server.grammar._xgr import Vocab
from deepinfer_server.grammar.compiler import GrammarCompiler
from deepinfer_server.grammar.matcher import SimulatedMatcher
from deepinfer_server.model.tokenizer import embedded_tokenizer_json

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
CASES: dict[str, tuple[dict[str, Any], str]] = {
    "json_object": ({"response_format": {"type": "json_object"}}, '{"a": "' + "word " * 40 + '"}'),
    "json_schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": PERSON},
            }
        },
        '{"name": "' + "Bob " * 40 + '", "age": 42, "tags": ["x", "y"]}',
    ),
    "regex": ({"structured_outputs": {"regex": "[a-z ]{1,400}"}}, "word " * 40),
    "tool_required": (
        {"tools": [TOOL], "tool_choice": "required"},
        '<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">'
        + "Paris " * 40
        + "</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>",
    ),
}


def main() -> None:
    """Print compile times and masking cost per constrained token."""
    started = time.perf_counter()
    vocab = Vocab.from_tokenizer_json(embedded_tokenizer_json())
    print(f"TokenizerInfo build: {time.perf_counter() - started:.2f} s (vocab {vocab.vocab_size})")
    compiler = GrammarCompiler(vocab)
    for name, (body, echo) in CASES.items():
        constraint = chat_constraint(body)
        assert constraint is not None
        so_args = compiler.so_args_for(constraint)  # includes the first compile
        started = time.perf_counter()
        compiler.compile(so_args)
        cached = time.perf_counter() - started
        fresh = GrammarCompiler(vocab)
        started = time.perf_counter()
        fresh.compile(so_args)
        compile_s = time.perf_counter() - started
        preferred = vocab.encode(echo)
        baseline_started = time.perf_counter()
        baseline = [token for token in preferred]  # unconstrained: the echo is emitted as is
        baseline_s = (time.perf_counter() - baseline_started) / max(1, len(baseline))
        matcher = SimulatedMatcher.from_so_args(so_args, compiler, 512)
        started = time.perf_counter()
        count = 0
        for token in [*preferred, vocab.eos_id]:
            count += 1
            if matcher.choose(token) == vocab.eos_id:
                break
        step_s = (time.perf_counter() - started) / count
        mask_s = matcher.stats.mask_seconds / max(1, matcher.stats.masked_tokens)
        print(
            f"{name:14} compile {compile_s * 1e3:7.1f} ms (cached {cached * 1e6:5.0f} us)  "
            f"mask {mask_s * 1e6:7.1f} us/token  step {step_s * 1e6:8.1f} us/token  "
            f"step/unconstrained x{step_s / max(baseline_s, 1e-9):,.0f}  "
            f"({count} tokens, {matcher.stats.forced_tokens} forced)"
        )


if __name__ == "__main__":
    main()
