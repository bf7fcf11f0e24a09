"""EchoFitter: the simulated model's echo said in the form the request's grammar allows.

A model under a grammar says what it means in the form the grammar allows, so the scripted
echo is rewritten once, when the request's matcher is built (on a grammar builder thread,
never in the loop), into a script whose constrained part (after the trigger, `</think>` in
thinking mode) is a complete text the grammar accepts. The first that fits, of:

1. the echo as it is;
2. the DSML tool-call block the echo holds: as written, after "\\n\\n" (a forced call after
   `</think>`), or without its opening line (a forced call's prompt already ends with it);
3. the echo's plain text (tool results unwrapped, tool-call markup left out);
4. a minimal valid completion (the matcher's own planner) with that plain text in its first
   string field, a JSON string or a raw DSML parameter, else that minimal completion alone.
   A forced call calls the first tool the conversation has not called yet (an agent whose
   answer is a tool, such as pydantic-ai's `final_result`, then ends), else the first tool.

Each candidate is checked token by token against the grammar and must end, EOS included,
within max_tokens; if none does, the script stays as it was. The fitted script only proposes:
the matcher's bitmask still decides every token. The work is bounded: at most `MAX_TOOLS`
tools tried, `MAX_FILL_TOKENS` planned tokens in all, `MAX_ECHO_CHARS` of echo placed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from deepinfer_server.engines.simulated.script import USER_TOKEN
from deepinfer_server.grammar import MatcherFailure, SimulatedMatcher, Vocab
from deepinfer_server.grammar._xgr import xgrammar
from deepinfer_server.grammar.dsml import BLOCK_OPEN, DSML, PARAM_CLOSE
from deepinfer_server.grammar.matcher import ebnf_literals

#: Tools a forced call may try, in order.
MAX_TOOLS = 8
#: Tokens the planner may add to complete candidates, over one fit.
MAX_FILL_TOKENS = 512
#: Characters of the echo placed in a string field.
MAX_ECHO_CHARS = 2048
#: Shorter cuts of the echo tried when the whole does not fit (a maxLength, max_tokens).
_ECHO_CUTS = (256, 64, 16)

_BLOCK = re.compile(rf"<{DSML} calls>.*?(?:</{DSML} calls>|$)", re.DOTALL)
_INVOKE_START = f'<{DSML} invoke name="'
_CALLED = re.compile(rf'<{DSML} invoke name="([^"]*)">')
_TOOL_RESULT_TAG = re.compile(r"</?tool_result>")
_RAW_OPEN = 'string="true">'
#: What a raw DSML value cannot hold (`grammar/dsml.py` RAW_TEXT_RULE): "</" before a
#: character other than ASCII (such as "｜", where the value ends), "<", or the value's end.
_RAW_STOP = re.compile(r"</(?![\x00-;=-\x7f])")
_RAW_CLOSE = PARAM_CLOSE.rstrip("\n")


class FittedScript(NamedTuple):
    """The script to say, and its constrained part with EOS when that fits the grammar (a
    completion plan for `SimulatedMatcher.follow`)."""

    script: list[int]
    plan: list[int] | None


class EchoFitter:
    """Fits scripts to one compiled grammar (not thread-safe: one per build)."""

    def __init__(self, compiled: Any, vocab: Vocab, so_args: Mapping[str, Any]) -> None:
        self._xgr = xgrammar()
        self._compiled = compiled
        self._vocab = vocab
        self._trigger = list(so_args.get("trigger_token_ids") or [])
        self._invokes = _invoke_literals(str(compiled.grammar))
        self._fill_left = MAX_FILL_TOKENS
        #: A bound token forces the trigger wherever it is generated: the script cannot say
        #: where the grammar starts.
        self._bound = so_args.get("bound_token_id") is not None

    def fit(self, script: Sequence[int], prompt: Sequence[int], max_tokens: int) -> FittedScript:
        """`script` with its constrained part replaced by one that fits (or unchanged)."""
        unchanged = FittedScript(list(script), None)
        start = self._grammar_start(script)
        if start is None:
            return unchanged
        head, tail = list(script[:start]), list(script[start:])
        budget = max_tokens - len(head)  # the tokens the constrained part may take, EOS too
        if budget <= 0:
            return unchanged
        if self._accepts(tail, budget):
            return FittedScript(list(script), [*tail, self._vocab.eos_id])
        prompt_text = self._vocab.tokenizer.decode(list(prompt), skip_special_tokens=False)
        for candidate in self._candidates(self._text(tail), prompt_text, budget):
            ids = self._vocab.encode(candidate)
            if self._accepts(ids, budget):
                return FittedScript(head + ids, [*ids, self._vocab.eos_id])
        return unchanged

    def _grammar_start(self, script: Sequence[int]) -> int | None:
        """Where the grammar starts in the script: after the trigger's first occurrence (as the
        matcher finds it among the generated tokens), None if it never starts."""
        if self._bound:
            return None
        size = len(self._trigger)
        if not size:
            return 0
        for index in range(len(script) - size + 1):
            if list(script[index : index + size]) == self._trigger:
                return index + size
        return None

    def _candidates(self, text: str, prompt_text: str, budget: int) -> Iterator[str]:
        block = _BLOCK.search(text)
        if block is not None:
            call = block.group(0)
            yield call
            yield "\n\n" + call
            if call.startswith(BLOCK_OPEN):
                yield call[len(BLOCK_OPEN) :]
        plain = _plain_text(text)
        if plain:
            yield plain  # free text beside a call that does not fit
        minimal = self._complete("", budget)
        if minimal is None:
            return
        invoke_at = minimal.find(_INVOKE_START)
        if invoke_at < 0:
            yield from self._filled(minimal, plain)
            yield minimal
            return
        for name in self._tool_order(prompt_text)[:MAX_TOOLS]:
            # Up to the end of the grammar's literal: the planner goes on from a literal's end.
            completion = self._complete(minimal[:invoke_at] + self._invokes[name], budget)
            if completion is not None:
                yield from self._filled(completion, plain)
                yield completion

    def _tool_order(self, prompt_text: str) -> list[str]:
        """The grammar's tools, those the conversation has not called yet first."""
        turns = prompt_text.find(USER_TOKEN)
        called = set(_CALLED.findall(prompt_text[turns:])) if turns >= 0 else set()
        tools = list(self._invokes)
        return [t for t in tools if t not in called] + [t for t in tools if t in called]

    def _filled(self, completion: str, plain: str) -> Iterator[str]:
        """`completion` with `plain` in its first string field that takes it (replacing what
        the planner put there, else before it)."""
        if not plain:
            return
        for cut in (len(plain), *(c for c in _ECHO_CUTS if c < len(plain))):
            placed = self._place(completion, plain[:cut])
            if placed is not None:
                yield placed
                return

    def _place(self, completion: str, plain: str) -> str | None:
        state = self._xgr.GrammarMatcher(self._compiled)
        done = 0
        for index, char in enumerate(completion):
            if char not in '">':
                continue
            at = index + 1
            if not state.accept_string(completion[done:at]):
                return None
            done = at
            raw = completion[:at].endswith(_RAW_OPEN)
            piece = _raw(plain) if raw else json.dumps(plain, ensure_ascii=False)[1:-1]
            trial = state.fork()
            if not trial.accept_string(piece[:1]):
                continue
            end = completion.find(_RAW_CLOSE, at) if raw else _string_end(completion, at)
            for rest in (completion[end:] if end >= 0 else None, completion[at:]):
                if rest is None:
                    continue
                full = state.fork()
                if full.accept_string(piece) and full.accept_string(rest) and full.is_completed():
                    return completion[:at] + piece + rest
        return None

    def _complete(self, prefix: str, budget: int) -> str | None:
        """`prefix` and the planner's shortest way to finish the grammar from it, or None."""
        vocab = self._vocab
        planner = SimulatedMatcher(self._compiled, vocab, budget)
        ids = vocab.encode(prefix)
        added: list[int] = []
        planner.follow(ids)  # the planner's own search may not find its way through `prefix`
        try:
            for token in ids:
                if planner.choose(token) != token:
                    return None
            while self._fill_left > 0 and len(added) < budget - len(ids):
                self._fill_left -= 1
                token = planner.choose(-1)  # no token: the planner's own choice each time
                if token == vocab.eos_id:
                    return prefix + self._text(added)
                added.append(token)
        except MatcherFailure:
            return None
        return None

    def _accepts(self, ids: Sequence[int], budget: int) -> bool:
        """Whether the grammar takes exactly these tokens and then EOS, within `budget`."""
        if len(ids) + 1 > budget:
            return False
        state = self._xgr.GrammarMatcher(self._compiled)
        return all(state.accept_token(token) for token in ids) and bool(
            state.accept_token(self._vocab.eos_id)
        )

    def _text(self, ids: Sequence[int]) -> str:
        return b"".join(self._vocab.token_bytes(t) for t in ids).decode("utf-8", "replace")


