"""A per-request grammar matcher for the CPU simulated engine, with DeepInfer's semantics.

Mirrors deepinfer/structure_output/matcher.py: tokens are free until `trigger_token_ids` has
appeared (KMP over the generated tokens); once `bound_token_id` has been generated, the rest of
the trigger is forced token by token; then every token goes through xgrammar's matcher (the
bitmask is filled each step, as DeepInfer does, and timed); after the grammar accepted EOS
anything goes. The simulated model proposes a token (`preferred`); `choose()` returns it when
the grammar allows it AND the value can still be completed within the remaining max_tokens,
otherwise the next token of a verified completion plan. So the output always parses, unless
no completion fits in the budget (then it ends with finish_reason "length", like a real model).

`choose()` runs in the rank loop, so its work is bounded whatever the grammar: a plan is
searched with at most `PLAN_TRIALS` trial advances over at most `PLAN_CHARS` characters, and
never with xgrammar's jump-forward string (`a{100000000}` makes that 100 MB); once a search
finds no completion within those bounds the matcher stops planning and emits valid tokens
until max_tokens. A grammar that allows no token at all (`{"$ref": "#"}` is `root ::= root`;
the API's compile refuses those first) or that xgrammar fails on raises MatcherFailure: the
engine ends that one request.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepinfer_server.grammar._xgr import Vocab, xgrammar
from deepinfer_server.grammar.dsml import BLOCK_CLOSE, DSML, INVOKE_CLOSE, PARAM_CLOSE

_GENERIC = [*"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"]
_GENERIC += [*"-_.,:;!?/()'+*=#@$%&|~^`<>", " ", "\n"]
_OTHER = ["}", "]", '"', "0", "true", "null", ",", ":", "{", "[", INVOKE_CLOSE, BLOCK_CLOSE]
_CANDIDATES = {
    "raw": [PARAM_CLOSE, *_GENERIC],
    "string": ['"', *_GENERIC],
    "other": [*_OTHER, *_GENERIC],
}
_GENERIC_SET = frozenset(_GENERIC)
#: Pieces that keep their rank however often they are used (`,` and `:` among them).
_STRUCTURAL = frozenset([*_OTHER, '"', PARAM_CLOSE])
#: Trial advances (fork + accept) one plan search may make.
PLAN_TRIALS = 8192
#: The grammar's own string literals the planner tries as pieces (keys, tags: what
#: xgrammar's jump-forward would give, without its unbounded walk).
_LITERAL_PIECES = 32
_LITERAL_CHARS = 256
#: Characters one plan may hold.
PLAN_CHARS = 1024
_RAW_OPEN = b'string="true">'
_CONTEXT_BYTES = 4096
_ESCAPED = re.compile(rb"\\.", re.DOTALL)
_TAG = f"{DSML}".encode()


def _context(text: bytes) -> str:
    """Where the text ends: in a raw DSML parameter value, a JSON string, or elsewhere. Read
    from the last `_CONTEXT_BYTES` only: the answer may be long, this runs per planned piece,
    and a wrong guess costs only a worse plan (every token is still checked by the grammar)."""
    text = text[-_CONTEXT_BYTES:]
    tag = max(text.rfind(b"<" + _TAG), text.rfind(b"</" + _TAG))
    if tag >= 0:
        end = text.find(b">", tag)
        if end < 0:
            return "other"
        if text[end - len(_RAW_OPEN) + 1 : end + 1] == _RAW_OPEN:
            return "raw"
        text = text[end + 1 :]
    quotes = _ESCAPED.sub(b"", text).count(b'"')
    return "string" if quotes % 2 else "other"


class MatcherFailure(Exception):
    """The grammar cannot go on (it allows no token, or xgrammar failed): the request fails."""


@dataclass
class MatcherStats:
    """Time spent filling bitmasks (what DeepInfer pays per constrained token) and planning,
    and the planner's work (trial advances)."""

    masked_tokens: int = 0
    mask_seconds: float = 0.0
    plan_seconds: float = 0.0
    forced_tokens: int = 0
    plan_trials: int = 0
    plans: int = 0


