"""EBNF for DeepSeek V4.1 DSML tool-call blocks, built from the tools' JSON schemas.

The markup, as the V4.1 prompt teaches it and deepseek-recipe 0.2.0 parses it::

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="NAME">
    <｜DSML｜ parameter name="KEY" string="true">raw text</｜DSML｜ parameter>
    <｜DSML｜ parameter name="KEY" string="false">JSON value</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

The recipe copies a `string="false"` value verbatim into the arguments JSON (it does not check
it), and JSON-escapes a `string="true"` value, which ends at the first `</｜DSML｜`. So plain
string properties are raw text that never contains `</｜`, string enums are
their raw alternatives, and everything else is a JSON value under the property's schema.
Properties appear in schema order, required ones always, optional ones optionally; no others.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from deepinfer_server.grammar._xgr import clean_error, xgrammar
from deepinfer_server.grammar.constraint import ToolSpec
from deepinfer_server.grammar.ebnf import literal, prefixed
from deepinfer_server.grammar.errors import GrammarError

DSML = "｜DSML｜"
BLOCK_OPEN = f"<{DSML} calls>\n"
BLOCK_CLOSE = f"</{DSML} calls>"
INVOKE_CLOSE = f"</{DSML} invoke>\n"
PARAM_CLOSE = f"</{DSML} parameter>\n"
# Raw text never contains "</｜"; free text never contains "<｜" (so a DSML block starts only
# where the grammar says). xgrammar clamps non-ASCII in negated classes, so "｜" is excluded by
# allowing only ASCII after "</" (raw) or "<" (free). No `"<"+` inside a star: that form costs
# xgrammar ~250 ms per token mask; this one ~50 us.
RAW_TEXT_RULE = r'dsml_raw ::= [^<]* ("<" ([^</] [^<]* | "/" [\0-;=-\x7f] [^<]*)?)*'
FREE_TEXT_RULE = r'dsml_free ::= [^<]* ("<" ([\0-;=-\x7f] [^<]*)?)*'
JSON_WHITESPACE_LIMIT = 16
_PLAIN_STRING_KEYS = frozenset({"type", "title", "description", "examples", "default"})


def invoke_open(name: str) -> str:
    """The line that opens a call of `name`."""
    return f'<{DSML} invoke name="{name}">\n'


def param_open(key: str, is_string: bool) -> str:
    """The tag that opens one parameter."""
    return f'<{DSML} parameter name="{key}" string="{"true" if is_string else "false"}">'


def _is_plain_string(schema: Any) -> bool:
    return (
        isinstance(schema, dict)
        and schema.get("type") == "string"
        and set(schema) <= _PLAIN_STRING_KEYS
    )


def _string_enum(schema: Any) -> list[str] | None:
    if not isinstance(schema, dict):
        return None
    values = schema.get("enum")
    if "const" in schema:
        values = [schema["const"]]
    if not isinstance(values, list) or not values:
        return None
    if all(isinstance(v, str) and "</" not in v for v in values):
        return list(values)
    return None


class _Builder:
    def __init__(self) -> None:
        self.rules: list[str] = []
        self.count = 0

    def json_value(
        self, schema: Mapping[str, object], defs: Mapping[str, object], param: str
    ) -> str:
        xgr = xgrammar()
        full = {**defs, **schema}
        try:
            grammar = xgr.Grammar.from_json_schema(
                json.dumps(full), strict_mode=True, max_whitespace_cnt=JSON_WHITESPACE_LIMIT
            )
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with C++ text
            raise GrammarError(f"invalid JSON schema: {clean_error(exc)}", param) from exc
        self.count += 1
        root, text = prefixed(str(grammar), f"j{self.count}_")
        self.rules.append(text)
        return root

    def value(self, key: str, schema: Any, defs: Mapping[str, object], param: str) -> str:
        if _is_plain_string(schema):
            return f"{literal(param_open(key, True))} dsml_raw {literal(PARAM_CLOSE)}"
        choices = _string_enum(schema)
        if choices is not None:
            body = " | ".join(literal(choice) for choice in choices)
            return f"{literal(param_open(key, True))} ({body}) {literal(PARAM_CLOSE)}"
        sub = schema if isinstance(schema, dict) else {}
        root = self.json_value(sub, defs, param)
        return f"{literal(param_open(key, False))} {root} {literal(PARAM_CLOSE)}"

    def invoke(self, tool: ToolSpec, index: int, param: str) -> str:
        schema = json.loads(tool.parameters)
        if not isinstance(schema, dict):
            raise GrammarError(f"tool {tool.name!r}: parameters must be an object", param)
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or [])
        missing = required - set(properties)
        if missing:
            raise GrammarError(
                f"tool {tool.name!r}: required parameters {sorted(missing)} have no schema", param
            )
        parts = []
        for key, sub in properties.items():
            value = self.value(key, sub, defs, param)
            parts.append(f"({value})" if key in required else f"({value})?")
        name = f"dsml_invoke_{index}"
        body = " ".join([literal(invoke_open(tool.name)), *parts, literal(INVOKE_CLOSE)])
        self.rules.append(f"{name} ::= {body}")
        return name


def tool_call_rules(
    tools: Sequence[ToolSpec], parallel: bool, param: str = "tools"
) -> tuple[str, str]:
    """Rules for the inside of a tool-call block (invokes, then the block's close).

    Returns (rule name `dsml_calls_body`, rules text); the rules also define `dsml_raw` and
    `dsml_free` (free text without `<｜`) for composition.
    """
    if not tools:
        raise GrammarError("no function tool to call", param)
    builder = _Builder()
    names = [builder.invoke(tool, index, param) for index, tool in enumerate(tools)]
    repeat = "+" if parallel else ""
    rules = [
        f"dsml_invoke ::= {' | '.join(names)}",
        f"dsml_calls_body ::= dsml_invoke{repeat} {literal(BLOCK_CLOSE)}",
        RAW_TEXT_RULE,
        FREE_TEXT_RULE,
        *builder.rules,
    ]
    return "dsml_calls_body", "\n".join(rules)


def tool_call_grammar(
    tools: Sequence[ToolSpec], parallel: bool, prefix: str = BLOCK_OPEN, param: str = "tools"
) -> str:
    """A complete EBNF grammar: `prefix` (by default the block's opening line), then the calls."""
    body, rules = tool_call_rules(tools, parallel, param)
    head = f"{literal(prefix)} " if prefix else ""
    return f"root ::= {head}{body}\n{rules}\n"
