"""Constraint -> DeepInfer `SamplingParams.so_args`.

Format (DeepInfer 0.1.0, so_matcher_builder.py): {"schema_type": "json" | "regex" | "ebnf",
"schema": str, optional "trigger_token_ids": list[int]}. JSON is compiled with strict_mode=True.
We never set "bound_token_id" (it would force the trigger right after a bound token).

- Thinking on: the grammar starts after `</think>` (trigger = its token ids), reasoning is free.
- Forced tool call (required/named): the V4.1 prompt already ends with `<｜DSML｜ calls>\\n`, so
  the grammar is the block's inside (invokes, then `</｜DSML｜ calls>`). With thinking (the
  recipe refuses that today) it is `\\n\\n` + the whole block after `</think>`.
- Strict tools under auto, thinking off: trigger = the tokens of `｜DSML｜ calls`, then the rest
  of the opening line and the calls. Thinking on: a `｜DSML｜` inside reasoning must stay free,
  so the trigger is `</think>` and the grammar is free text (without `<｜`), then optionally a
  tool-call block.
- An answer format with tools under auto: one grammar, `answer | "\\n\\n"? block`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, NotRequired, TypedDict

from deepinfer_server.grammar._xgr import Vocab, clean_error, xgrammar
from deepinfer_server.grammar.constraint import Constraint
from deepinfer_server.grammar.dsml import BLOCK_OPEN, DSML, tool_call_grammar, tool_call_rules
from deepinfer_server.grammar.ebnf import literal, prefixed
from deepinfer_server.grammar.errors import GrammarError

SCHEMA_TYPES = ("json", "regex", "ebnf")


class SoArgs(TypedDict):
    """The so_args this server builds (the module's docstring gives DeepInfer's format)."""

    schema_type: str
    schema: str
    trigger_token_ids: NotRequired[list[int]]


#: The schema type of the answer formats whose grammar text is the request's own, unchanged
#: when no tool is constrained.
_PASSED_THROUGH = {"json_schema": "json", "json_object": "json", "regex": "regex", "ebnf": "ebnf"}


def own_schema_type(constraint: Constraint) -> str | None:
    """The schema type of a lone answer format whose so_args schema is the request's own text
    (None with tools, or for a choice list: their grammar is built, in EBNF)."""
    return _PASSED_THROUGH.get(constraint.kind or "") if constraint.tools is None else None


@lru_cache(maxsize=8)
def dsml_trigger(vocab: Vocab) -> tuple[tuple[int, ...], str]:
    """(trigger token ids for `｜DSML｜ calls`, the rest of the opening line after them)."""
    ids = vocab.encode(BLOCK_OPEN)
    marker = DSML.encode()
    target = f"{DSML} calls".encode()
    start = next(i for i, tok in enumerate(ids) if vocab.token_bytes(tok).startswith(marker))
    text = b""
    end = start
    while end < len(ids) and not text.startswith(target):
        text += vocab.token_bytes(ids[end])
        end += 1
    prefix_len = len(BLOCK_OPEN.encode()) - len(BLOCK_OPEN[BLOCK_OPEN.index(DSML) :].encode())
    rest = BLOCK_OPEN.encode()[prefix_len + len(text) :].decode()
    return tuple(ids[start:end]), rest


def _answer_rules(constraint: Constraint) -> tuple[str, str]:
    xgr = xgrammar()
    kind, spec, param = constraint.kind, constraint.spec, constraint.param
    try:
        if kind in ("json_schema", "json_object"):
            grammar = xgr.Grammar.from_json_schema(spec, strict_mode=True)
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(spec)
        elif kind == "ebnf":
            grammar = xgr.Grammar.from_ebnf(spec)
        else:
            choices = json.loads(spec)
            return "answer_root", "answer_root ::= " + " | ".join(literal(c) for c in choices)
    except GrammarError:
        raise
    except Exception as exc:
        raise GrammarError(f"invalid {kind}: {clean_error(exc)}", param) from exc
    return prefixed(str(grammar), "answer_")


def _args(schema_type: str, schema: str, trigger: tuple[int, ...] | None) -> SoArgs:
    args = SoArgs(schema_type=schema_type, schema=schema)
    if trigger:
        args["trigger_token_ids"] = list(trigger)
    return args


def build_so_args(constraint: Constraint, vocab: Vocab) -> SoArgs:
    """The so_args DeepInfer reads for this constraint (raises GrammarError on bad input)."""
    think = vocab.think_end_ids if constraint.thinking else None
    own = own_schema_type(constraint)
    if own is not None:
        return _args(own, constraint.spec, think)
    tools = constraint.tools
    if tools is None:
        root, rules = _answer_rules(constraint)
        return _args("ebnf", f"root ::= {root}\n{rules}\n", think)
    allowed = tools.allowed
    if tools.mode in ("required", "named"):
        prefix = "\n\n" + BLOCK_OPEN if constraint.thinking else ""
        return _args("ebnf", tool_call_grammar(allowed, tools.parallel, prefix), think)
    body, rules = tool_call_rules(allowed, tools.parallel)
    block = f"{literal(BLOCK_OPEN)} {body}"
    if constraint.kind is not None:
        answer, answer_rules = _answer_rules(constraint)
        grammar = f'root ::= {answer} | ("\\n\\n")? {block}\n{rules}\n{answer_rules}\n'
        return _args("ebnf", grammar, think)
    if constraint.thinking:
        return _args("ebnf", f"root ::= dsml_free ({block})?\n{rules}\n", think)
    trigger, rest = dsml_trigger(vocab)
    head = f"{literal(rest)} " if rest else ""
    return _args("ebnf", f"root ::= {head}{body}\n{rules}\n", trigger)


def check_so_args(so_args: Mapping[str, Any], param: str) -> None:
    """The checks DeepInfer makes (synchronously or as a failed request), as a GrammarError."""
    if "serialized" in so_args or "bound_token_ids" in so_args:
        raise GrammarError("so_args may not hold 'serialized' or 'bound_token_ids'", param)
    if so_args.get("schema_type") not in SCHEMA_TYPES:
        raise GrammarError(f"schema_type must be one of {SCHEMA_TYPES}", param)
    if not isinstance(so_args.get("schema"), str):
        raise GrammarError("so_args needs a string 'schema'", param)
    trigger = so_args.get("trigger_token_ids") or []
    if not isinstance(trigger, list) or any(type(t) is not int or t < 0 for t in trigger):
        raise GrammarError("trigger_token_ids must be a list of non-negative integers", param)
    bound = so_args.get("bound_token_id")
    if bound is not None and (type(bound) is not int or bound < 0 or not trigger):
        raise GrammarError("bound_token_id must be a non-negative integer with a trigger", param)


def check_size(schema_type: str, schema: str, limit: int, param: str) -> None:
    """GrammarError unless the grammar text is at most `limit` bytes (UTF-8)."""
    size = len(schema.encode())
    if size > limit:
        message = f"the {schema_type} grammar is {size} bytes; the limit is {limit}"
        raise GrammarError(message, param)