class SimulatedMatcher:
    """One request's constraint in the simulated engine: `choose(preferred)` per token."""

    def __init__(
        self,
        compiled: Any,
        vocab: Vocab,
        max_tokens: int,
        trigger_token_ids: Sequence[int] = (),
        bound_token_id: int | None = None,
    ) -> None:
        xgr = xgrammar()
        self._xgr = xgr
        self.vocab = vocab
        self.remaining = max_tokens
        self.trigger = list(trigger_token_ids)
        self.bound = bound_token_id
        self.progress = 0
        self._failure = _kmp_failure(self.trigger)
        self.bound_fired = False
        self.finished = False
        self.stats = MatcherStats()
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab.vocab_size)
        literals = _grammar_literals(compiled)
        self._other = [*_OTHER, *literals, *_GENERIC]
        # Inside a raw parameter value only a tag (`</｜DSML｜ parameter>…`) ends the text.
        self._raw = [*(text for text in literals if text.startswith("</")), *_CANDIDATES["raw"]]
        self._text = b""
        self._plan: list[int] | None = None
        #: The plan came from `follow()`: once it runs out, plan again.
        self._followed = False
        #: False once a search found no completion within the bounds: no more planning.
        self._planning = True

    @classmethod
    def from_so_args(
        cls, so_args: Mapping[str, Any], compiler: Any, max_tokens: int
    ) -> SimulatedMatcher:
        """Build from so_args with a `GrammarCompiler` (shared, cached)."""
        compiled = compiler.compile(so_args)
        trigger = so_args.get("trigger_token_ids") or []
        return cls(compiled, compiler.vocab, max_tokens, trigger, so_args.get("bound_token_id"))

    @property
    def constrained(self) -> bool:
        """True once the grammar applies (trigger seen, or forced after the bound token)."""
        return self.bound_fired or self.progress >= len(self.trigger)

    def follow(self, tokens: Sequence[int]) -> None:
        """Take `tokens` as the start of the plan: ids the caller checked that the grammar
        takes in a row from where the constraint starts (a whole completion ends in EOS).
        Call it before the first constrained token. Preferred tokens that match them are
        emitted without planning (each still checked against the bitmask); once they run
        out the matcher plans the rest itself."""
        self._plan = list(tokens)
        self._followed = True

    def choose(self, preferred: int) -> int:
        """The token to emit instead of `preferred`; the matcher advances past it.

        Raises MatcherFailure when the grammar cannot go on."""
        try:
            token = self._choose(preferred)
        except MatcherFailure:
            raise
        except Exception as exc:  # xgrammar's errors: this request's grammar, not the engine
            raise MatcherFailure(f"the grammar matcher failed: {exc}") from exc
        self.remaining -= 1
        return token

    def _choose(self, preferred: int) -> int:
        if self.progress < len(self.trigger):
            token = self.trigger[self.progress] if self.bound_fired else preferred
            self._advance_trigger(token)
            return token
        if self.finished:
            return preferred
        started = time.perf_counter()
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self.stats.mask_seconds += time.perf_counter() - started
        self.stats.masked_tokens += 1
        if self._plan is None or (self._followed and not self._plan):
            # Best effort when nothing fits: a valid prefix, cut by max_tokens ("length").
            self._followed = False
            self._plan = self._complete(self._matcher, self._text, self.remaining) or []
        token = self._pick(preferred)
        if not self._allowed(token):  # a plan token the grammar does not take here
            self._plan = []
            token = self._first_allowed()
        if token != preferred:
            self.stats.forced_tokens += 1
        if not self._matcher.accept_token(token):
            raise MatcherFailure(f"the grammar rejected token {token}, which its mask allowed")
        self._text += self.vocab.token_bytes(token)
        if token == self.vocab.eos_id:
            self.finished = True
        return token

    def _pick(self, preferred: int) -> int:
        plan = self._plan or []
        if plan and preferred == plan[0]:
            return plan.pop(0)
        if self._allowed(preferred):
            if not self._planning:
                return preferred
            trial = self._matcher.fork()
            trial.accept_token(preferred)
            text = self._text + self.vocab.token_bytes(preferred)
            new_plan = self._complete(trial, text, self.remaining - 1)
            if new_plan is not None or not plan:
                self._plan = new_plan or []
                return preferred
        if plan:
            return plan.pop(0)
        return self._first_allowed()

    def _allowed(self, token: int) -> bool:
        if not 0 <= token < self.vocab.vocab_size:
            return False
        word = int(self._bitmask[0, token >> 5])
        return bool((word >> (token & 31)) & 1)

    def _first_allowed(self) -> int:
        """EOS when the grammar may end here, else the lowest allowed token that adds text
        (a special token that decodes to nothing would repeat forever)."""
        if self._allowed(self.vocab.eos_id):
            return self.vocab.eos_id
        words = self._bitmask[0].numpy().view(np.uint8)
        allowed = np.flatnonzero(np.unpackbits(words, bitorder="little"))
        for token in allowed.tolist():
            if token < self.vocab.vocab_size and self.vocab.token_bytes(token):
                return int(token)
        raise MatcherFailure("the grammar allows no token here (it matches no complete text)")

    def _advance_trigger(self, token: int) -> None:
        if self.bound_fired:
            self.progress += 1
            return
        progress = self.progress
        while progress > 0 and token != self.trigger[progress]:
            progress = self._failure[progress - 1]
        if token == self.trigger[progress]:
            progress += 1
        self.progress = progress
        if self.bound is not None and token == self.bound:
            self.bound_fired = True

    def _complete(self, matcher: Any, text: bytes, budget: int) -> list[int] | None:
        """Token ids (ending in EOS) that complete the grammar from `matcher`'s state within
        `budget` tokens, by a deterministic greedy walk within the planner's bounds; None if
        none was found (and, when the bounds ran out, planning stops for good)."""
        if not self._planning:
            return None
        started = time.perf_counter()
        self.stats.plans += 1
        trials = [PLAN_TRIALS]
        try:
            plan = self._greedy(matcher.fork(), text, budget, trials)
        finally:
            self.stats.plan_seconds += time.perf_counter() - started
            self.stats.plan_trials += PLAN_TRIALS - trials[0]
        if trials[0] <= 0:
            self._planning = False
        return plan

    def _greedy(self, state: Any, text: bytes, budget: int, trials: list[int]) -> list[int] | None:
        added = ""
        uses: dict[str, int] = {}
        limit = min(PLAN_CHARS, max(8, 8 * budget))
        while not state.is_completed():
            if len(added) > limit or budget <= 0:
                if limit == PLAN_CHARS and len(added) > limit:
                    trials[0] = 0  # longer than any plan the planner makes: stop planning
                return None
            step = self._step(state, text + added.encode(), uses, trials)
            if step is None:
                return None
            state, piece = step
            added += piece
        tokens = [*self.vocab.encode(added), self.vocab.eos_id]
        return tokens if len(tokens) <= budget else None

    def _step(
        self, state: Any, text: bytes, uses: dict[str, int], trials: list[int]
    ) -> tuple[Any, str] | None:
        context = _context(text)
        candidates = {"other": self._other, "raw": self._raw}.get(context) or _CANDIDATES[context]
        # Structural pieces keep their rank; the grammar's literals and generic characters
        # lose it after three uses.
        ordered = sorted(
            range(len(candidates)),
            key=lambda i: (
                0 if candidates[i] in _STRUCTURAL else uses.get(candidates[i], 0) // 3,
                i,
            ),
        )
        first: tuple[Any, str] | None = None
        for index in ordered:
            piece = candidates[index]
            if first is not None and piece in _GENERIC_SET and piece not in _STRUCTURAL:
                continue  # past the first fit only a structural piece may still finish it
            if trials[0] <= 0:
                return None
            trials[0] -= 1
            trial = state.fork()
            if not trial.accept_string(piece):
                continue
            if trial.is_completed():
                first = (trial, piece)
                break
            if first is None:
                first = (trial, piece)
        if first is not None:
            uses[first[1]] = uses.get(first[1], 0) + 1
        return first


