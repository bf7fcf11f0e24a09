"""Composing xgrammar EBNF text: string literals and prefixing the rules of a sub-grammar."""

from __future__ import annotations

import json
import re

_RULE_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= ", re.MULTILINE)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def literal(text: str) -> str:
    """An EBNF string literal matching exactly `text`."""
    return json.dumps(text, ensure_ascii=False)


def _rename_body(body: str, names: dict[str, str]) -> str:
    out: list[str] = []
    i = 0
    while i < len(body):
        char = body[i]
        if char in '"[':
            close = '"' if char == '"' else "]"
            j = i + 1
            while j < len(body) and body[j] != close:
                j += 2 if body[j] == "\\" else 1
            out.append(body[i : j + 1])
            i = j + 1
            continue
        match = _IDENT.match(body, i)
        if match:
            word = match.group(0)
            out.append(names.get(word, word))
            i = match.end()
            continue
        out.append(char)
        i += 1
    return "".join(out)


def prefixed(ebnf: str, prefix: str, root: str = "root") -> tuple[str, str]:
    """Rename every rule of `ebnf` (xgrammar's printed form: one rule per line) to
    `prefix + name`; returns (the new name of `root`, the rules text)."""
    names = {name: prefix + name for name in _RULE_LINE.findall(ebnf)}
    lines = []
    for line in ebnf.splitlines():
        match = _RULE_LINE.match(line)
        if not match:
            continue
        body = _rename_body(line[match.end() :], names)
        lines.append(f"{names[match.group(1)]} ::= {body}")
    return names[root], "\n".join(lines)