def _invoke_literals(ebnf: str) -> dict[str, str]:
    """Per tool, in grammar order: the literal of xgrammar's printed grammar that opens its
    call (the invoke line, and whatever xgrammar merged into it)."""
    found: dict[str, str] = {}
    for raw in ebnf_literals(ebnf):
        try:
            text = json.loads(f'"{raw}"')
        except ValueError:
            continue
        if isinstance(text, str) and text.startswith(_INVOKE_START):
            end = text.find('">', len(_INVOKE_START))
            if end > 0:
                found.setdefault(text[len(_INVOKE_START) : end], text)
    return found


def _plain_text(text: str) -> str:
    """What the echo says outside tool-call markup, tool results unwrapped (at most
    `MAX_ECHO_CHARS`)."""
    plain = _TOOL_RESULT_TAG.sub("", _BLOCK.sub("", text)).strip()
    return plain[:MAX_ECHO_CHARS]


def _raw(plain: str) -> str:
    """`plain` as a raw DSML parameter value: "</" kept apart where it would end the value."""
    return _RAW_STOP.sub("< /", plain)


def _string_end(text: str, start: int) -> int:
    """The index of the quote that closes the JSON string whose content starts at `start`."""
    index = start
    while index < len(text):
        if text[index] == "\\":
            index += 2
            continue
        if text[index] == '"':
            return index
        index += 1
    return -1
