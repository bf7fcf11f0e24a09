"""The grammar-abuse set: request shapes that once killed, wedged or stalled a rank,
and their neighbours, each with the outcomes an engine may give it. Engine-neutral: the
simulated engine's tests and the HTTP tests parametrise over `CASES`.

Outcomes: "refused" (the API's compile rejects it: 400), "grammar_failed" (the engine ends the
request: 500 `structured_output_failed`), "answered" (200; stop, or length when the grammar
cannot finish within max_tokens). Whatever the outcome, the engine must keep serving.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

Outcome = str


@dataclass(frozen=True)
class GrammarAbuseCase:
    """One abusive structured-output option and what may become of it."""

    name: str
    #: Chat Completions fields carrying the option.
    body: dict[str, Any]
    outcomes: frozenset[Outcome]

    def __str__(self) -> str:
        return self.name


def _schema(schema: Any) -> dict[str, Any]:
    return {
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    }


def _regex(pattern: str) -> dict[str, Any]:
    return {"structured_outputs": {"regex": pattern}}


def _ebnf(grammar: str) -> dict[str, Any]:
    return {"structured_outputs": {"grammar": grammar}}


def _case(name: str, body: dict[str, Any], *outcomes: Outcome) -> GrammarAbuseCase:
    return GrammarAbuseCase(name, body, frozenset(outcomes))


_SELF_OBJECT = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"next": {"$ref": "#/$defs/node"}},
            "required": ["next"],
        }
    },
    "$ref": "#/$defs/node",
}
_DEFS_LOOP = {
    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
    "$ref": "#/$defs/a",
}
_NESTED: dict[str, Any] = {"type": "integer"}
for _ in range(40):
    _NESTED = {"type": "array", "items": _NESTED, "maxItems": 2}

#: Grammars that allow no complete text end the request; never the rank. Those that allow no
#: first token either (a rule that only refers to itself) are refused by the API's compile.
EMPTY_LANGUAGE = [
    _case("ref-self", _schema({"$ref": "#"}), "refused"),
    _case("defs-loop", _schema(_DEFS_LOOP), "refused"),
    _case("ebnf-self", _ebnf("root ::= root"), "refused"),
    _case("not-anything", _schema({"not": {}}), "grammar_failed", "refused", "answered"),
    _case("empty-enum", _schema({"enum": []}), "grammar_failed", "refused"),
    _case(
        "contradictory-length",
        _schema({"type": "string", "minLength": 5, "maxLength": 1}),
        "grammar_failed",
        "refused",
    ),
]
#: Grammars whose only texts are endless or huge: cut by max_tokens, with bounded work a token.
ENDLESS = [
    # Compiles in about a second, or is refused where compiling is slower than the bound.
    _case(
        "min-length-1e9",
        _schema({"type": "string", "minLength": 1_000_000_000}),
        "answered",
        "refused",
    ),
    _case("regex-a-1e8", _regex("a{100000000}"), "answered"),
    _case(
        "min-items-1e6",
        _schema({"type": "array", "minItems": 1_000_000, "items": {"type": "integer"}}),
        "answered",
        "refused",
    ),
    _case("required-self-object", _schema(_SELF_OBJECT), "answered", "grammar_failed"),
    _case(
        "ebnf-forced-recursion", _ebnf('root ::= "a" root'), "answered", "grammar_failed", "refused"
    ),
]
#: Grammars too large or too slow to compile within the bounds: refused at the API.
EXPENSIVE = [
    _case(
        "grammar-over-the-size-limit",
        _regex("(" + "|".join(f"w{i:06d}" for i in range(12000)) + ")"),
        "refused",
    ),
    _case("compiled-size-over-the-limit", _regex("[a-z]+," * 1200), "refused"),
    _case("slow-bounded-repeats", _regex("\\w{1,5}-" * 1024), "refused"),
]
#: Neighbours that must simply work.
ORDINARY = [
    _case("nested-arrays-40", _schema(_NESTED), "answered"),
    _case(
        "choice-2000",
        {"structured_outputs": {"choice": [f"option {i}" for i in range(2000)]}},
        "answered",
    ),
    _case("regex-empty-only", _regex(""), "answered", "refused"),
    _case(
        "max-length-1e6",
        _schema({"type": "string", "maxLength": 1_000_000}),
        "answered",
        "refused",
    ),
]
CASES = [*EMPTY_LANGUAGE, *ENDLESS, *EXPENSIVE, *ORDINARY]


def describe(case: GrammarAbuseCase) -> str:
    """The case's option as JSON (for failure messages)."""
    return json.dumps(case.body)[:200]