def _grammar_literals(compiled: Any) -> list[str]:
    """Up to `_LITERAL_PIECES` of the grammar's string literals (2 to `_LITERAL_CHARS`
    characters), read from xgrammar's printed EBNF."""
    found: dict[str, None] = {}
    for raw in ebnf_literals(str(compiled.grammar)):
        if not 2 <= len(raw) <= 6 * _LITERAL_CHARS:
            continue
        try:
            text = json.loads(f'"{raw}"')
        except ValueError:
            continue
        if 2 <= len(text) <= _LITERAL_CHARS and text.strip():  # whitespace only pads
            found[text] = None
            if len(found) >= _LITERAL_PIECES:
                break
    return list(found)


def ebnf_literals(ebnf: str) -> Iterator[str]:
    """The raw (still escaped) text of each string literal, skipping character classes."""
    i, end = 0, len(ebnf)
    while i < end:
        char = ebnf[i]
        if char in '["':
            close = "]" if char == "[" else '"'
            j = i + 1
            while j < end and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            if char == '"':
                yield ebnf[i + 1 : j]
            i = j + 1
        else:
            i += 1


def _kmp_failure(seq: Sequence[int]) -> list[int]:
    failure = [0] * len(seq)
    k = 0
    for i in range(1, len(seq)):
        while k and seq[i] != seq[k]:
            k = failure[k - 1]
        if seq[i] == seq[k]:
            k += 1
        failure[i] = k
    return failure
